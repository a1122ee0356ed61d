"""Speculative decoding on H2O's CUDA path (``H2OTritonAttentionBackend``): every speculator
vLLM ships, on Model Runner V1 and V2, generates the dense oracle's tokens with drafts accepted.
The fused kernel attends a verification row without scoring it, and the accepted queries are
scored at the row's next step (``worker/cuda/drafts.py``); a drafter's own layers run vLLM's
Triton attention over their whole cache. tests/engine/test_speculative.py has the CPU path's
matrix, preemption and aborts.

Its own module so that the suite's workers split the CUDA-path tests (each file runs whole
on one worker).
"""
import pytest
import torch

from budgets import extra_args, oracle_matrix
from cuda_path import CUDA_PATH_RUNS, DEVICE
from engines import (V2_ENV, check_block_lists, greedy, in_fresh_process, random_prompts,
                     repeated_passages, run_steps, scheduler_of, spec_decode_counts, vllm_engine)

if not CUDA_PATH_RUNS:
    pytest.skip("no GPU and TRITON_INTERPRET != 1", allow_module_level=True)

CUDA_PATH_BUDGETS = {
    "tokens-8+8-interval6": {"heavy_tokens": 8, "recent_tokens": 8, "interval": 6},
    "decay-tokens-6+8-interval5": {"heavy_tokens": 6, "recent_tokens": 8, "interval": 5, "decay": 0.9},
    "window-sinks-tokens-6+6-interval7": {"heavy_tokens": 6, "recent_tokens": 6, "interval": 7,
                                          "obs_window": 8, "sink_tokens": 2},
    # The key scorers, with room for drafts between compactions: their scores come from the
    # keys the device gathers at the compaction (and Expected Attention's from that step's one
    # query: its token runs alone), never from the held verification queries.
    "keydiff-pool-5-sinks-2-tokens-8+8-interval6": {"heavy_tokens": 8, "recent_tokens": 8, "interval": 6,
                                                    "score": "keydiff", "pool_kernel": 5, "sink_tokens": 2},
    "expected-pool-5-sinks-2-tokens-8+8-interval5": {"heavy_tokens": 8, "recent_tokens": 8, "interval": 5,
                                                     "score": "expected", "pool_kernel": 5, "sink_tokens": 2},
}
CUDA_PATH_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _cuda_path_speculative_run(model_dir, prompts, speculative_config, v2="0", async_scheduling=False,
                               budgets=tuple(CUDA_PATH_BUDGETS)[:3]):
    """In a fresh process: an engine with a speculator registers vLLM's speculative Triton
    kernels in its process, after which vLLM's dispatcher fails the next engine started there
    (tests/engine/test_speculative.py). ``v2``: VLLM_USE_V2_MODEL_RUNNER."""
    params = [greedy(CUDA_PATH_TOKENS, extra_args=extra_args(CUDA_PATH_BUDGETS[b])) for b in budgets
              for _ in prompts]
    with vllm_engine(model_dir, in_process=True, block_size=16, max_model_len=256,
                     speculative_config=speculative_config, disable_log_stats=False,
                     additional_config={"h2o": {}}, async_scheduling=async_scheduling,
                     **dict(DEVICE, env={**DEVICE.get("env", {}), V2_ENV: v2})) as llm:
        evicted = []
        outputs = run_steps(llm, prompts * len(budgets), params,
                            on_step=lambda: evicted.extend(
                                check_block_lists(llm, {}, 16, speculative_config["num_speculative_tokens"])))
        return outputs, spec_decode_counts(llm), max(evicted), _whole_groups(llm)


def _whole_groups(llm) -> int:
    """KV-cache groups H2O leaves whole: on these full-attention targets, a drafter's own."""
    from h2o_vllm.spec import is_h2o_spec
    return sum(not is_h2o_spec(g.kv_cache_spec) for g in scheduler_of(llm).kv_cache_config.kv_cache_groups)


#: The key scorers on the n-gram cases (CI time: a drafter does not enter the target's scoring):
#: Expected Attention on both runners, KeyDiff on V1.
SCORER_BUDGETS = {"ngram": ("keydiff-pool-5-sinks-2-tokens-8+8-interval6",
                            "expected-pool-5-sinks-2-tokens-8+8-interval5"),
                  "ngram_gpu": ("expected-pool-5-sinks-2-tokens-8+8-interval5",)}


@pytest.mark.parametrize("speculator, v2, scheduling", [
    ("ngram", "0", "sync"), ("draft_model", "0", "sync"), ("ngram_gpu", "1", "async")],
    ids=lambda v: {"0": "v1", "1": "v2"}.get(v, v))
def test_speculative_h2o_on_the_cuda_path_equals_the_oracle(smollm2_4_layers_dir, speculator, v2, scheduling):
    """``H2OTritonAttentionBackend``: the fused kernel attends a verification row without
    scoring it, and the accepted queries are scored at the row's next step
    (``worker/cuda/drafts.py``); a draft model's layers (the same four-layer model drafting
    for itself) run vLLM's Triton attention over their whole cache. Model Runner V2 drafts
    n-grams on the device (``ngram_gpu``, which vLLM runs under async scheduling: its drafts
    are unverified when the next step is scheduled and planned). Without a GPU, inside vLLM's
    CPU engine under the Triton interpreter; SmolLM2's first four layers copy the repeated
    passages. The n-gram cases add the key scorers (``SCORER_BUDGETS``)."""
    from transformers import AutoModelForCausalLM
    prompts = repeated_passages(smollm2_4_layers_dir, ((16, 3), (24, 2)))
    budgets = tuple(CUDA_PATH_BUDGETS)[:3] + SCORER_BUDGETS.get(speculator, ())
    model = AutoModelForCausalLM.from_pretrained(smollm2_4_layers_dir, dtype=torch.float32).eval()
    expected = oracle_matrix(model, {name: CUDA_PATH_BUDGETS[name] for name in budgets}, 16, prompts,
                             CUDA_PATH_TOKENS, full=prompts)
    full = expected.pop("full")
    spec = {**NGRAM, "method": speculator} if speculator.startswith("ngram") else {
        "method": "draft_model", "model": str(smollm2_4_layers_dir), "num_speculative_tokens": 3}
    outputs, (drafts, accepted), evicted, whole = in_fresh_process(
        _cuda_path_speculative_run, smollm2_4_layers_dir, prompts, spec, v2, scheduling == "async", budgets,
        env={**DEVICE.get("env", {}), V2_ENV: v2})
    assert 0 < accepted < drafts and evicted > 0
    assert (whole == 0) == speculator.startswith("ngram"), "a draft model's layers keep their KV cache whole"
    n = len(prompts)
    for i, name in enumerate(budgets):
        assert [outputs[str(i * n + j)] for j in range(n)] == expected[name], name
    assert any(expected[name] != full for name in budgets)


TOKENS, DECAY, WINDOW, KEYDIFF, EXPECTED = CUDA_PATH_BUDGETS


#: Each drafter on each runner once, and both schedulings on each runner. MTP on V2 under async
#: scheduling, vLLM's CUDA default, runs in test_speculative.py's preemption and abort tests.
#: Budgets pairwise (CI time: the interpreter's cost grows with every row): every budget on
#: every runner and scheduling (V1 sync and V2 async also run all three in the n-gram and
#: draft-model cases above), and every drafter beside two or three of them. A budget's score
#: mode and cadence act on the target's H2O layers only, where the runner and the scheduling
#: decide when held drafts are scored and compacted; which drafter proposed the tokens does not
#: enter there (its own layer keeps a whole cache, checked by every case).
@pytest.mark.parametrize("method, v2, scheduling, budgets", [
    ("eagle", "0", "sync", (TOKENS, WINDOW)), ("eagle3", "1", "async", (TOKENS, WINDOW)),
    ("draft_model", "1", "async", (DECAY, WINDOW)), ("eagle3", "0", "async", (TOKENS, DECAY)),
    ("mtp", "0", "async", (WINDOW, TOKENS)), ("mtp", "1", "sync", (TOKENS, DECAY, WINDOW))],
    ids=lambda v: {"0": "v1", "1": "v2"}.get(v, v) if isinstance(v, str) else "+".join(b.split("-")[0] for b in v))
def test_model_drafters_on_the_cuda_path_equal_the_oracle(mirrored_drafter, method, v2, scheduling, budgets):
    """An EAGLE-1 and an EAGLE-3 head, a draft model (the target drafting for itself) and a
    model's own MTP layer, on the CUDA path with Model Runner V1 and V2: the drafter's layer runs
    vLLM's Triton attention over its whole cache, the target's the fused kernel; drafts
    accepted, tokens the oracle's. Async scheduling (V2's default): each step is scheduled and
    prepared while the previous step's drafts are unverified; the scheduler holds back a
    compaction behind them and the worker plans on the verified counts."""
    from transformers import AutoModelForCausalLM
    target, spec = mirrored_drafter(method, 3)
    prompts = random_prompts([20, 30, 40, 25], seed=4)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    expected = oracle_matrix(model, {name: CUDA_PATH_BUDGETS[name] for name in budgets}, 16, prompts,
                             CUDA_PATH_TOKENS, full=prompts)
    full = expected.pop("full")
    outputs, (drafts, accepted), evicted, whole = in_fresh_process(
        _cuda_path_speculative_run, target, prompts, spec, v2, scheduling == "async", budgets,
        env={**DEVICE.get("env", {}), V2_ENV: v2})
    assert 0 < accepted < drafts and evicted > 0
    assert whole >= 1, "the drafter's layer keeps its KV cache whole, in a group of its own"
    n = len(prompts)
    for i, name in enumerate(budgets):
        assert [outputs[str(i * n + j)] for j in range(n)] == expected[name], name
    assert any(expected[name] != full for name in budgets)
