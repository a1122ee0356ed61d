"""`h2o-vllm serve --data-parallel-size 2` (one core per engine): two independent engine cores,
each with its own scheduler, KV pool and worker, behind two API servers (vLLM's default for DP).
Requests sent at once spread over both engines; every answer equals the dense oracle for its
budget (the engine's or its own, per request) whichever engine served it; /metrics reports the
sum over engines of what the policy says each request evicts and frees; and both engines'
pools end idle (vLLM's per-engine KV usage back to 0)."""
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from harness import Server, expected_counts, serving, wait_for

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import H2OOracle

BLOCK_SIZE = 16
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 4}
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8",
         "--h2o-interval", "4", "--block-size", str(BLOCK_SIZE), "--data-parallel-size", "2"]
MAX_TOKENS = 32
TEXT = ("Free software is a matter of liberty, not price; to understand the concept you should think "
        "of free as in free speech, not as in free beer. A program is free software if its users "
        "have the four essential freedoms: to run it as they wish, for any purpose; to study how it "
        "works and change it; to redistribute copies; and to distribute copies of modified versions")
PROMPTS = [" ".join(TEXT.split()[i:i + n]) for i, n in ((0, 14), (3, 30), (9, 45), (20, 60))]
#: Per-request budgets (vllm_xargs); None: the engine's budget from the flags.
XARGS = [None,
         {"h2o_heavy_tokens": 4, "h2o_recent_tokens": 4, "h2o_interval": 1},
         {"h2o_heavy_ratio": 0.1, "h2o_recent_ratio": 0.1, "h2o_min_tokens": 0}]
CASES = [(prompt, xargs) for xargs in XARGS for prompt in PROMPTS]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # Each engine's worker takes one of the two cores (vLLM splits the list by DP rank).
    with serving(Server(tiny_llama_dir, FLAGS, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})) as server:
        yield server


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _config(xargs) -> H2OConfig:
    return H2OConfig.from_dict(ENGINE_H2O).with_overrides(
        {key.removeprefix("h2o_"): value for key, value in (xargs or {}).items()})


def _complete(server, prompt, xargs):
    extra_body = {"ignore_eos": True, "return_token_ids": True, **({"vllm_xargs": xargs} if xargs else {})}
    return server.client().completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0.0, extra_body=extra_body)


def _per_engine(server, metric: str) -> dict[str, float]:
    """vLLM's own metric by its ``engine`` label (its DP rank), summed over other labels."""
    import requests
    values: dict[str, float] = {}
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        match = re.match(rf'{re.escape(metric)}{{.*engine="(\d+)".*}} (\S+)$', line)
        if match:
            values[match[1]] = values.get(match[1], 0.0) + float(match[2])
    return values


def test_both_engines_serve_evict_and_free_exactly(server, hf_model):
    before, served_before = server.settled_metrics(), _per_engine(server, "vllm:request_success_total")
    with ThreadPoolExecutor(len(CASES)) as pool:  # at once: vLLM's balancer spreads them
        responses = list(pool.map(lambda case: _complete(server, *case), CASES))

    served = _per_engine(server, "vllm:request_success_total")
    assert sorted(served) == ["0", "1"]
    assert all(served[e] > served_before.get(e, 0.0) for e in served), f"one engine took every request: {served}"

    expected = {"evicted_tokens": 0, "compactions": 0, "freed_blocks": 0}
    for (prompt, xargs), response in zip(CASES, responses):
        choice, config = response.choices[0], _config(xargs)
        want = H2OOracle(hf_model, config, block_size=BLOCK_SIZE).generate([choice.prompt_token_ids], MAX_TOKENS)
        assert choice.token_ids == want[0], (prompt, xargs)
        for name, count in expected_counts(len(choice.prompt_token_ids), len(choice.token_ids),
                                           config, BLOCK_SIZE).items():
            expected[name] += count
    assert all(count > 0 for count in expected.values())
    full = H2OOracle(hf_model, _config({"h2o_heavy_tokens": 1024, "h2o_recent_tokens": 1024}),
                     block_size=BLOCK_SIZE).generate([responses[-1].choices[0].prompt_token_ids], MAX_TOKENS)
    assert full[0] != responses[-1].choices[0].token_ids, "eviction changed nothing: a weak check"

    def delta():
        now = server.metrics()
        return {name: now[f"{name}_total"] - before[f"{name}_total"] for name in expected}
    assert wait_for(lambda: delta() == expected), (expected, delta())
    assert wait_for(lambda: server.metrics()["live_kv_tokens"] == 0)
    usage = _per_engine(server, "vllm:kv_cache_usage_perc")
    assert sorted(usage) == ["0", "1"] and wait_for(
        lambda: not any(_per_engine(server, "vllm:kv_cache_usage_perc").values())), usage
