"""``prefill_chunk``: H2O evicts between prompt chunks, token for token the dense oracle, and a
prompt longer than the KV pool completes.

One in-process engine (CPU path) whose ``max_model_len`` exceeds its KV pool serves the matrix
(budgets x chunk sizes x prompts shorter and much longer than a chunk) concurrently, with
vLLM's own token budget splitting steps elsewhere than at chunk ends, prefix caching on (every
prompt repeats per budget) and one request aborted mid-run; the scheduler's block lists are
checked against the worker's after every step. The CUDA path (the switch, interpreted Triton)
serves a smaller matrix the same way.
"""
import os

import pytest
import torch

from budgets import BUDGETS, MODES, extra_args, oracle
from engines import (check_block_lists, greedy, h2o_group, model_runner_of, random_prompts, run_steps,
                     scheduler_of, vllm_engine)

BLOCK = 16
MAX_TOKENS = 12
#: The pool holds 24 blocks (384 tokens); max_model_len is 512. Stock vLLM refuses to start
#: there; with prefill_chunk H2O starts since one request's peak fits (policy.engine_peak_blocks;
#: the check itself: tests/unit/test_spec.py).
NUM_BLOCKS, MAX_MODEL_LEN = 24, 512
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "prefill_chunk": 64}
# One token, shorter than every chunk, a few chunks, and longer than the whole pool.
PROMPT_LENGTHS = (1, 17, 100, 450)
PROMPTS = random_prompts(PROMPT_LENGTHS, seed=3)
# Chunks of 8 (below the interval of a block, above one token), 24 (off the block and vLLM's
# token budget of 40) and 64; every budget with two of them, paper H2O with all three.
CASES = [("tokens-8+8-interval1", 8), ("tokens-8+8-interval1", 24), ("tokens-8+8-interval1", 64),
         ("ratio-0.1+0.1-block", 24), ("ratio-0.1+0.1-block", 64),
         ("local-0+0.2-interval1", 8), ("local-0+0.2-interval1", 64),
         ("all-modes-tokens-6+6-interval1", 8), ("all-modes-tokens-6+6-interval1", 24),
         ("pool-5-window-8-tokens-8+8-interval1", 24), ("pool-5-window-8-tokens-8+8-interval1", 64),
         # KeyDiff ranks the live keys at each chunk's compaction: one chunk size is enough.
         ("keydiff-pool-5-sinks-2-tokens-8+8-interval1", 24),
         # Expected Attention reads the last 32 queries of each compacting chunk: chunks of 64
         # that vLLM's 40-token steps would split inside that window.
         ("expected-pool-5-sinks-2-tokens-8+8-interval1", 64)]


def _budget(name: str, chunk: int) -> dict:
    return {**{**BUDGETS, **MODES}[name], "prefill_chunk": chunk}


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(hf_model):
    """The oracle's outputs for PROMPTS under a budget dict, each computed once."""
    done = {}

    def outputs(budget: dict):
        key = repr(sorted(budget.items()))
        if key not in done:
            done[key] = oracle(hf_model, budget, BLOCK).generate(PROMPTS, MAX_TOKENS)
        return done[key]
    return outputs


def serve_matrix(model_dir, cases, prompts, env=None, **kwargs) -> dict:
    """{case: outputs per prompt} from one in-process engine, driven step by step: block lists
    checked after every step, one extra request aborted mid-run, the pool drained at the end.
    Also returns what the run saw (evictions, steps that stopped inside a chunk)."""
    params = [greedy(MAX_TOKENS, extra_args=extra_args(_budget(*case))) for case in cases for _ in prompts]
    with vllm_engine(model_dir, in_process=True, env=env, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                     num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=40, max_num_seqs=8,
                     enable_prefix_caching=True, additional_config={"h2o": ENGINE_H2O}, **kwargs) as llm:
        layers = model_runner_of(llm).compilation_config.static_forward_context.values()
        impls = {type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")}
        assert impls == {"H2OTritonImpl" if env else "H2OCPUImpl"}, impls
        scheduler = scheduler_of(llm)
        _, manager = h2o_group(scheduler)
        pool = scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        seen = {"evicted": [], "mid_prompt_evictions": 0, "peak_blocks": 0}

        def check():
            seen["evicted"].extend(check_block_lists(llm, ENGINE_H2O, BLOCK))
            seen["mid_prompt_evictions"] += sum(
                r.num_computed_tokens < r.num_prompt_tokens and r.num_computed_tokens > 0
                and len(manager.req_to_blocks[r.request_id]) * BLOCK < r.num_computed_tokens
                for r in scheduler.running)
            seen["peak_blocks"] = max(seen["peak_blocks"], NUM_BLOCKS - 1 - pool.get_num_free_blocks())

        longest = max(prompts, key=len)
        if len(longest) > (NUM_BLOCKS - 1) * BLOCK:  # held whole, it cannot fit the pool
            with pytest.raises(ValueError) as refused:
                held_whole = greedy(4, extra_args={"h2o_prefill_chunk": 10_000})
                llm.generate([{"prompt_token_ids": longest}], held_whole, use_tqdm=False)
            seen["refused"] = str(refused.value)
        all_prompts = prompts * len(cases)
        aborted = str(len(all_prompts))
        by_id = run_steps(llm, all_prompts + [prompts[-1]], params + [params[-1]], on_step=check,
                          abort_after=(6, [aborted]), cached=seen.setdefault("cached", {}))
        assert aborted not in by_id
        assert pool.get_num_free_blocks() == free_before, "blocks leaked"
    outputs = [by_id[str(i)] for i in range(len(all_prompts))]
    n = len(prompts)
    return {case: outputs[i * n:(i + 1) * n] for i, case in enumerate(cases)}, seen


@pytest.fixture(scope="module")
def cpu_outputs(tiny_llama_dir):
    return serve_matrix(tiny_llama_dir, CASES, PROMPTS)


def test_the_run_evicted_inside_prompts_and_held_a_prompt_longer_than_the_pool(cpu_outputs):
    _, seen = cpu_outputs
    assert max(seen["evicted"]) > 0
    assert seen["mid_prompt_evictions"] > 0, "no prompt was ever compacted before its end"
    # Every prompt repeats per case: hits happen, only before each request's first compaction.
    assert max(seen["cached"].values()) >= BLOCK
    assert max(PROMPT_LENGTHS) > (NUM_BLOCKS - 1) * BLOCK  # longer than the pool, and it completed


@pytest.mark.parametrize("name, chunk", CASES)
def test_chunked_prefill_matches_dense_oracle(cpu_outputs, expected, name, chunk):
    outputs, _ = cpu_outputs
    for length, got, want in zip(PROMPT_LENGTHS, outputs[(name, chunk)], expected(_budget(name, chunk))):
        assert got == want, f"prompt of {length} tokens, chunks of {chunk}: diverges from the oracle"


def test_chunks_change_what_a_long_prompt_keeps(expected):
    """The control: the oracle's in-prompt eviction is not a no-op on these prompts."""
    assert expected(BUDGETS["tokens-8+8-interval1"]) != expected(_budget("tokens-8+8-interval1", 8))


def test_a_prompt_held_whole_that_cannot_fit_the_pool_is_refused(cpu_outputs):
    """Unchunked (a chunk longer than the prompt), the 450-token prompt would need 29 blocks of
    a 23-block pool: ``LLM.generate`` raised before queueing it, naming the fix, and the same
    engine then served the matrix."""
    _, seen = cpu_outputs
    assert "more than the KV pool's 23" in seen["refused"] and "h2o_prefill_chunk" in seen["refused"]


# A hybrid model (tiny Gemma 3: a sliding-window layer, window 24, and a full-attention one):
# H2O's group evicts between chunks while vLLM's window group keeps its window, in the same
# 24-block pool; the refusal counts both groups' blocks.
# The key scorers read the full-attention layers' keys (and, for Expected Attention, their
# queries and RoPE: Gemma 3's global one) there.
HYBRID_CASES = [("tokens-8+8-interval1", 24), ("pool-5-window-8-tokens-8+8-interval1", 64),
                ("keydiff-pool-5-sinks-2-tokens-8+8-interval1", 24),
                ("expected-pool-5-sinks-2-tokens-8+8-interval1", 64)]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from h2o_devtools import models
    return models.build_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", num_layers=2)


@pytest.fixture(scope="module")
def hybrid_outputs(hybrid_dir):
    return serve_matrix(hybrid_dir, HYBRID_CASES, PROMPTS)


def test_hybrid_model_evicts_between_chunks_and_refuses_counting_both_groups(hybrid_outputs):
    _, seen = hybrid_outputs
    assert seen["mid_prompt_evictions"] > 0
    # Held whole, the 450-token prompt needs 30 blocks in H2O's group (29, and with prefix
    # caching the budget's fresh block) and 5 in the window's (the window before a 40-token
    # step, plus the step): 35 of 23.
    assert "needs up to 35 KV blocks" in seen["refused"]
    assert "30 in each of 1 full-attention KV-cache groups and 5 in each of 1 sliding-window" in seen["refused"]


@pytest.mark.parametrize("name, chunk", HYBRID_CASES)
def test_hybrid_chunked_prefill_matches_dense_oracle(hybrid_outputs, hybrid_dir, name, chunk):
    from transformers import AutoModelForCausalLM
    outputs, _ = hybrid_outputs
    model = AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()
    assert outputs[(name, chunk)] == oracle(model, _budget(name, chunk), BLOCK).generate(PROMPTS, MAX_TOKENS)


# The CUDA path (H2OTritonAttentionBackend) under the switch, every Triton kernel interpreted
# (~1-2 s a step here): a smaller matrix on a two-layer model, with async scheduling on.
# The key scorers as on the CPU path: KeyDiff over the keys gathered at each chunk's
# compaction, Expected Attention from the last 32 queries of 64-token chunks in 40-token steps.
SWITCH_CASES = [("tokens-8+8-interval1", 8), ("all-modes-tokens-6+6-interval1", 24),
                ("keydiff-pool-5-sinks-2-tokens-8+8-interval1", 24),
                ("expected-pool-5-sinks-2-tokens-8+8-interval1", 64)]
SWITCH_PROMPTS = random_prompts((17, 100), seed=4)


@pytest.fixture(scope="module")
def two_layer_dir(tmp_path_factory):
    from h2o_devtools import models
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2-layers"), num_layers=2)


@pytest.fixture(scope="module")
def switch_outputs(two_layer_dir):
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET != 1")
    from h2o_vllm.vllm_hooks.triton_on_cpu import SWITCH
    outputs, seen = serve_matrix(two_layer_dir, SWITCH_CASES, SWITCH_PROMPTS,
                                 env={SWITCH: "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}, async_scheduling=True)
    return outputs, seen


@pytest.mark.parametrize("name, chunk", SWITCH_CASES)
def test_cuda_path_chunked_prefill_matches_dense_oracle(switch_outputs, two_layer_dir, name, chunk):
    from transformers import AutoModelForCausalLM
    outputs, seen = switch_outputs
    assert seen["mid_prompt_evictions"] > 0
    model = AutoModelForCausalLM.from_pretrained(two_layer_dir, dtype=torch.float32).eval()
    expected = oracle(model, _budget(name, chunk), BLOCK).generate(SWITCH_PROMPTS, MAX_TOKENS)
    assert outputs[(name, chunk)] == expected
