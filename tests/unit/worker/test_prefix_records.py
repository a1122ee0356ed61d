"""worker.prefix_records: what a step's PrefixOrders make the worker do, on CPU tensors, with both
devices' ops (CPUOps; TritonOps under TRITON_INTERPRET=1, which tests/conftest.py sets).

- phase_plans: a step's accumulation split at record boundaries ends with the scores of the
  unsplit step, and the snapshot after the phase ending at H is the scores the row's first H
  queries give alone (computed independently: the unsplit accumulation of a plan that only
  has those queries).
- init_hit_scores, relocate, compact_table, prefix_plan.

Everything runs through the production entry points: plan_batch-style StepPlans with a
PrefixPlan, ``kv_space_metadata`` (which builds the phases) and ``update_scores_and_compact``.
Block size 4 and two KV heads: the Triton interpreter costs seconds per launch.
Tolerances: rtol 1e-5, atol 1e-5 (fp32; the kernels sum in another order than the torch ops).
"""
from one_layer import CPUCache  # isort: skip  (sets TRITON_INTERPRET before kernel imports)

import dataclasses  # noqa: E402
import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.config import Budget  # noqa: E402
from h2o_vllm.prefix_orders import PrefixOrders  # noqa: E402
from h2o_vllm.worker import prefix_records as wp  # noqa: E402
from h2o_vllm.worker import step as worker_step  # noqa: E402
from h2o_vllm.worker.cpu.ops import CPUOps  # noqa: E402
from h2o_vllm.worker.cuda.ops import TritonCacheViews, TritonOps  # noqa: E402
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan  # noqa: E402
from h2o_vllm.score_modes import Decay, ObsWindow

if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no GPU", allow_module_level=True)

BLOCK, HKV, GROUP, HEAD = 4, 2, 2, 8
SCALE = HEAD ** -0.5
NUM_BLOCKS = 40
NUM_SLOTS = 16   # record-pool slots
TOL = dict(rtol=1e-5, atol=1e-5)

t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


class State:
    """One layer's K, V and scores (and score records) in one device's layout."""

    def __init__(self, kind, keys, values, scores, records):
        self.kind = kind
        if kind == "cpu":
            self.ops = CPUOps()
            self.views = CPUCache(keys, values).views
        else:
            self.ops = TritonOps(HEAD)
            self.views = TritonCacheViews(keys.clone(), values.clone())
        self.scores, self.records = scores.clone(), records.clone()

    def write(self, slots, new_k, new_v):
        self.views.keys[slots // BLOCK, slots % BLOCK] = new_k
        self.views.values[slots // BLOCK, slots % BLOCK] = new_v

    def run(self, plan, table, query):
        """The per-step sequence: kv_space_metadata (phases built there when plan.prefix has
        record cuts), then update_scores_and_compact."""
        _, step = worker_step.kv_space_metadata(_cm(plan, table), plan, BLOCK, self.ops)
        worker_step.update_scores_and_compact(step, self.ops, query, self.views, self.scores,
                                              SCALE, self.records)
        return step


def _cm(plan, table):
    from vllm.v1.attention.backend import CommonAttentionMetadata
    q = plan.query_lens
    qsl = torch.cat([t([0]), torch.cumsum(q, 0)]).to(torch.int32)
    num_tokens = int(q.sum())
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=(plan.kv_lens_before + q).to(torch.int32),
        num_reqs=q.shape[0], num_actual_tokens=num_tokens, max_query_len=int(q.max()),
        max_seq_len=int((plan.kv_lens_before + q).max()), block_table_tensor=table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64))


def _table(num_rows, per_row, seed=0):
    perm = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    return perm[:num_rows * per_row].view(num_rows, per_row).to(torch.int32)


def _random_layer(seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(NUM_BLOCKS, BLOCK, HKV, HEAD, generator=g)
    values = torch.randn(NUM_BLOCKS, BLOCK, HKV, HEAD, generator=g)
    scores = torch.rand(NUM_BLOCKS, HKV, BLOCK, generator=g)
    records = torch.rand(NUM_SLOTS, HKV, BLOCK, generator=g) + 5.0  # unlike any score
    return keys, values, scores, records


def _live(scores, table, row, kv_len):
    pos = torch.arange(kv_len)
    return scores[table[row].long()[pos // BLOCK], :, pos % BLOCK]  # [kv_len, Hkv]


def _with_cuts(plan, cuts, fresh=None, inits=None):
    return dataclasses.replace(plan, prefix=wp.PrefixPlan(score_inits=inits, cuts=cuts, fresh=fresh or {}))


# Five rows: a prompt from 0 (13 tokens), a decode row, a prompt chunk from KV position 5
# (7 tokens, to 12), a short prompt, another decode row. Budgets large: nothing is due, so the
# final scores are the accumulation's alone.
COMPUTED, QUERY, PROMPT = [0, 9, 5, 0, 14], [13, 1, 7, 3, 1], [13, 9, 12, 3, 10]
WIDE = dict(heavy=32, recent=32, interval=4)
BUDGETS = {
    "paper": [Budget(**WIDE)] * 5,
    # Recording rows 0 and 2 decay (records are per decay); a paper row and a windowed,
    # decayed short prompt beside them keep their own weights.
    "decay": [Budget(**WIDE, scoring=(Decay(0.9),)), Budget(**WIDE, scoring=(Decay(0.7),)), Budget(**WIDE, scoring=(Decay(0.8),)),
              Budget(**WIDE, scoring=(Decay(0.6), ObsWindow(2))), Budget(**WIDE)],
}
# row -> [(boundary, record slots)]: one boundary per row, or two in row 0 and in row 2
# (row 2's second one at the end of its chunk).
CUTS = {
    "one": {0: [(8, [3, 7])], 2: [(8, [0, 9])]},
    "two": {0: [(4, [5]), (12, [1, 2, 4])], 2: [(8, [6, 8]), (12, [10, 11, 12])]},
}


@pytest.mark.parametrize("kind", ["cpu", "triton"])
@pytest.mark.parametrize("cuts", list(CUTS))
@pytest.mark.parametrize("mode", list(BUDGETS))
def test_split_accumulation_equals_unsplit_and_snapshots_are_prefix_scores(mode, cuts, kind):
    budgets, row_cuts = BUDGETS[mode], CUTS[cuts]
    plan = make_step_plan(t(COMPUTED), t(QUERY), t(PROMPT), budgets)
    assert plan.weighted == (mode == "decay") and not plan.due.any()
    table = _table(5, 5, seed=1)
    keys, values, scores, records = _random_layer(seed=2)
    g = torch.Generator().manual_seed(3)
    num_tokens = int(plan.query_lens.sum())
    query = torch.randn(num_tokens, HKV * GROUP, HEAD, generator=g)
    new_k = torch.randn(num_tokens, HKV, HEAD, generator=g)
    new_v = torch.randn(num_tokens, HKV, HEAD, generator=g)
    slots = kv_slot_mapping(plan, table, num_tokens, BLOCK)

    split_plan = _with_cuts(plan, row_cuts)
    phases = wp.phase_plans(split_plan)
    assert len(phases) == 1 + max(len(c) for c in row_cuts.values())
    # Every query of a recording row runs exactly once over the phases, no other row's.
    assert sum(p.query_lens for p, _ in phases).tolist() == [q if r in row_cuts else 0
                                                              for r, q in enumerate(QUERY)]
    # The step's own pass leaves the recording rows out: their queries weigh 0 there.
    masked = wp.masked_plan(split_plan)
    for row in range(5):
        start, n = int(plan.query_starts[row]), QUERY[row]
        weights = masked.query_weights[start:start + n]
        assert bool((weights == 0).all()) == (row in row_cuts)
        assert (float(masked.score_scale[row]) == 1.0) or row not in row_cuts

    whole, split = (State(kind, keys, values, scores, records) for _ in range(2))
    for state in (whole, split):
        state.write(slots, new_k, new_v)
    whole.run(plan, table, query)
    step = split.run(split_plan, table, query)
    assert len(step.prefix.phases) == len(phases)
    for row in range(5):
        kv_len = int(plan.kv_lens_after[row])
        torch.testing.assert_close(_live(split.scores, table, row, kv_len),
                                   _live(whole.scores, table, row, kv_len), **TOL)
    assert torch.equal(whole.records, records)  # no prefix orders: records untouched

    # Each snapshot: the scores of the row's queries before the boundary alone, from the
    # step's initial scores (a plan with only those queries, run unsplit).
    written = set()
    for row, cuts_of_row in row_cuts.items():
        for boundary, record_slots in cuts_of_row:
            alone = State(kind, keys, values, scores, records)
            alone.write(slots, new_k, new_v)  # K/V past the boundary: never attended
            start = COMPUTED[row]
            first = make_step_plan(t([start]), t([boundary - start]), t([PROMPT[row]]), [budgets[row]])
            q0 = int(plan.query_starts[row])
            alone.run(first, table[row:row + 1], query[q0:q0 + boundary - start])
            expected = _live(alone.scores, table[row:row + 1], 0, boundary)      # [H, Hkv]
            got = split.records[record_slots].transpose(1, 2).reshape(boundary, HKV)
            torch.testing.assert_close(got, expected, **TOL)
            written |= set(record_slots)
    untouched = [s for s in range(NUM_SLOTS) if s not in written]
    assert torch.equal(split.records[untouched], records[untouched])


def test_phase_plans_segments():
    """The segments themselves: each recording row's queries split at its boundaries, other
    rows in no phase; weights of a segment are its own decay powers."""
    plan = make_step_plan(t(COMPUTED), t(QUERY), t(PROMPT), BUDGETS["decay"])
    assert wp.phase_plans(plan) == [] and wp.phase_plans(_with_cuts(plan, {})) == []
    phases = wp.phase_plans(_with_cuts(plan, CUTS["two"]))
    lens = [p.query_lens.tolist() for p, _ in phases]
    before = [p.kv_lens_before.tolist() for p, _ in phases]
    assert lens == [[4, 0, 3, 0, 0], [8, 0, 4, 0, 0], [1, 0, 0, 0, 0]]
    assert [b[0] for b in before] == [0, 4, 12] and [b[2] for b in before] == [5, 8, 12]
    assert [[(r, h) for r, h, _ in snaps] for _, snaps in phases] == [[(0, 4), (2, 8)], [(0, 12), (2, 12)], []]
    p1 = phases[1][0]
    start = int(p1.query_starts[0])
    assert start == 4 and not p1.due.any()
    expected = 0.9 ** torch.arange(7, -1, -1, dtype=torch.float64)
    torch.testing.assert_close(p1.query_weights[start:start + 8], expected.float())
    assert float(p1.score_scale[0]) == pytest.approx(0.9 ** 8)


@pytest.mark.parametrize("kind", ["cpu", "triton"])
def test_hit_scores_start_from_the_record_or_zeros(kind):
    """A request resuming from an 8-token hit copied into its first two blocks: one block's
    scores from record slot 3, the other zeros (slot -1); its 5 new queries then add to them
    exactly as they add to scores set so by hand."""
    plan = make_step_plan(t([8]), t([5]), t([13]), [Budget(**WIDE)])
    table = _table(1, 4, seed=5)
    b0, b1 = int(table[0, 0]), int(table[0, 1])
    orders = PrefixOrders(score_inits=[(b0, 3), (b1, -1)])
    prefix = wp.prefix_plan(orders, ["r"])
    assert prefix.score_inits.tolist() == [[b0, 3], [b1, -1]] and prefix.cuts == {} and prefix.fresh == {}
    keys, values, scores, records = _random_layer(seed=6)
    g = torch.Generator().manual_seed(7)
    query = torch.randn(5, HKV * GROUP, HEAD, generator=g)
    new_k, new_v = torch.randn(5, HKV, HEAD, generator=g), torch.randn(5, HKV, HEAD, generator=g)
    slots = kv_slot_mapping(plan, table, 5, BLOCK)
    hit = State(kind, keys, values, scores, records)
    hand = State(kind, keys, values, scores, records)
    for state in (hit, hand):
        state.write(slots, new_k, new_v)
    step = hit.run(dataclasses.replace(plan, prefix=prefix), table, query)
    assert step.prefix.phases == () and step.prefix.init_slots.tolist() == [3, -1]
    hand.scores[b0], hand.scores[b1] = records[3], 0.0
    hand.run(plan, table, query)
    torch.testing.assert_close(_live(hit.scores, table, 0, 13), _live(hand.scores, table, 0, 13), **TOL)
    # Blocks no init names keep their scores.
    others = [b for b in range(NUM_BLOCKS) if b not in table[0].tolist()]
    assert torch.equal(hit.scores[others], scores[others])
    assert torch.equal(hit.records, records)


def test_init_hit_scores_direct():
    scores = torch.rand(6, HKV, BLOCK)
    records = torch.rand(4, HKV, BLOCK) + 2
    before = scores.clone()
    prefix = wp.PrefixStep(init_blocks=t([4, 1, 2]), init_slots=t([2, -1, 0]), masked=None, phases=(),
                           snapshots=(), fresh_src=None, fresh_dst=None)
    wp.init_hit_scores(prefix, scores, records)
    assert torch.equal(scores[4], records[2]) and torch.equal(scores[2], records[0])
    assert not scores[1].any()
    assert torch.equal(scores[[0, 3, 5]], before[[0, 3, 5]])
    none = dataclasses.replace(prefix, init_blocks=None, init_slots=None)
    wp.init_hit_scores(none, scores, records * 0)  # nothing to do
    assert torch.equal(scores[4], records[2])


def test_relocate_copies_k_v_scores_block_for_block():
    keys, values, scores, _ = _random_layer(seed=8)
    views = TritonCacheViews(keys.clone(), values.clone())
    s = scores.clone()
    prefix = wp.PrefixStep(init_blocks=None, init_slots=None, masked=None, phases=(), snapshots=(),
                           fresh_src=t([3, 9, 4]), fresh_dst=t([20, 21, 30]))
    wp.relocate(prefix, views, s)
    for src, dst in ((3, 20), (9, 21), (4, 30)):
        assert torch.equal(views.keys[dst], keys[src]) and torch.equal(views.values[dst], values[src])
        assert torch.equal(s[dst], scores[src])
    rest = [b for b in range(NUM_BLOCKS) if b not in (20, 21, 30)]
    assert torch.equal(views.keys[rest], keys[rest]) and torch.equal(s[rest], scores[rest])
    # The CPU layout (K stored transposed): the same, block for block.
    cpu = CPUCache(keys, values).views
    wp.relocate(prefix, cpu, scores.clone())
    assert torch.equal(cpu.keys[20], keys[3]) and torch.equal(cpu.values[30], values[4])


def test_compact_table_substitutes_fresh_blocks():
    table = _table(3, 4, seed=9)
    plan = make_step_plan(t([0, 0, 0]), t([1, 1, 1]), t([1, 1, 1]), [Budget(1, 1, 1)] * 3)
    assert wp.compact_table(plan, table) is table  # no prefix orders
    fresh = {1: [35, 36], 2: [37]}
    out = wp.compact_table(_with_cuts(plan, {}, fresh=fresh), table)
    assert out.dtype == table.dtype and out is not table
    assert out[0].tolist() == table[0].tolist()
    assert out[1].tolist() == [35, 36] + table[1, 2:].tolist()
    assert out[2].tolist() == [37] + table[2, 1:].tolist()
    assert table[1, 0] not in (35, 36)  # the vLLM table is not written through


@pytest.mark.parametrize("kind", ["cpu", "triton"])
def test_first_compaction_into_fresh_blocks_leaves_the_old_blocks_alone(kind):
    """A prompt of 13 compacted at its end (budget 2 + 2 + sink 1 -> 5 tokens, 2 blocks): with
    fresh blocks the result lands in them and equals the in-place compaction's, and the
    row's own blocks (what the prefix cache indexes) keep their K/V."""
    budget = Budget(2, 2, 4, sink_tokens=1)
    plan = make_step_plan(t([8, 0]), t([5, 6]), t([13, 6]), [budget, Budget(**WIDE)])
    assert plan.due.tolist() == [True, False] and int(plan.kv_lens_after[0]) == 5
    table = _table(2, 4, seed=10)
    fresh = [38, 39]
    assert not set(fresh) & set(table.flatten().tolist())
    keys, values, scores, records = _random_layer(seed=11)
    g = torch.Generator().manual_seed(12)
    query = torch.randn(11, HKV * GROUP, HEAD, generator=g)
    new_k, new_v = torch.randn(11, HKV, HEAD, generator=g), torch.randn(11, HKV, HEAD, generator=g)
    slots = kv_slot_mapping(plan, table, 11, BLOCK)
    moved, in_place = (State(kind, keys, values, scores, records) for _ in range(2))
    for state in (moved, in_place):
        state.write(slots, new_k, new_v)
    written_k = moved.views.keys.clone()
    written_v = moved.views.values.clone()
    orders = PrefixOrders(fresh_blocks={"r": fresh})
    step = moved.run(dataclasses.replace(plan, prefix=wp.prefix_plan(orders, ["r", "o"])), table, query)
    assert step.prefix.fresh_src.tolist() == table[0, :2].tolist()
    assert step.compact_table[0, :2].tolist() == fresh
    in_place.run(plan, table, query)
    fresh_table = step.compact_table
    kv = int(plan.kv_lens_after[0])
    blk_f, off = t(fresh)[torch.arange(kv) // BLOCK], torch.arange(kv) % BLOCK
    blk_i = table[0].long()[torch.arange(kv) // BLOCK]
    assert torch.equal(moved.views.keys[blk_f, off], in_place.views.keys[blk_i, off])
    assert torch.equal(moved.views.values[blk_f, off], in_place.views.values[blk_i, off])
    torch.testing.assert_close(moved.scores[blk_f, :, off], in_place.scores[blk_i, :, off], **TOL)
    # The row's old blocks: K/V as written before the step's compaction, all four of them.
    old = table[0].long()
    assert torch.equal(moved.views.keys[old], written_k[old])
    assert torch.equal(moved.views.values[old], written_v[old])
    # The other row is untouched by the move and equal in both runs.
    torch.testing.assert_close(_live(moved.scores, table, 1, 6), _live(in_place.scores, table, 1, 6), **TOL)
    assert fresh_table[1].tolist() == table[1].tolist()


def test_prefix_plan_maps_orders_to_rows():
    orders = PrefixOrders(score_inits=[(4, 1)],
                          record_writes=[("b", 12, [1, 2, 3]), ("b", 4, [0]), ("gone", 8, [5, 6]),
                                         ("a", 8, [7, 8])],
                          fresh_blocks={"a": [9], "gone": [10]})
    plan = wp.prefix_plan(orders, ["a", "b"])
    assert plan.cuts == {1: [(4, [0]), (12, [1, 2, 3])], 0: [(8, [7, 8])]}
    assert plan.fresh == {0: [9]}
    assert plan.score_inits.tolist() == [[4, 1]]
    assert wp.prefix_plan(PrefixOrders(), ["a"]) is None and wp.prefix_plan(None, ["a"]) is None
