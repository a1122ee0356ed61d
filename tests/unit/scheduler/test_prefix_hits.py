"""H2O with vLLM's prefix cache, scheduler side: H2OManager with caching on, on a real vLLM
BlockPool(enable_caching=True) and real Requests with a block hasher, driven the way vLLM's
scheduler drives it (scheduler/manager.py, scheduler/prefix_hits.py).

``Engine`` below is a small stand-in for vLLM's Scheduler + KVCacheManager: a waiting request
gets vLLM's hit (``find_longest_cache_hit``), cut by ``cut_hit`` as the get_computed_blocks hook
does, then ``allocate_slots``' calls in its order (count, add the hit, allocate, cache); ``schedule``
ends as the schedule hook does, with ``prefix_orders`` and then the compacted tails cut
(``cut_scheduled``); ``finish_step`` is update_from_output (``commit_records``, CoW retentions
released). Every
allocation checks that the pool gave exactly the count ``get_num_blocks_to_allocate`` returned.
"""
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from h2o_vllm.config import H2OConfig
from h2o_vllm.policy import kv_len_after
from h2o_vllm.scheduler import scheduling
from h2o_vllm.scheduler.manager import H2OManager
from h2o_vllm.scheduler.prefix_hits import commit_records, cut_hit, prefix_orders, record_key
from h2o_vllm.spec import H2OAttentionSpec

BLOCK = 4
ENGINE = H2OConfig(heavy_tokens=4, recent_tokens=4)  # budget 8, interval one block (4)
NUM_BLOCKS = 64

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def _full():
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _request(rid, tokens, extra_args=None, max_tokens=100):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
                   None, block_hasher=HASHER)


def _ids(blocks):
    return [b.block_id for b in blocks]


class Engine:
    def __init__(self, config=ENGINE, num_blocks=NUM_BLOCKS):
        self.pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK)
        self.m = H2OManager(H2OAttentionSpec.from_full(_full(), config), block_pool=self.pool,
                            enable_caching=True, kv_cache_group_id=0, scheduler_block_size=BLOCK)
        self.requests: dict[str, Request] = {}
        self.waiting: set[str] = set()
        self.copies: list = []     # CoW pairs of the last schedule
        self.counts: dict[str, int] = {}
        self.hits: dict[str, list] = {}  # rid -> the (cut) hit's cached blocks

    def add(self, request):
        scheduling.add_request([self.m], request)
        self.requests[request.request_id] = request
        self.waiting.add(request.request_id)
        return request

    def vllm_hit(self, request):
        """vLLM's own lookup (KVCacheManager.get_computed_blocks): at most num_tokens - 1."""
        (blocks,), n = self.m.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1, [0], self.pool, self.m.kv_cache_spec,
            False, BLOCK)
        return blocks, n

    def schedule(self, tokens: dict[str, int]):
        """One schedule: tokens per request (None: the rest of its tokens); returns the orders."""
        m, new = self.m, []
        self.counts = {}
        for rid, n in tokens.items():
            request = self.requests[rid]
            hit = None
            if rid in self.waiting:
                self.waiting.discard(rid)
                new.append(SimpleNamespace(req_id=rid))
                blocks, num_hit = self.vllm_hit(request)
                cut = cut_hit(m, request, num_hit, blocks)
                hit = blocks[:cut // BLOCK]
                self.hits[rid] = hit
                request.num_computed_tokens = cut
            if n is None:
                n = request.num_tokens - request.num_computed_tokens
                tokens[rid] = n
            total = request.num_computed_tokens
            main = total + n
            free = self.pool.get_num_free_blocks()
            count = m.get_num_blocks_to_allocate(rid, main, hit or [], total, total, main)
            if hit is not None:
                m.add_local_computed_blocks(rid, hit, total, 0)
            m.allocate_new_blocks(rid, main, main)
            m.cache_blocks(request, min(main, request.num_tokens), replay_boundaries=[])
            assert free - self.pool.get_num_free_blocks() == count, rid
            self.counts[rid] = count
            request.num_computed_tokens = main  # vLLM counts the scheduled tokens in schedule()
        self.copies = m.take_pending_cow_copies()
        output = SimpleNamespace(num_scheduled_tokens=dict(tokens), scheduled_new_reqs=new,
                                 scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))
        orders = prefix_orders(self.m, output, self.requests)
        scheduling.cut_scheduled([self.m], output, self.requests)
        return orders

    def finish_step(self, sampled: dict[str, int] | None = None):
        """update_from_output: records committed, CoW retentions released, decode tokens
        appended."""
        commit_records([self.m])
        self.pool.free_blocks([b for pair in self.copies for b in pair])
        self.copies = []
        for rid, token in (sampled or {}).items():
            self.requests[rid].append_output_token_ids(token)

    def run_prompt(self, request, chunk=None):
        """Admit and prefill a whole prompt (in chunks of ``chunk``), one step per chunk;
        returns the orders of each step."""
        self.add(request)
        orders = []
        while request.num_computed_tokens < request.num_prompt_tokens or request.request_id in self.waiting:
            if request.request_id in self.waiting:
                blocks, n = self.vllm_hit(request)  # look ahead to size the first chunk
                start = cut_hit(self.m, request, n)
            else:
                start = request.num_computed_tokens
            left = request.num_prompt_tokens - start
            orders.append(self.schedule({request.request_id: left if chunk is None else min(chunk, left)}))
            self.finish_step()
        return orders

    def free(self, rid):
        """A request that finishes (vLLM frees its blocks in reverse order)."""
        self.pool.free_blocks(reversed(self.m.pop_blocks_for_free(rid)))
        scheduling.finish_request([self.m], rid)
        self.requests.pop(rid)

    def key(self, request, num_blocks, decay=1.0):
        budget = H2OConfig(heavy_tokens=1, decay=decay).budget(1, BLOCK)
        return record_key(request, num_blocks, budget, BLOCK, BLOCK)


PROMPT = list(range(100, 120))  # 20 tokens, 5 blocks; records at its last boundary: 16


# --- cache_blocks ------------------------------------------------------------------------

def test_cache_blocks_caches_only_full_prompt_blocks():
    wide = {"h2o_heavy_tokens": 64, "h2o_recent_tokens": 64}  # never compacts here
    e = Engine()
    r = e.add(_request("r", range(22), extra_args=wide))  # 5 full blocks + 2 tokens
    e.schedule({"r": None})
    e.finish_step()
    row = e.m.req_to_blocks["r"]
    assert [b.block_hash is not None for b in row] == [True] * 5 + [False]
    for token in (22, 23):  # block 6 fills with output tokens
        r.append_output_token_ids(token)
        e.schedule({"r": 1})
        e.finish_step()
    assert r.num_computed_tokens == 24 and len(e.m.req_to_blocks["r"]) == 6
    assert e.m.req_to_blocks["r"][5].block_hash is None  # output tokens are never cached
    # Control: stock vLLM caches that block.
    stock = FullAttentionManager(_full(), block_pool=e.pool, enable_caching=True,
                                 kv_cache_group_id=0, scheduler_block_size=BLOCK)
    stock.allocate_new_blocks("r", 24, 24)  # its own bookkeeping, same request
    stock.cache_blocks(r, 24, replay_boundaries=[])
    assert all(b.block_hash is not None for b in stock.req_to_blocks["r"])


def test_cache_blocks_caches_nothing_once_compacted():
    e = Engine()
    r = e.add(_request("r", range(18)))  # 4 full blocks + 2; compacts to 8 at its end
    e.schedule({"r": None})
    e.finish_step()
    assert e.m.num_evicted["r"] == 10
    row = e.m.req_to_blocks["r"]
    assert len(row) == 2 and all(b.block_hash is None for b in row)
    for token in range(6):  # logical 24: six full logical blocks, stock would cache more
        r.append_output_token_ids(1000 + token)
        e.schedule({"r": 1})
        e.m.cache_blocks(r, r.num_tokens, replay_boundaries=[])
        e.finish_step()
    assert all(b.block_hash is None for b in e.m.req_to_blocks["r"])
    assert e.m.num_cached_block["r"] == 4  # nothing past the 4 prompt blocks it cached


# --- a hit, redirected -------------------------------------------------------------------

def _recorded_prompt(e, tokens=PROMPT, rid="a", extra_args=None):
    """A request that prefills ``tokens`` (records its last boundary), then finishes."""
    a = _request(rid, tokens, extra_args=extra_args)
    e.run_prompt(a)
    e.free(rid)
    return a


def test_hit_is_redirected_to_copies_with_record_slots():
    e = Engine()
    a = _recorded_prompt(e)
    record = e.m.records.ready(e.key(a, 4))
    assert record is not None and record.num_blocks == 4
    cached = [e.pool.get_cached_block(h, [0])[0] for h in a.block_hashes[:4]]
    assert all(b.ref_cnt == 0 for b in cached)  # a finished: cached, evictable
    free = e.pool.get_num_free_blocks()
    b = e.add(_request("b", PROMPT))
    orders = e.schedule({"b": None})
    assert e.hits["b"] == cached and b.num_computed_tokens == 20
    copies = [c for _, c in e.copies]
    # The row held copies, not the cached blocks; the cached ones keep their hashes, stay in
    # the cache, and stay held (the hit ref) until the copy has run.
    assert [s.block_id for s, _ in e.copies] == _ids(cached)
    assert not set(_ids(copies)) & set(_ids(cached))
    assert all(c.block_hash is None for c in copies)
    assert [e.pool.get_cached_block(h, [0])[0] for h in a.block_hashes[:4]] == cached
    assert all(s.ref_cnt == 1 for s in cached)
    # The step ends the prompt: its first compaction moved the row to its fresh blocks when
    # it was scheduled; the copies are held by their CoW retention alone until the step has run.
    row = e.m.req_to_blocks["b"]
    assert orders.fresh_blocks == {"b": _ids(row)} and not set(_ids(row)) & set(_ids(copies))
    assert all(c.ref_cnt == 1 for c in copies)
    assert orders.score_inits == list(zip(_ids(copies), record.slots))
    assert e.m.step_score_inits == []  # drained into the orders
    # Count: 1 new block + 4 evictable hit blocks touched + 4 copies + 2 fresh (the step
    # ends the prompt: first compaction, 8 tokens = 2 blocks).
    assert e.counts["b"] == 1 + 4 + 4 + 2
    e.finish_step()
    assert all(s.ref_cnt == 0 and s.block_hash is not None for s in cached)  # back in the cache


def test_obs_window_hit_is_cut_to_the_window_and_scores_zeros():
    e = Engine()
    a = _request("a", PROMPT, extra_args={"h2o_obs_window": 7})
    e.run_prompt(a)
    assert len(e.m.records) == 0 and e.m.records.slots_in_use == 0  # records nothing
    e.free("a")
    b = e.add(_request("b", PROMPT, extra_args={"h2o_obs_window": 7}))
    blocks, n = e.vllm_hit(b)
    assert n == 16
    orders = e.schedule({"b": None})
    # floor((20 - 7) / 4) = 3 blocks, without any record.
    assert b.num_computed_tokens == 20 and len(e.hits["b"]) == 3
    assert [slot for _, slot in orders.score_inits] == [-1, -1, -1]
    assert len(e.m.records) == 0 and orders.record_writes == []


# --- the first compaction into fresh blocks, later ones in place, no leak ---------------

def test_first_compaction_moves_the_row_to_fresh_blocks_then_compacts_in_place():
    e = Engine()
    capacity = e.pool.get_num_free_blocks()
    assert capacity == NUM_BLOCKS - 1
    r = e.add(_request("r", PROMPT))
    free = e.pool.get_num_free_blocks()
    orders = e.schedule({"r": 12})  # a first chunk: no compaction in this step
    assert e.counts["r"] == 3 and "r" not in e.m.fresh and orders.fresh_blocks == {}
    e.finish_step()
    # The chunk that ends the prompt: 2 more blocks + fresh blocks for kv_len_after = 8.
    assert kv_len_after(20, 20, ENGINE.budget(20, BLOCK)) == 8
    orders = e.schedule({"r": 8})
    assert e.counts["r"] == 2 + 2
    # Cut when scheduled: the row became the fresh blocks; all five old ones went back
    # (cached ones keep their hashes).
    fresh = list(e.m.req_to_blocks["r"])
    old = [e.pool.get_cached_block(h, [0])[0] for h in r.block_hashes[:5]]
    assert orders.fresh_blocks == {"r": _ids(fresh)} and len(fresh) == 2 and "r" not in e.m.fresh
    assert not set(_ids(fresh)) & set(_ids(old))
    assert all(b.ref_cnt == 0 for b in old)
    assert e.pool.get_num_free_blocks() == free - 2
    assert e.m.num_freed_blocks == 3  # 5 held - 2 kept
    e.finish_step()
    assert e.m.req_to_blocks["r"] == fresh
    # Later compactions: in place, no fresh blocks.
    for i in range(4):  # 21..24: compaction at 24 back to 8
        r.append_output_token_ids(1000 + i)
        orders = e.schedule({"r": 1})
        assert orders.fresh_blocks == {} and "r" not in e.m.fresh
        e.finish_step()
    assert e.m.num_evicted["r"] == 16 and e.m.req_to_blocks["r"] == fresh
    e.free("r")
    assert e.pool.get_num_free_blocks() == capacity


def test_pop_blocks_for_free_returns_unused_fresh_blocks():
    """Preempted between the schedule that allocated its fresh blocks and the step's end."""
    e = Engine()
    capacity = e.pool.get_num_free_blocks()
    e.add(_request("r", PROMPT))
    e.m.allocate_new_blocks("r", 20, 20)  # allocate_slots for the whole prompt, in schedule()
    # ... and preempted later in the same schedule, before the hook cuts the row
    held = list(e.m.req_to_blocks["r"]) + list(e.m.fresh["r"])
    popped = e.m.pop_blocks_for_free("r")
    assert sorted(_ids(popped)) == sorted(_ids(held)) and len(popped) == 7
    e.pool.free_blocks(reversed(popped))
    assert e.pool.get_num_free_blocks() == capacity and not e.m.fresh


def test_a_step_shortened_after_allocation_keeps_the_fresh_blocks_its_compaction_needs():
    """vLLM padded a one-token step with 3 dummy drafts and allocated for all 4; H2O then takes
    the padding off (``scheduling.drop_padding``): fresh blocks sized for 23 tokens (kv_len 11, 3
    blocks) become what the step that ends at 20 needs (kv_len 8, 2 blocks), or none when the
    shorter step does not compact; the rest go back to the pool."""
    for end, kept in ((20, 2), (19, 0)):
        e = Engine()
        capacity = e.pool.get_num_free_blocks()
        e.add(_request("r", PROMPT))
        e.m.allocate_new_blocks("r", 23, 23)
        assert len(e.m.fresh["r"]) == cdiv(kv_len_after(23, 20, ENGINE.budget(20, BLOCK)), BLOCK) == 3
        held = len(e.m.req_to_blocks["r"])
        e.m.step_shortened("r", end)
        assert len(e.m.fresh.get("r", ())) == kept and ("r" in e.m.step_fresh) == bool(kept)
        assert e.pool.get_num_free_blocks() == capacity - held - kept
        e.m.step_shortened("r", end)  # once is all: nothing more to give back
        assert e.pool.get_num_free_blocks() == capacity - held - kept


def test_no_leak_across_hits_compactions_and_frees():
    e = Engine()
    capacity = e.pool.get_num_free_blocks()
    _recorded_prompt(e)
    for rid in ("b", "c"):  # two hits on the same record, at once
        e.add(_request(rid, PROMPT))
    e.schedule({"b": None, "c": None})
    assert len(e.copies) == 8
    e.finish_step()
    for i in range(5):
        for rid in ("b", "c"):
            e.requests[rid].append_output_token_ids(7 + i)
        e.schedule({"b": 1, "c": 1})
        e.finish_step()
    e.free("b")
    e.free("c")
    assert e.pool.get_num_free_blocks() == capacity == NUM_BLOCKS - 1
    assert all(b.ref_cnt == 0 for b in e.pool.blocks[1:])


# --- cut_hit ----------------------------------------------------------------------------

def test_hit_without_record_is_cut_to_zero():
    e = Engine()
    a = _request("a", PROMPT)
    e.run_prompt(a)
    e.free("a")
    e.m.records.drop(e.m.records._index[e.key(a, 4)])  # the cache keeps the blocks, not the record
    b = e.add(_request("b", PROMPT))
    _, n = e.vllm_hit(b)
    assert n == 16  # vLLM would hit 4 blocks
    assert cut_hit(e.m, b, n) == 0
    assert e.m.longest_match["b"] == 4 and e.m.hit_records["b"] is None


def test_ready_record_lets_the_hit_through_to_its_boundary():
    e = Engine()
    a = _recorded_prompt(e)  # record at 4 blocks
    longer = PROMPT + list(range(500, 512))  # 32 tokens: vLLM hits the same 4 blocks
    b = e.add(_request("b", longer))
    assert cut_hit(e.m, b, 16) == 16 and e.m.hit_records["b"] is e.m.records.ready(e.key(a, 4))
    # Cut back to the longest recorded boundary below the match, not past it.
    c = e.add(_request("c", PROMPT[:10] + [7] * 10))  # shares 2 blocks
    rec2 = e.m.records.reserve(e.key(c, 2), 2, "x")
    e.m.records.commit(rec2)
    assert cut_hit(e.m, b, 16) == 16
    e.m.records.drop(e.m.records._index[e.key(a, 4)])
    assert cut_hit(e.m, b, 16) == 8 and e.m.hit_records["b"] is rec2
    assert cut_hit(e.m, b, 4) == 0  # the 1-block prefix has no record


def test_record_of_another_decay_does_not_serve():
    e = Engine()
    a = _recorded_prompt(e, extra_args={"h2o_decay": 0.9})
    assert e.m.records.ready(e.key(a, 4, 0.9)) is not None
    paper = e.add(_request("b", PROMPT))
    assert cut_hit(e.m, paper, 16) == 0
    other = e.add(_request("c", PROMPT, extra_args={"h2o_decay": 0.8}))
    assert cut_hit(e.m, other, 16) == 0
    same = e.add(_request("d", PROMPT, extra_args={"h2o_decay": 0.9}))
    assert cut_hit(e.m, same, 16) == 16


@pytest.mark.parametrize("prompt_len, window, matched, expected_blocks",
                         [(20, 7, 4, 3), (20, 4, 4, 4), (20, 20, 4, 0), (20, 30, 4, 0), (20, 9, 2, 2),
                          (23, 3, 5, 5)])
def test_obs_window_cut_is_floor_of_prompt_minus_window(prompt_len, window, matched, expected_blocks):
    e = Engine()
    r = e.add(_request("r", range(prompt_len), extra_args={"h2o_obs_window": window}))
    assert expected_blocks == min(matched, max(0, prompt_len - window) // BLOCK)
    assert cut_hit(e.m, r, matched * BLOCK) == expected_blocks * BLOCK
    assert e.m.hit_records["r"] is None


# --- plan_records / prefix_orders / commit_records -----------------------------------------

SHARED = list(range(100, 112))                  # 3 blocks A and C share
C_TOKENS = SHARED + list(range(300, 318))       # 30 tokens; last boundary 28 (7 blocks)


def test_record_writes_appear_in_the_step_crossing_each_boundary():
    e = Engine()
    _recorded_prompt(e)  # caches A's 5 prompt blocks; records A at 16
    c = e.add(_request("c", C_TOKENS))
    _, n = e.vllm_hit(c)
    assert n == 12  # the shared 3 blocks, no record at 3 blocks: cut to 0
    orders = [e.schedule({"c": 12})]  # [0, 12): ends exactly at the first boundary
    # c plans its longest match (3 blocks) and its last boundary (7 blocks).
    planned = list(e.m.pending_records["c"])  # commit_records prunes the list in place
    assert [r.num_blocks for r in planned] == [3, 7]
    assert all(e.m.records.ready(r.key) is None for r in planned)
    e.finish_step()
    for chunk in (6, 2, 7, 3):  # [12, 18) starts at it; [18, 20) [20, 27) [27, 30) crosses 28
        orders.append(e.schedule({"c": chunk}))
        e.finish_step()
    writes = [[(rid, boundary, slots) for rid, boundary, slots in o.record_writes] for o in orders]
    assert writes == [[("c", 12, planned[0].slots)], [], [], [], [("c", 28, planned[1].slots)]]
    assert e.m.pending_records["c"] == []


def test_one_step_crossing_both_boundaries_writes_both_in_order():
    e = Engine()
    _recorded_prompt(e)
    c = e.add(_request("c", C_TOKENS))
    orders = e.schedule({"c": None})
    assert [(rid, boundary) for rid, boundary, _ in orders.record_writes] == [("c", 12), ("c", 28)]
    e.finish_step()
    assert e.m.records.ready(e.key(c, 3)) is not None and e.m.records.ready(e.key(c, 7)) is not None


def test_commit_makes_records_usable_by_cut_hit():
    e = Engine()
    _recorded_prompt(e)
    c = e.add(_request("c", C_TOKENS))
    e.schedule({"c": None})
    d = e.add(_request("d", C_TOKENS))
    f = e.add(_request("f", SHARED + [9] * 8))
    # Not yet committed: the step has not run.
    assert cut_hit(e.m, d, 28) == 0 and cut_hit(e.m, f, 12) == 0
    e.finish_step()
    assert cut_hit(e.m, d, 28) == 28
    assert cut_hit(e.m, f, 12) == 12  # the longest-match record serves a third prefix
    e.free("c")
    _, n = e.vllm_hit(d)
    assert n == 28  # and vLLM's own hit reaches it (c's prompt blocks are cached)


def test_admitted_request_records_nothing_already_present():
    e = Engine()
    _recorded_prompt(e)
    before = e.m.records.slots_in_use
    b = e.add(_request("b", PROMPT))
    orders = e.schedule({"b": None})
    assert orders.record_writes == [] and e.m.pending_records["b"] == []
    assert e.m.records.slots_in_use == before == 4
    # A pending record (c in flight) is not reserved twice either.
    e.finish_step()
    c = e.add(_request("c", C_TOKENS))
    e.schedule({"c": 10})
    e.finish_step()
    d = e.add(_request("d", C_TOKENS))
    orders = e.schedule({"d": None})
    assert e.m.pending_records["d"] == [] and orders.record_writes == []
    assert e.m.records.has(e.key(c, 7)) and e.m.records.ready(e.key(c, 7)) is None


def test_preempted_request_drops_its_pending_records():
    e = Engine()
    _recorded_prompt(e)  # 4 slots; c matches its first 3 blocks
    c = e.add(_request("c", C_TOKENS))
    e.schedule({"c": 14})  # writes 12 (3 blocks); 28 (7 blocks) still pending
    e.finish_step()
    assert e.m.records.ready(e.key(c, 3)) is not None
    assert e.m.records.has(e.key(c, 7)) and e.m.records.slots_in_use == 4 + 3 + 7
    blocks = e.m.pop_blocks_for_free("c")  # preemption: KVCacheManager.free
    e.pool.free_blocks(reversed(blocks))
    assert not e.m.records.has(e.key(c, 7)) and e.m.records.slots_in_use == 4 + 3
    assert "c" not in e.m.pending_records and "c" not in e.m.longest_match
    assert e.m.records.ready(e.key(c, 3)) is not None  # a written one stays


def test_resumed_request_plans_again():
    e = Engine()
    _recorded_prompt(e)
    c = e.add(_request("c", C_TOKENS))
    e.schedule({"c": 14})
    e.finish_step()
    e.pool.free_blocks(reversed(e.m.pop_blocks_for_free("c")))
    c.num_computed_tokens = 0
    # Resumed: its hit is cut to 12 (its own record), it reserves 28 again.
    blocks, n = e.vllm_hit(c)
    assert n == 12 and cut_hit(e.m, c, n) == 12
    hit = blocks[:3]
    c.num_computed_tokens = 12
    e.m.get_num_blocks_to_allocate("c", 30, hit, 12, 12, 30)
    e.m.add_local_computed_blocks("c", hit, 12, 0)
    e.m.allocate_new_blocks("c", 30, 30)
    c.num_computed_tokens = 30
    output = SimpleNamespace(num_scheduled_tokens={"c": 18}, scheduled_new_reqs=[],
                             scheduled_cached_reqs=SimpleNamespace(resumed_req_ids={"c"}))
    orders = prefix_orders(e.m, output, e.requests)
    assert [(rid, boundary) for rid, boundary, _ in orders.record_writes] == [("c", 28)]
    assert len(orders.score_inits) == 3


def test_no_hit_on_blocks_another_request_computes_in_the_same_step():
    """vLLM lets a request hit blocks cached earlier in the same schedule; H2O copies a hit
    before the step, when those blocks hold nothing yet: the hit stops before them, even with
    a record for the boundary (it outlived the blocks it was written with)."""
    e = Engine()
    prompt = list(range(300, 321))  # 21 tokens: records boundary 20 (5 blocks)
    x = _request("x", prompt)
    e.run_prompt(x)
    e.free("x")
    assert e.m.records.ready(e.key(x, 5)) is not None
    for block in e.pool.get_new_blocks(e.pool.get_num_free_blocks()):  # evicts x's blocks
        e.pool.free_blocks([block])
    a, c = e.add(_request("a", prompt)), e.add(_request("c", prompt))
    e.schedule({"a": None, "c": None})
    assert e.hits["a"] == []  # nothing cached: a recomputes
    assert e.hits["c"] == [], "c hit the blocks a computes in this very step"
    e.finish_step()


def test_recomputed_request_never_hits_past_its_first_compaction():
    """A preempted request comes back as prompt + outputs; another prompt that ran into those
    outputs may have recorded a boundary there. The hit stops before the first compaction
    point, where block counts start to assume compaction."""
    from h2o_vllm.policy import first_compaction
    e = Engine()  # block 4, budget 4 + 4, interval 4
    prompt, outputs = list(range(100, 120)), list(range(900, 912))
    a = _request("a", prompt)
    e.run_prompt(a)  # compacts at 20
    for token in outputs:
        a.append_output_token_ids(token)
        e.schedule({"a": 1})
        e.finish_step()
    b = _request("b", prompt + outputs)
    e.run_prompt(b)  # records boundary 28, past a's first compaction
    e.free("b")
    e.pool.free_blocks(reversed(e.m.pop_blocks_for_free("a")))  # a preempted
    a.num_computed_tokens = 0
    blocks, n = e.vllm_hit(a)
    assert n == 28  # vLLM would give the whole match
    cut = cut_hit(e.m, a, n, blocks)
    assert 0 < cut < first_compaction(20, 8, 4) and cut % BLOCK == 0


def test_a_waiting_request_awaits_a_record_being_written():
    """b's prefix is being recorded by a (admitted this step, its step not run yet): b is held
    back one step (awaits_record) instead of recomputing it, then hits it exactly; once
    nothing longer is pending, nothing waits."""
    from h2o_vllm.scheduler.prefix_hits import awaits_record
    e = Engine()
    shared = list(range(500, 524))           # 6 blocks
    x = _request("x", shared + [1, 2, 3])
    e.run_prompt(x)                           # records 6 blocks (its prompt's last boundary)
    a = e.add(_request("a", shared + [7, 8, 9, 10, 11]))
    orders = e.schedule({"a": None})          # a hits 6 blocks and records boundary 28 (7 blocks)
    assert e.hits["a"] and any(boundary == 28 for _, boundary, _ in orders.record_writes)
    b = e.add(_request("b", shared + [7, 8, 9, 10, 11, 12, 13]))  # matches a's 7 blocks
    blocks, n = e.vllm_hit(b)
    cut = cut_hit(e.m, b, n, blocks)
    assert cut == 24 and awaits_record([e.m], b)  # a's record of 28 is still pending
    cut_hit(e.m, b, n, blocks)                # asked again in the same state: one wait only
    assert not awaits_record([e.m], b)
    e.finish_step()                           # a's step ran: its record is ready
    blocks, n = e.vllm_hit(b)
    assert cut_hit(e.m, b, n, blocks) == 28 and not awaits_record([e.m], b)
