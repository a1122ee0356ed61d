"""H2OManager on a real vLLM BlockPool: blocks counted in KV space, compacted tails freed,
per-request budgets, nothing leaked (admission headroom: test_admission.py; prefix caching:
test_prefix_hits.py).

Requests are vLLM's real ``vllm.v1.request.Request``. The manager is called as
``KVCacheManager.allocate_slots`` calls it (free skipped blocks, count, allocate; logical token
counts). Expected counts come from ``policy.kv_len_after`` or by hand.
"""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from h2o_vllm.config import Budget, H2OConfig
from h2o_vllm.policy import kv_len_after
from h2o_vllm.scheduler.manager import H2OManager
from h2o_vllm.spec import H2OAttentionSpec

BLOCK = 16
ENGINE = H2OConfig(heavy_tokens=8, recent_tokens=8)  # budget 16, interval one block
BUDGET = Budget(8, 8, BLOCK)
MAX_LEN = 4096


def _full(block_size=BLOCK):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32)


def _manager(config=ENGINE, num_blocks=64, block_size=BLOCK, caching=False, pool=None):
    pool = pool or BlockPool(num_gpu_blocks=num_blocks, enable_caching=caching, hash_block_size=block_size)
    return H2OManager(H2OAttentionSpec.from_full(_full(block_size), config), block_pool=pool,
                      enable_caching=caching, kv_cache_group_id=0, scheduler_block_size=block_size)


def _request(rid, prompt_len, max_tokens=100, extra_args=None, **kwargs):
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
                   None, **kwargs)


def _grow(manager, rid, num_tokens):
    """Count, then allocate, ``num_tokens`` logical tokens; returns the new blocks' count."""
    count = manager.get_num_blocks_to_allocate(rid, num_tokens, [], 0, 0, num_tokens)
    assert len(manager.allocate_new_blocks(rid, num_tokens, num_tokens)) == count
    return count


def _prefill(manager, request):
    """Add (budget), admit (headroom), allocate the prompt, compact at its end: now running."""
    n = request.num_prompt_tokens
    manager.budgets.resolve(request.request_id, n, request.sampling_params)
    manager.admission_headroom(request, n, MAX_LEN)
    _grow(manager, request.request_id, n)
    request.num_computed_tokens = n
    manager.cut_scheduled(request.request_id, n, n)


def test_manager_allocates_in_kv_space_after_eviction():
    m = _manager()
    assert _grow(m, "r", 100) == 7  # nothing evicted yet: KV space == logical, cdiv(100, 16)
    m.cut_scheduled("r", 100, 100)
    assert kv_len_after(100, 100, BUDGET) == 16 and len(m.req_to_blocks["r"]) == 1
    # The next decode step asks for 101 logical tokens = 17 in KV space: two blocks, not seven.
    assert m.get_num_blocks_to_allocate("r", 101, [], 0, 0, 101) == 1
    assert _grow(m, "r", 101) == 1 and len(m.req_to_blocks["r"]) == 2 == cdiv(17, BLOCK)
    stock = FullAttentionManager(_full(), block_pool=m.block_pool, enable_caching=False,
                                 kv_cache_group_id=0, scheduler_block_size=BLOCK)
    assert stock.get_num_blocks_to_allocate("s", 101, [], 0, 0, 101) == 7  # control


@pytest.mark.parametrize("processed", [64, 100, 115, 116, 140])
def test_manager_cut_scheduled_frees_exact_tail(processed):
    m = _manager()
    _grow(m, "r", processed)  # uncompacted: cdiv(processed, 16) blocks
    before, free = list(m.req_to_blocks["r"]), m.block_pool.get_num_free_blocks()
    m.cut_scheduled("r", processed, 100)
    kv = kv_len_after(processed, 100, BUDGET)  # 64 (mid-prompt), 16, 31, 16, 24
    keep = cdiv(kv, BLOCK)
    assert m.req_to_blocks["r"] == before[:keep]  # the head stays, the tail goes
    assert m.block_pool.get_num_free_blocks() - free == len(before) - keep == m.num_freed_blocks
    assert all(b.ref_cnt == 0 for b in before[keep:])
    assert m.num_evicted["r"] == processed - kv


def test_manager_leaves_vllms_remove_skipped_blocks_calls_alone():
    """vLLM calls it on the processed-token basis, a step behind under async scheduling:
    H2O's cut comes from the schedule hook instead."""
    m = _manager()
    _grow(m, "r", 116)
    before, free = list(m.req_to_blocks["r"]), m.block_pool.get_num_free_blocks()
    m.remove_skipped_blocks("r", 116, 100)
    assert (m.req_to_blocks["r"], m.block_pool.get_num_free_blocks()) == (before, free)
    assert m.num_freed_blocks == 0 and m.num_evicted == {}


def test_manager_request_budget_overrides_engine_default():
    m = _manager(H2OConfig(min_tokens=0))  # the paper's: 10% + 10% of the prompt, interval one block
    small = SamplingParams(extra_args={"h2o_heavy_tokens": 2, "h2o_recent_tokens": 2, "h2o_interval": 1})
    assert m.budgets.resolve("small", 100, small) == Budget(2, 2, 1)
    assert m.budgets.resolve("default", 100) == Budget(10, 10, BLOCK)
    for rid in ("small", "default"):
        _grow(m, rid, 101)
        m.cut_scheduled(rid, 101, 100)  # the manager's own lookup carries no extra_args
    # small: compacts to 4 every token -> 4 live, 97 evicted; default: 20 + 1 -> 21 live, 80 evicted.
    assert m.num_evicted == {"small": 97, "default": 80}
    assert [len(m.req_to_blocks[r]) for r in ("small", "default")] == [1, 2]


def test_manager_free_returns_every_block_and_forgets_request():
    m = _manager()
    pool, capacity = m.block_pool, m.block_pool.get_num_free_blocks()
    a, b = _request("a", 100), _request("b", 40)
    for request in (a, b):
        _prefill(m, request)
        _grow(m, request.request_id, request.num_prompt_tokens + 1)
    assert pool.get_num_free_blocks() == capacity - 4 and m.num_evicted == {"a": 84, "b": 24}
    m.free("a")  # KVCacheManager.free -> coordinator -> manager.free
    popped = m.pop_blocks_for_free("b")  # the other path: the caller frees
    assert len(popped) == 2
    pool.free_blocks(reversed(popped))
    assert pool.get_num_free_blocks() == capacity
    assert not m.req_to_blocks and not m.num_evicted
    # Nothing of "a" survives: the id starts over in logical space, it claims no headroom.
    assert m.get_num_blocks_to_allocate("a", 101, [], 0, 0, 101) == 7
    assert m.admission_headroom(_request("c", 10, max_tokens=6), 10, MAX_LEN) == 0


@settings(max_examples=60, deadline=None)
@given(prompt_len=st.integers(1, 120), heavy=st.integers(0, 24), recent=st.integers(0, 24),
       interval=st.integers(1, 40), steps=st.integers(0, 80), chunk=st.integers(1, 128),
       block_size=st.sampled_from([4, 16]))
def test_manager_holds_cdiv_kv_len_blocks_every_step(prompt_len, heavy, recent, interval, steps,
                                                     chunk, block_size):
    assume(heavy + recent > 0)
    config = H2OConfig(heavy_tokens=heavy, recent_tokens=recent, interval=interval)
    m = _manager(config, num_blocks=256, block_size=block_size)
    budget, capacity = config.budget(prompt_len, block_size), m.block_pool.get_num_free_blocks()
    processed, freed = 0, 0
    while processed < prompt_len + steps:  # a chunked prefill, then one token per step
        step = min(chunk, prompt_len - processed) if processed < prompt_len else 1
        held = len(m.req_to_blocks["r"])
        want = cdiv(kv_len_after(processed, prompt_len, budget) + step, block_size) - held
        assert _grow(m, "r", processed + step) == want
        processed += step
        held = len(m.req_to_blocks["r"])
        m.cut_scheduled("r", processed, prompt_len)
        kv = kv_len_after(processed, prompt_len, budget)
        assert len(m.req_to_blocks["r"]) == cdiv(kv, block_size)
        freed += held - cdiv(kv, block_size)
        assert m.block_pool.get_num_free_blocks() + len(m.req_to_blocks["r"]) == capacity
        assert m.num_evicted["r"] == processed - kv and m.num_freed_blocks == freed


# --------------------------------------------------------------------------- prefill_chunk

CHUNKED = H2OConfig(heavy_tokens=8, recent_tokens=8, prefill_chunk=32)  # budget 16 + 16, chunks of 32


def test_a_chunked_prompt_is_held_a_chunk_at_a_time_and_admitted_on_its_peak():
    """A 400-token prompt in chunks of 32: each chunk end compacts (16 + 32 >= 32), so the row
    never holds more than 16 + 32 tokens, and the whole-sequence check vLLM makes before
    admitting (``apply_admission_cap``) asks for that peak, not for 25 blocks."""
    from h2o_vllm.scheduler import scheduling
    m = _manager(CHUNKED)
    request = _request("r", 400, max_tokens=8)
    scheduling.add_request([m], request)
    assert m.get_num_blocks_to_allocate("r", 400, [], 0, 0, 400, apply_admission_cap=True) == 3
    assert m.get_num_blocks_to_allocate("r", 400, [], 0, 0, 400) == 25  # what it asks uncapped
    during, computed = [], 0
    while computed < 400:
        num_new = scheduling.limit_step([m], request, computed, min(40, 400 - computed))  # vLLM offers 40
        assert num_new == min(32 - computed % 32, 400 - computed)     # never past a chunk's end
        _grow(m, "r", computed + num_new)
        during.append(len(m.req_to_blocks["r"]))                      # while the step runs
        computed += num_new
        m.cut_scheduled("r", computed, 400)
        assert len(m.req_to_blocks["r"]) == cdiv(kv_len_after(computed, 400, CHUNKED.budget(400, BLOCK)), BLOCK)
    assert max(during) == 3 and m.num_freed_blocks >= 2 * (400 // 32 - 1)
    assert scheduling.limit_step([m], request, 400, 1) == 1  # decoding: no limit
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == m.block_pool.num_gpu_blocks - 1
