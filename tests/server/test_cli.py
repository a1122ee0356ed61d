"""The `h2o-vllm` command and vLLM's own API-server entry point: H2O flags in --help, bad flags
exit non-zero before any model loads, with a message naming the flag.

The commands run concurrently (each spends ~20 s importing vLLM)."""
import subprocess
import sys

import pytest
from harness import H2O_VLLM, server_env

API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
HELP = {
    "serve": [H2O_VLLM, "serve", "--help=H2O KV eviction"],
    "bench-throughput": [H2O_VLLM, "bench", "throughput", "--help=H2O KV eviction"],
}
#: (command after the model, flag the error must name)
BAD = {
    "out-of-range": ([H2O_VLLM, "serve", "{model}", "--kv-eviction", "h2o", "--h2o-heavy-ratio", "1.5"],
                     "--h2o-heavy-ratio"),
    "conflict-with-additional-config": (
        [*API_SERVER, "--model", "{model}", "--h2o-recent-tokens", "8",
         "--additional-config", '{"h2o": {"recent_ratio": 0.1}}'], "--h2o-recent-tokens"),
    "none-with-budget": ([H2O_VLLM, "serve", "{model}", "--kv-eviction", "none", "--h2o-interval", "4"],
                         "--h2o-interval"),
}


@pytest.fixture(scope="module")
def runs(tiny_llama_dir):
    commands = {**HELP, **{name: [a.replace("{model}", str(tiny_llama_dir)) for a in cmd] for name, (cmd, _) in BAD.items()}}
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=server_env(), start_new_session=True)
             for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        results[name] = (proc.returncode, out)
    return results


@pytest.mark.parametrize("name", HELP)
def test_help_lists_h2o_flags(runs, name):
    code, out = runs[name]
    assert code == 0, out[-3000:]
    for flag in ("--kv-eviction", "--h2o-heavy-ratio", "--h2o-recent-ratio", "--h2o-heavy-tokens",
                 "--h2o-recent-tokens", "--h2o-interval"):
        assert flag in out, out[-3000:]


@pytest.mark.parametrize("name", BAD)
def test_bad_flag_exits_before_model_loads(runs, name):
    code, out = runs[name]
    flag = BAD[name][1]
    assert code == 2, out[-3000:]
    assert f"error: {flag}" in out or f"error: argument {flag}" in out, out[-3000:]
    assert "EngineCore" not in out and "Starting to load model" not in out
