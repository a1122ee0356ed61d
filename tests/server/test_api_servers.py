"""`h2o-vllm serve --api-server-count 2`: vLLM then serves /metrics from a registry of each API
server's own over Prometheus' multiprocess files. Every API server reports the H2O metrics,
each with what the engine evicted (the policy's count, as one API server reports it in
test_tiny_server.py), and a misspelt per-request key is a 400 whichever server takes it."""
import json
import os
import re
import signal
from pathlib import Path

import openai
import pytest
import requests
from harness import Server, expected_counts, serving, wait_for

from h2o_vllm.config import H2OConfig

BLOCK_SIZE = 16
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 4}
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8",
         "--h2o-interval", "4", "--block-size", str(BLOCK_SIZE), "--api-server-count", "2"]
PROMPT = ("Free software is a matter of liberty, not price; to understand the concept you should "
          "think of free as in free speech, not as in free beer")


#: uvicorn's access log with the answering process's pid (vLLM's ``--log-config-file``).
ACCESS_LOG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"access": {"()": "uvicorn.logging.AccessFormatter",
                              "fmt": '%(process)d access %(client_addr)s "%(request_line)s" %(status_code)s'}},
    "handlers": {"access": {"class": "logging.StreamHandler", "formatter": "access",
                            "stream": "ext://sys.stdout"}},
    "loggers": {"uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False}}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_config = tmp_path_factory.mktemp("api-servers") / "log.json"
    log_config.write_text(json.dumps(ACCESS_LOG))
    with serving(Server(tiny_llama_dir, [*FLAGS, "--log-config-file", str(log_config)])) as server:
        yield server


def _complete(server, **xargs):
    return server.client().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=40, temperature=0.0,
        extra_body={"ignore_eos": True, **({"vllm_xargs": xargs} if xargs else {})})


def _answers(server, request: str) -> list[int]:
    """The pids of the API servers that answered ``request``, in the access log's order."""
    log = Path(server.log.name).read_text()
    return [int(pid) for pid in re.findall(r"^(\d+) access .*" + re.escape(request), log, flags=re.MULTILINE)]


def _on_each_api_server(server, call, request: str) -> dict[int, object]:
    """``call()``'s result from each of the two API servers, by pid. The kernel hands the shared
    listening socket's connections to whichever server is waiting, most often the same one:
    the server that answered first is paused (SIGSTOP) while the other answers."""
    results, paused = {}, None
    try:
        for _ in range(2):
            seen = len(_answers(server, request))
            result = call()
            assert wait_for(lambda: len(_answers(server, request)) > seen), server.tail()
            results[_answers(server, request)[-1]] = result
            if paused is None:
                paused = _answers(server, request)[-1]
                os.kill(paused, signal.SIGSTOP)
    finally:
        if paused is not None:
            os.kill(paused, signal.SIGCONT)
    assert len(results) == 2, f"one API server answered both times: {results}"
    return results


def test_every_api_server_reports_what_the_engine_evicted(server):
    before = server.settled_metrics()
    usage = _complete(server).usage
    expected = expected_counts(usage.prompt_tokens, usage.completion_tokens,
                               H2OConfig.from_dict(ENGINE_H2O), BLOCK_SIZE)
    assert expected["evicted_tokens"] > 0 and expected["freed_blocks"] > 0

    def delta(values):
        return {name: values[f"{name}_total"] - before[f"{name}_total"] for name in expected}
    # The worker's counts and the scheduler's gauge reach the files in separate flushes.
    def settled(values):
        return delta(values) == expected and values["live_kv_tokens"] == 0
    assert wait_for(lambda: settled(server.metrics())), (expected, server.metrics())
    for pid, values in _on_each_api_server(server, server.metrics, '"GET /metrics').items():
        assert settled(values), (pid, values)


def test_misspelt_h2o_key_is_400_on_every_api_server(server):
    def misspelt():
        with pytest.raises(openai.BadRequestError, match="unknown H2O key h2o_heavy_tokns") as info:
            _complete(server, h2o_heavy_tokns=32)
        return info.value.status_code
    answered = _on_each_api_server(server, misspelt, '"POST /v1/completions HTTP/1.1"')
    assert list(answered.values()) == [400, 400]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
