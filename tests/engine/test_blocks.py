"""Memory really freed: block counts follow the live KV length, the scheduler's and the
worker's block lists agree after every step, the pool drains, more sequences run at once,
and preemption or aborts leak nothing. In-process engines, so the scheduler is inspectable.
"""
import logging

import pytest
from vllm.utils.math_utils import cdiv

from engines import check_block_lists, greedy, random_prompts, run_steps, scheduler_of, vllm_engine
from h2o_vllm.config import H2OConfig
from h2o_vllm.policy import kv_len_after, peak_kv_len

BLOCK = 16
# The paper's rule (no floor): the counts below are for 20% of a 64-token prompt.
H2O = {"heavy_ratio": 0.1, "recent_ratio": 0.1, "min_tokens": 0}
# Long generation on a small pool: stock vLLM fits ~4 of these sequences (16 blocks each).
LONG_PROMPT, LONG_OUTPUT, NUM_LONG, POOL = 64, 192, 24, 65


def _manager(scheduler):
    return scheduler.kv_cache_manager.coordinator.single_type_managers[0]


@pytest.fixture(scope="module")
def h2o_llm(tiny_llama_dir):
    with vllm_engine(tiny_llama_dir, in_process=True, block_size=BLOCK, num_gpu_blocks_override=POOL,
                     additional_config={"h2o": H2O}) as llm:
        yield llm


@pytest.fixture(scope="module")
def stock_llm(tiny_llama_dir):
    """H2O off (token-identical to stock vLLM, see test_exactness), same pool."""
    with vllm_engine(tiny_llama_dir, in_process=True, block_size=BLOCK, num_gpu_blocks_override=POOL) as llm:
        yield llm


def _drive_counting(llm, num_requests, extra_args=None):
    """(running per step, preemptions) for num_requests long-generation requests at once."""
    scheduler = scheduler_of(llm)
    running, preemptions = [], []
    preempt = scheduler._preempt_request

    def counting_preempt(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting_preempt
    try:
        prompts = random_prompts([LONG_PROMPT] * num_requests, seed=1)
        outputs = run_steps(llm, prompts, greedy(LONG_OUTPUT, extra_args=extra_args),
                       on_step=lambda: running.append(len(scheduler.running)))
    finally:
        del scheduler._preempt_request
    assert all(len(o) == LONG_OUTPUT for o in outputs.values()) and len(outputs) == num_requests
    return running, len(preemptions)


def test_h2o_runs_three_times_more_sequences_at_once(h2o_llm, stock_llm):
    (stock, _), (h2o, _) = _drive_counting(stock_llm, NUM_LONG), _drive_counting(h2o_llm, NUM_LONG)
    stock_mean, h2o_mean = sum(stock) / len(stock), sum(h2o) / len(h2o)
    print(f"running sequences: stock mean {stock_mean:.1f} peak {max(stock)}; "
          f"H2O 20% mean {h2o_mean:.1f} peak {max(h2o)}")
    assert h2o_mean >= 3 * stock_mean


def test_admission_leaves_room_so_h2o_never_preempts_under_overload(h2o_llm):
    """More requests than even H2O can hold: they queue, and the running ones grow in
    lockstep towards their next compaction. Admissions keep room for that growth
    (H2OManager.admission_headroom: each sequence's peak is known), so nothing is ever
    recomputed; without the reserve this workload preempted 203 times."""
    budget = H2OConfig.from_dict(H2O).budget(LONG_PROMPT, BLOCK)
    peak_blocks = cdiv(peak_kv_len(LONG_PROMPT, LONG_PROMPT + LONG_OUTPUT, budget), BLOCK)
    running, preemptions = _drive_counting(h2o_llm, 3 * NUM_LONG)
    print(f"H2O 20%, {3 * NUM_LONG} requests: running mean {sum(running) / len(running):.1f} "
          f"peak {max(running)} (pool holds {POOL // peak_blocks} at their peak); preemptions {preemptions}")
    assert max(running) < 3 * NUM_LONG, "everything fit: the check proves nothing"
    assert preemptions == 0
    # The reserve is exact, not a blanket cap: the pool is used up to the running peaks
    # (less one prompt being admitted).
    assert max(running) >= (POOL - cdiv(LONG_PROMPT, BLOCK)) // peak_blocks - 1


def test_budget_above_every_length_admits_like_stock(h2o_llm, stock_llm):
    """The admission headroom looks one interval ahead, not to the end of a sequence: with a
    budget no sequence reaches (nothing is ever compacted) H2O admits about as many requests
    as stock vLLM on the same pool, instead of reserving every sequence's full length."""
    (stock, _), (never_compacted, _) = (_drive_counting(stock_llm, NUM_LONG), _drive_counting(
        h2o_llm, NUM_LONG, extra_args={"h2o_heavy_tokens": 2 * (LONG_PROMPT + LONG_OUTPUT),
                                       "h2o_recent_tokens": 8}))
    stock_mean, h2o_mean = sum(stock) / len(stock), sum(never_compacted) / len(never_compacted)
    print(f"running sequences, nothing compacted: stock mean {stock_mean:.1f}, H2O {h2o_mean:.1f}")
    assert h2o_mean >= 0.8 * stock_mean


def test_block_lists_follow_live_kv_length_and_agree_with_worker(h2o_llm):
    scheduler = scheduler_of(h2o_llm)
    manager = _manager(scheduler)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    budgets = [{}, {"h2o_interval": 1}, {"h2o_heavy_tokens": 5, "h2o_recent_tokens": 3}]
    prompts = random_prompts([3, 20, 40, 70, 100, 33], seed=2)
    params = [greedy(60, extra_args=budgets[i % 3] or None) for i in range(len(prompts))]
    checked = []

    def check():
        checked.extend(check_block_lists(h2o_llm, H2O, BLOCK))

    outputs = run_steps(h2o_llm, prompts, params, on_step=check)
    assert all(len(o) == 60 for o in outputs.values())
    assert max(checked) > 0, "no request ever evicted: the check proved nothing"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert not manager.num_evicted and not manager._admitted, "per-request state outlived its request"


@pytest.mark.parametrize("chunk", [None, 32])
def test_preemption_completes_every_request_without_leaking(h2o_llm, monkeypatch, chunk):
    """vLLM's preemption (free everything, recompute later) still works and leaks nothing,
    with prompts held whole and evicted between chunks (a recompute then re-runs the chunks).
    The admission headroom makes it rare, so it is turned off here to force preemptions
    (the engine runs in this process, so patching the class reaches its manager)."""
    from h2o_vllm.scheduler.manager import H2OManager
    monkeypatch.setattr(H2OManager, "admission_headroom", lambda self, *args: 0)
    scheduler = scheduler_of(h2o_llm)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    preempted = []
    # A budget that keeps whole prompts and compacts rarely: the pool overflows.
    budget = {"h2o_heavy_tokens": 96, "h2o_recent_tokens": 96, "h2o_interval": 64}
    if chunk:  # long enough prompts that a chunk end inside them compacts (at 256)
        budget["h2o_prefill_chunk"] = chunk
    prompts = random_prompts([300 if chunk else 150] * 8, seed=3)
    outputs = run_steps(h2o_llm, prompts, greedy(100, extra_args=budget),
                   on_step=lambda: preempted.extend(r.request_id for r in scheduler.running
                                                    if r.num_preemptions))
    assert preempted, "the pool was large enough: no preemption happened"
    assert len(outputs) == 8 and all(len(o) == 100 for o in outputs.values())
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_aborted_requests_return_their_blocks(h2o_llm):
    scheduler = scheduler_of(h2o_llm)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    prompts = random_prompts([40, 90, 130, 60], seed=4)
    outputs = run_steps(h2o_llm, prompts, greedy(80, extra_args={"h2o_interval": 1}),
                   abort_after=(20, ["1", "3"]))
    assert sorted(outputs) == ["0", "2"]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert not _manager(scheduler).num_evicted


def test_compaction_is_logged_at_debug_level(h2o_llm, caplog):
    with caplog.at_level(logging.DEBUG, logger="h2o_vllm"):
        run_steps(h2o_llm, random_prompts([50], seed=5), greedy(40))
    messages = [r.getMessage() for r in caplog.records]
    assert any("compacted from" in m for m in messages)   # worker: evicted tokens
    assert any("freed" in m and "blocks" in m for m in messages)  # scheduler: freed blocks


# A draft model beside H2O: its one layer's KV cache stays whole, a KV-cache group of its own
# that grows with every token from the same pool; every step allocates slots for its drafts.
DRAFTER_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 64}
DRAFTS = 3


@pytest.fixture(scope="module")
def drafter_llm(tiny_llama_dir, tmp_path_factory):
    from h2o_devtools import models
    draft = models.build_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), num_layers=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFTS}
    with vllm_engine(tiny_llama_dir, in_process=True, block_size=BLOCK, num_gpu_blocks_override=150,
                     max_model_len=256, speculative_config=spec, additional_config={"h2o": DRAFTER_H2O}) as llm:
        yield llm


@pytest.mark.parametrize("whole_group_claimed", [True, False])
def test_admission_with_a_drafter_keeps_room_for_its_whole_cache(drafter_llm, monkeypatch, whole_group_claimed):
    """Twenty-four requests on a pool that holds about five, each generating one interval:
    admission keeps room for each running sequence's next interval in every group, the
    drafter's whole one included (``H2OManager.whole_group_headroom``), draft slots included:
    nothing is preempted. With the H2O groups' claims alone it preempts (6 times here)."""
    from h2o_vllm.scheduler.manager import H2OManager
    from h2o_vllm.vllm_shims.introspect import count_preemptions
    if not whole_group_claimed:
        monkeypatch.setattr(H2OManager, "whole_group_headroom", lambda self, *args: 0)
    scheduler = scheduler_of(drafter_llm)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    preemptions = count_preemptions(scheduler)
    running = []

    def check():
        check_block_lists(drafter_llm, DRAFTER_H2O, BLOCK, DRAFTS)
        running.append(len(scheduler.running))

    try:
        outputs = run_steps(drafter_llm, random_prompts([64] * 24, seed=1), greedy(64), on_step=check)
    finally:
        del scheduler._preempt_request
    print(f"draft model, whole group claimed: {whole_group_claimed}: {preemptions()} preemptions, "
          f"running mean {sum(running) / len(running):.1f} peak {max(running)}")
    assert len(outputs) == 24 and all(len(o) == 64 for o in outputs.values())
    assert max(running) < 24, "everything fit: the check proves nothing"
    assert (preemptions() == 0) == whole_group_claimed
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
