"""worker.due_pass: every due row's keep-set in one padded pass, equal to ``policy.select_keep``
token for token, and launching the same ops over the same shapes at every step of a fixed batch
(what a CUDA graph replays; docs/cuda.md, "What full CUDA graphs would need").
"""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from h2o_vllm.config import Budget
from h2o_vllm.policy import select_keep
from h2o_vllm.score_modes import Pooling
from h2o_vllm.worker import due_pass
from h2o_vllm.worker import step as worker_step
from h2o_vllm.worker.cpu.layout import CacheViews
from h2o_vllm.worker.cpu.ops import CPUOps
from h2o_vllm.worker.plan import StepPlan, kv_slot_mapping, make_step_plan

BLOCK, HEADS, HEAD = 16, 2, 8


def _plan(kv_lens, after, heavy, sinks, rank, ranking):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    kv_lens, after = t(kv_lens), t(after)
    return StepPlan(query_lens=torch.ones_like(kv_lens), kv_lens_before=kv_lens - 1, kv_seq_lens=kv_lens,
                    kv_lens_after=after, heavy=t(heavy), sink_tokens=t(sinks), rank=rank,
                    due=after < kv_lens, query_starts=torch.arange(len(kv_lens)), ranking=ranking)


@pytest.mark.parametrize("seed", range(3))
def test_padded_keep_sets_are_select_keeps(seed):
    """Rows of every length in one pass, scores full of ties (small integers), sinks, pooling at
    some rows' first compaction, a row not due, a row keeping its whole live length: each due
    row keeps exactly ``select_keep``'s tokens, in order; a row not due keeps none."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [1, 5, 17, 33, 40, 64, 29, 12]
    heavy = [0, 2, 4, 8, 3, 20, 6, 0]
    sinks = [0, 1, 2, 0, 4, 3, 0, 2]
    recent = [1, 1, 5, 8, 0, 10, 4, 12]
    after = [min(n, s + h + r) for n, s, h, r in zip(kv_lens, sinks, heavy, recent)]
    after[6] = kv_lens[6]  # not due
    pools = (Pooling(3),), (Pooling(5),)
    ranking = tuple(pools[i % 2] if i % 3 else () for i in range(len(kv_lens)))
    rank = tuple(r if i in (1, 3, 5) else () for i, r in enumerate(ranking))  # some first compactions
    plan = _plan(kv_lens, after, heavy, sinks, rank, ranking)
    table = torch.arange(1, 1 + 4 * len(kv_lens), dtype=torch.int32).view(len(kv_lens), 4)
    (due,) = due_pass.due_passes(plan, table, BLOCK, every_row=True)
    assert due.blocks.shape == (len(kv_lens), 64)
    ranked = torch.randint(0, 4, (len(kv_lens), HEADS, 64), generator=gen).float()
    keep, keep_idx = due_pass.keep_sets(due, ranked)
    for row, n in enumerate(kv_lens):
        target = int(due.targets[row])
        assert int(keep[row].sum(-1).max()) == int(keep[row].sum(-1).min())  # one count per head
        if not plan.due[row]:
            assert target == 0
            continue
        want = select_keep(ranked[row, :, :n], heavy[row], after[row] - sinks[row] - heavy[row],
                           sinks[row], rank[row])
        assert target == want.shape[-1] == int(keep[row, 0].sum())
        assert torch.equal(keep_idx[row, :, :target], want), row


class _Recorder(TorchDispatchMode):
    """Each torch op the pass runs: its name and its tensors' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.launches, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.launches.append((str(func), _shapes((args, kwargs))))
        return func(*args, **(kwargs or {}))


def _shapes(tree):
    return tuple((tuple(x.shape), x.dtype) for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor))


class _RecordingOps(CPUOps):
    """The CPU's ops; the compaction is one device launch, recorded by its arguments' shapes
    (the CUDA path's ``compact_rows`` grid follows from them), not by the twin's own ops."""
    recorder: _Recorder | None = None

    def compact(self, views, scores, block_table, rows, keep, targets):
        if self.recorder is None:
            return super().compact(views, scores, block_table, rows, keep, targets)
        self.recorder.launches.append(("compact_rows", _shapes((scores, block_table, rows, keep, targets))))
        self.recorder.paused = True
        super().compact(views, scores, block_table, rows, keep, targets)
        self.recorder.paused = False


def test_a_fixed_decode_batch_launches_the_same_pass_every_step():
    """Four rows decode 120 steps (sinks; pooling at a first compaction that falls in decode;
    rows due at different steps, several at once, or none): passed every row (``every_row``),
    each step launches the same ops over the same shapes, and the cache ends as the eager pass
    over the due rows alone leaves it, token for token."""
    budgets = [Budget(6, 6, 4), Budget(5, 6, 3, sink_tokens=2), Budget(4, 8, 5, scoring=(Pooling(3),)),
               Budget(6, 6, 2, sink_tokens=1)]
    prompts = torch.tensor([20, 17, 9, 25])  # row 2 first compacts in decode, pooled
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(4 * 2 + 1, generator=gen)
    table = table[table != 0][:8].view(4, 2).to(torch.int32)
    keys = torch.randn(9, BLOCK, HEADS, HEAD, generator=gen)
    values = torch.randn(9, BLOCK, HEADS, HEAD, generator=gen)
    caches = {mode: CacheViews(None, None, k.permute(0, 2, 3, 1), k, v)
              for mode, k, v in (("graph", keys, values), ("eager", keys.clone(), values.clone()))}
    scores = {mode: torch.zeros(9, HEADS, BLOCK) for mode in caches}
    ops, recorder, steps, due_rows = _RecordingOps(), _Recorder(), [], set()
    for i in range(120):
        plan = make_step_plan(prompts + i, torch.ones(4, dtype=torch.int64), prompts, budgets)
        due_rows.add(tuple(plan.due.tolist()))
        slots = kv_slot_mapping(plan, table, 4, BLOCK)
        new = torch.rand(4, HEADS, generator=gen) + torch.randint(0, 3, (4, 1), generator=gen)  # ties
        for mode, views in caches.items():  # the step's scores, as attention would add them
            scores[mode][slots // BLOCK, :, slots % BLOCK] = new
            scores[mode] *= 0.9
        eager = worker_step.make_step(plan, table, slots, BLOCK)
        graph = dataclasses.replace(eager, due=due_pass.due_passes(plan, table, BLOCK, every_row=True),
                                    mass=torch.zeros(2))
        ops.recorder = recorder = _Recorder()
        with recorder:
            worker_step.update_scores_and_compact(graph, ops, None, caches["graph"], scores["graph"], 1.0,
                                                  accumulated=True)
        ops.recorder = None
        worker_step.update_scores_and_compact(eager, ops, None, caches["eager"], scores["eager"], 1.0,
                                              accumulated=True)
        steps.append(recorder.launches)
        if eager.mass is not None:
            torch.testing.assert_close(graph.mass, eager.mass)
    assert len(due_rows) >= 6 and (False,) * 4 in due_rows and any(sum(d) > 1 for d in due_rows)
    assert any(op == "compact_rows" for op, _ in steps[0])
    assert all(s == steps[0] for s in steps[1:])
    for graph_t, eager_t in zip((keys, values, scores["graph"]), (*caches["eager"][3:], scores["eager"])):
        assert torch.equal(graph_t, eager_t)


def test_the_engine_width_bounds_every_prompts_decode_peak():
    """``decode_graph.engine_width``: a power of two of blocks at least budget + interval for
    every prompt length (ratios grow with the prompt, so the longest bounds them)."""
    from h2o_vllm.config import H2OConfig
    from h2o_vllm.worker.decode_graph import engine_width
    for data in ({"heavy_tokens": 8, "recent_tokens": 8, "interval": 4, "sink_tokens": 2},
                 {"heavy_ratio": 0.1, "recent_ratio": 0.1, "min_tokens": 0},
                 {"heavy_ratio": 0.2, "recent_ratio": 0.1, "min_tokens": 24, "interval": 1}):
        config = H2OConfig.from_dict(data)
        width = engine_width(config, 1000, BLOCK)
        assert width % BLOCK == 0 and (width // BLOCK) & (width // BLOCK - 1) == 0
        peaks = [b.tokens + b.interval for b in (config.budget(p, BLOCK) for p in range(1, 1001))]
        assert max(peaks) <= width < 2 * max(peaks) + BLOCK, data


def test_a_row_peaking_past_the_engine_width_widens_the_pass_and_keeps_select_keeps():
    """Graph-shaped decode with a request whose own budget peaks past the engine's width (a
    per-request override): its steps' pass widens to cover it (a graph captured at the engine
    width would not hold them) and each due row still keeps ``select_keep``'s tokens."""
    kv_lens, heavy, recent = [20, 50], [4, 20], [4, 20]
    after = [min(n, h + r) for n, h, r in zip(kv_lens, heavy, recent)]
    plan = dataclasses.replace(_plan(kv_lens, after, heavy, [0, 0], ((), ()), ()),
                               kv_peak_lens=torch.tensor([9, 41]))
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)
    fits = dataclasses.replace(_plan([9, 12], [8, 12], [4, 0], [0, 0], ((), ()), ()),
                               kv_peak_lens=torch.tensor([9, 13]))
    (narrow,) = due_pass.due_passes(fits, table, BLOCK, every_row=True, min_width=32)
    assert narrow.positions.shape == (32,)  # the engine's width, wider than these rows need
    (due,) = due_pass.due_passes(plan, table, BLOCK, every_row=True, min_width=32)
    assert due.positions.shape == (64,)
    ranked = torch.randint(0, 4, (2, HEADS, 64), generator=torch.Generator().manual_seed(1)).float()
    _, keep_idx = due_pass.keep_sets(due, ranked)
    for row, n in enumerate(kv_lens):
        want = select_keep(ranked[row, :, :n], heavy[row], recent[row])
        assert torch.equal(keep_idx[row, :, :int(due.targets[row])], want), row
