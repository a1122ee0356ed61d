"""H2O with vLLM's prefix cache on: requests that hit the cache generate exactly what the dense
oracle does (= what they would without the hit), no cached block changes while it is indexed,
and the pool drains after preemption and abort.

One in-process engine (block 16) serves the budget matrix per request; prompts share prefixes
of several lengths, so hits end mid-prompt, at a shared system prompt, and cover whole prompts.
"""
import hashlib

import pytest
import torch

from budgets import BUDGETS, MODES, extra_args, oracle
from engines import generate_ids, greedy, model_runner_of, random_prompts, run_steps, scheduler_of, vllm_engine

BLOCK = 16
MAX_TOKENS = 24
SYSTEM = random_prompts([70], seed=1)[0]           # a shared "system prompt": 4 blocks + 6 tokens
TAILS = random_prompts([5, 20, 33, 1], seed=2)
# The system prompt with different questions; one prompt twice (the whole-prompt hit); one
# extending another (a next chat turn).
PROMPTS = [SYSTEM + t for t in TAILS] + [SYSTEM + TAILS[1]] + [SYSTEM + TAILS[1] + TAILS[2]]
CASES = {**BUDGETS, **MODES}


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


ENGINES = {
    "unchunked": {},
    # Prompts prefilled 32 tokens a step: records are written in later chunks than the hit,
    # and blocks are cached (and checked) steps before the compaction that must spare them.
    "chunked": dict(max_num_batched_tokens=32, max_num_seqs=8),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, tiny_llama_dir):
    with vllm_engine(tiny_llama_dir, in_process=True, additional_config={"h2o": {}},
                     block_size=BLOCK, enable_prefix_caching=True, **ENGINES[request.param]) as llm:
        yield llm


def _hit_tokens(llm, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens or 0 for o in outputs]


@pytest.mark.parametrize("budget", list(CASES))
def test_hits_generate_what_the_oracle_does(engine, hf_model, budget):
    """Sequential requests (each may hit what the earlier ones cached), then all of them at
    once (hits on blocks computed by requests in the same batch or just before)."""
    params = greedy(MAX_TOKENS, extra_args=extra_args(CASES[budget]))
    expected = oracle(hf_model, CASES[budget], BLOCK).generate(PROMPTS, MAX_TOKENS)
    hits = []
    for prompt, want in zip(PROMPTS, expected):
        (got,), (hit,) = _hit_tokens(engine, [prompt], params)
        assert got == want, f"a {len(prompt)}-token prompt after a hit of {hit} diverges"
        hits.append(hit)
    together, _ = _hit_tokens(engine, PROMPTS, params)
    assert together == expected
    # The control: hits happened, of several lengths, so this test could have failed.
    assert len({h for h in hits if h}) >= 2, hits


def test_every_budget_hits_what_another_budget_cached(engine, hf_model):
    """One prompt under every budget in turn: the K/V hit is shared across budgets, the score
    record only where the decay agrees (a window needs none)."""
    prompt = PROMPTS[2]
    for name, config in CASES.items():
        (got,), _ = _hit_tokens(engine, [prompt], greedy(MAX_TOKENS, extra_args=extra_args(config)))
        assert got == oracle(hf_model, config, BLOCK).generate([prompt], MAX_TOKENS)[0], name


def _digest(caches, block_id: int) -> str:
    h = hashlib.sha1()
    for cache in caches:
        h.update(cache[block_id].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_cached_blocks_never_change_while_indexed(engine):
    """After every step, each block the prefix cache indexes under an unchanged hash holds the
    same K/V bytes in every layer as when first seen; compaction ran meanwhile."""
    scheduler, runner = scheduler_of(engine), model_runner_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    caches = list(runner.kv_caches)
    seen: dict[tuple[int, object], str] = {}
    checked = 0

    def on_step():
        nonlocal checked
        for block in pool.blocks:
            if block.block_hash is None:
                continue
            digest = _digest(caches, block.block_id)
            key = (block.block_id, block.block_hash)
            assert seen.setdefault(key, digest) == digest, f"cached block {block.block_id} changed"
            checked += 1
    prompts = PROMPTS + random_prompts([40, 90], seed=3)
    run_steps(engine, prompts, greedy(MAX_TOKENS, extra_args=extra_args(BUDGETS["tokens-8+8-interval1"])),
              on_step=on_step)
    assert checked > 0
    assert scheduler.kv_cache_manager.coordinator.single_type_managers[0].num_freed_blocks > 0


def _idle(llm) -> None:
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.running and not scheduler.waiting
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert not manager.req_to_blocks and not manager.fresh and not manager.pending_records


def test_abort_with_shared_blocks_leaves_an_idle_pool(engine):
    params = greedy(MAX_TOKENS, extra_args=extra_args(BUDGETS["ratio-0.1+0.1-block"]))
    run_steps(engine, PROMPTS, params, abort_after=(2, "1"))
    _idle(engine)


def test_preemption_with_shared_blocks(tiny_llama_dir, monkeypatch):
    """A pool too small for every request at once, and no admission headroom (so vLLM
    preempts): requests sharing the system prompt are preempted and recomputed, hitting the
    cache again; every request completes and the pool drains. The engine runs in this
    process, so patching the class reaches its manager."""
    from h2o_vllm.scheduler.manager import H2OManager
    monkeypatch.setattr(H2OManager, "admission_headroom", lambda self, *args: 0)
    budget = {"h2o_heavy_tokens": 48, "h2o_recent_tokens": 48, "h2o_interval": 64}
    prompts = [SYSTEM + t for t in random_prompts([50, 51, 52, 53, 54, 55], seed=4)]
    with vllm_engine(tiny_llama_dir, in_process=True, additional_config={"h2o": {}},
                     block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=40,
                     max_model_len=512) as llm:
        scheduler = scheduler_of(llm)
        preempted = set()
        outputs = run_steps(llm, prompts, greedy(100, extra_args=budget),
                            on_step=lambda: preempted.update(r.request_id for r in scheduler.running
                                                             if r.num_preemptions))
        assert preempted, "the pool was large enough: no preemption happened"
        assert len(outputs) == len(prompts) and all(len(o) == 100 for o in outputs.values())
        _idle(llm)
