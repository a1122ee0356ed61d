"""`--distributed-executor-backend ray` on this CPU: vLLM's CPU platform has no Ray device key,
so stock vLLM itself (no plugin loaded) cannot start a Ray executor, and H2O fails the same way
with vLLM's own message, before any weight loads. Run against a local Ray cluster the test
starts (the one-machine stand-in for two nodes). The day vLLM's CPU engine gains Ray, the stock
case starts and this test fails: then H2O's Ray run against the oracle belongs here."""
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is the optional extra h2o-vllm[ray]")

RAY = str(Path(sys.executable).with_name("ray"))
CPU_HAS_NO_RAY = "current platform cpu does not support ray"
ENGINE = """
import sys
from vllm import LLM
h2o = {"additional_config": {"h2o": {}}} if sys.argv[2] == "h2o" else {}
try:
    LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32",
        enforce_eager=True, max_model_len=256, block_size=16, **h2o)
    print("ENGINE STARTED")
finally:
    print("PLUGIN LOADED", "h2o_vllm.plugin" in sys.modules)
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head node on 127.0.0.1 with Ray's default token authentication (the token passed in
    the environment, as a second node or a driver would get it); yields the clients' env."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                    "--num-cpus=2", "--include-dashboard=false",
                    f"--temp-dir={tmp_path_factory.mktemp('ray')}"],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("engine", ["stock", "h2o"])
def test_cpu_engine_cannot_start_a_ray_executor(engine, ray_cluster, tiny_llama_dir):
    env = {**ray_cluster, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if engine == "stock":
        env["VLLM_PLUGINS"] = "none"  # vLLM loads only the plugins named: none of ours
    run = subprocess.run([sys.executable, "-c", ENGINE, str(tiny_llama_dir), engine], env=env,
                         capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "ENGINE STARTED" not in output, output[-4000:]
    assert CPU_HAS_NO_RAY in output, output[-4000:]
    assert "Starting to load model" not in output
    assert f"PLUGIN LOADED {engine == 'h2o'}" in output
