"""H2O with vLLM's prefix cache, worker side: what the scheduler's ``PrefixOrders`` make a step do.

Runs in the worker process; imports no vLLM. Per step (``prefix_plan``, then ``phase_plans``
and ``make_prefix_step`` in the metadata builder) and per attention layer (the functions at the
bottom, called by ``worker.step.update_scores_and_compact``):

1. Hit copies (vLLM copied their K/V before the step) get their scores from the hit's record,
   or zeros.
2. A row that passes a record boundary ``H`` in this step is left out of the step's own
   score pass (its queries weigh 0 there: ``masked_plan``) and scored in phases split at ``H``
   (``phase_plans``); after the phase that ends at ``H`` its scores of KV positions ``[0, H)``
   are exactly ``s_H`` (the queries before ``H`` only) and are copied to the record.
   Splitting changes nothing else: a causal query's probabilities do not depend on where the
   step ends, and a segment's score scale is its own (docs/score-modes.md, "Definitions"). The
   step's pass stays whole, so the CUDA path's fused attention serves every step.
3. A row whose first compaction comes with fresh blocks copies its first KV blocks into them
   and compacts there, so the blocks the prefix cache indexes keep their contents.

Records: ``[num_blocks, num_kv_heads, block_size]`` fp32 per layer, like the scores; slot
``j`` of a record is the record pool's block ``j`` (``scheduler/records.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PrefixPlan:
    """A step's orders, by batch row (CPU)."""
    score_inits: torch.Tensor | None                # [n, 2] int64: (block, record slot or -1)
    cuts: Mapping[int, Sequence[tuple[int, Sequence[int]]]]  # row -> [(boundary, slots)], ascending
    fresh: Mapping[int, Sequence[int]]              # row -> blocks its first compaction writes into


def prefix_plan(orders: Any, req_ids: Sequence[str]) -> PrefixPlan | None:
    """The ``PrefixOrders`` of a step by row of the batch whose row i is ``req_ids[i]``."""
    if not orders:
        return None
    row_of = {rid: i for i, rid in enumerate(req_ids)}
    cuts: dict[int, list[tuple[int, Sequence[int]]]] = {}
    for rid, boundary, slots in orders.record_writes:
        if rid in row_of:
            cuts.setdefault(row_of[rid], []).append((boundary, slots))
    for row_cuts in cuts.values():
        row_cuts.sort(key=lambda cut: cut[0])
    inits = torch.tensor(orders.score_inits, dtype=torch.int64).view(-1, 2) if orders.score_inits else None
    fresh = {row_of[rid]: blocks for rid, blocks in orders.fresh_blocks.items() if rid in row_of}
    return PrefixPlan(score_inits=inits, cuts=cuts, fresh=fresh)


def phase_plans(plan) -> list[tuple[Any, list[tuple[int, int, Sequence[int]]]]]:
    """The score accumulation of the rows that record in this step, split at their record
    boundaries: [(sub-plan, snapshots after it: (row, boundary, record slots))], or [] when
    no row records. Each recording row runs its segments in order, one per phase; the other
    rows are in none (``masked_plan`` scores them, in one pass with the step's attention).

    A recording row's queries all weigh 1 and scale the scores alike (a score mode that weighs
    queries apart turns records off: ``ScoreMode.unrecorded_hit``), so a segment's weights are
    the powers of its row's ``query_scale`` alone.
    """
    cuts = plan.prefix.cuts if plan.prefix is not None else {}
    if not cuts:
        return []
    before, q_lens = plan.kv_lens_before, plan.query_lens
    num_phases = 1 + max(len(c) for c in cuts.values())
    phases = []
    for p in range(num_phases):
        offsets, lens = torch.zeros_like(q_lens), torch.zeros_like(q_lens)
        snapshots = []
        for row, row_cuts in cuts.items():
            a = int(before[row])
            edges = [a] + [boundary for boundary, _ in row_cuts] + [a + int(q_lens[row])]
            if p < len(edges) - 1:
                offsets[row], lens[row] = edges[p] - a, edges[p + 1] - edges[p]
            if p < len(row_cuts):
                snapshots.append((row, *row_cuts[p]))
        phases.append((_segment(plan, offsets, lens, cut_rows=list(cuts)), snapshots))
    return phases


def masked_plan(plan):
    """``plan`` with the recording rows' queries weighing 0 and their scores not scaled: a
    pass over it (the fused attention, or the unfused accumulate) scores every other row and
    leaves the recording rows' scores as they were, new slots zeroed; ``phase_plans`` then
    scores them. None when no row records."""
    cuts = plan.prefix.cuts if plan.prefix is not None else {}
    if not cuts:
        return None
    num_tokens, num_rows = int(plan.query_lens.sum()), plan.query_lens.shape[0]
    weights = (plan.query_weights.clone() if plan.query_weights is not None
               else torch.ones(num_tokens, dtype=torch.float32))
    scale = (plan.score_scale.clone() if plan.score_scale is not None
             else torch.ones(num_rows, dtype=torch.float32))
    for row in cuts:
        start = int(plan.query_starts[row])
        weights[start:start + int(plan.query_lens[row])] = 0.0
        scale[row] = 1.0
    # Scores only: the step itself selects and compacts.
    return dataclasses.replace(plan, query_weights=weights, score_scale=scale,
                               due=torch.zeros_like(plan.due), prefix=None)


def _segment(plan, offsets: torch.Tensor, lens: torch.Tensor, cut_rows: list[int]):
    """``plan`` restricted to each row's queries ``[offset, offset + len)``; scores only."""
    starts = plan.query_starts + offsets
    weights = scale = None
    if plan.query_weights is not None:
        weights, scale = plan.query_weights.clone(), plan.score_scale.clone()
        for row in cut_rows:
            n = int(lens[row])
            factor = torch.tensor(float(plan.query_scale[row]), dtype=torch.float64)
            weights[int(starts[row]):int(starts[row]) + n] = (factor ** torch.arange(n - 1, -1, -1)).to(torch.float32)
            scale[row] = float(factor ** n)
    kv_before = plan.kv_lens_before + offsets
    return dataclasses.replace(
        plan, query_lens=lens, kv_lens_before=kv_before, kv_seq_lens=kv_before + lens,
        kv_lens_after=kv_before + lens, due=torch.zeros_like(plan.due), query_starts=starts,
        query_weights=weights, score_scale=scale, prefix=None)


@dataclass(frozen=True)
class PrefixStep:
    """A step's prefix-cache work on the device, built once in the metadata builder."""
    init_blocks: torch.Tensor | None     # [n] int64: hit copies whose scores start from a record
    init_slots: torch.Tensor | None      # [n] int64: their record slots (-1: zeros)
    masked: Any                          # H2OStep of masked_plan (None: no row records)
    phases: tuple[Any, ...]              # H2OSteps of the recording rows, accumulated in order
    snapshots: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]  # after each: (blocks, slots)
    fresh_src: torch.Tensor | None       # [m] int64: first KV blocks of rows compacting into
    fresh_dst: torch.Tensor | None       # [m] int64: their fresh blocks


def make_prefix_step(plan, block_table: torch.Tensor, masked: Any, phases: Sequence[Any],
                     snapshots: Sequence[list[tuple[int, int, Sequence[int]]]],
                     block_size: int) -> PrefixStep:
    device = block_table.device
    inits = plan.prefix.score_inits
    init_blocks = init_slots = None
    if inits is not None:
        init_blocks, init_slots = (t.to(device, non_blocking=True) for t in inits.unbind(1))
    snaps = []
    for rows in snapshots:
        if not rows:
            snaps.append(None)
            continue
        blocks = torch.cat([block_table[row, :boundary // block_size].to(torch.int64)
                            for row, boundary, _ in rows])
        slots = torch.tensor([s for _, _, row_slots in rows for s in row_slots], dtype=torch.int64)
        snaps.append((blocks, slots.to(device, non_blocking=True)))
    src = dst = None
    if plan.prefix.fresh:
        src = torch.cat([block_table[row, :len(fresh)].to(torch.int64)
                         for row, fresh in plan.prefix.fresh.items()])
        dst = torch.tensor([b for fresh in plan.prefix.fresh.values() for b in fresh],
                           dtype=torch.int64).to(device, non_blocking=True)
    return PrefixStep(init_blocks=init_blocks, init_slots=init_slots, masked=masked, phases=tuple(phases),
                      snapshots=tuple(snaps), fresh_src=src, fresh_dst=dst)


def compact_table(plan, block_table: torch.Tensor) -> torch.Tensor:
    """The block table due rows are selected and compacted through: a row with fresh blocks
    has them in place of its first ones (``relocate`` has copied those there)."""
    if plan.prefix is None or not plan.prefix.fresh:
        return block_table
    table = block_table.clone()
    for row, fresh in plan.prefix.fresh.items():
        table[row, :len(fresh)] = torch.tensor(fresh, dtype=table.dtype).to(table.device)
    return table


def init_hit_scores(prefix: PrefixStep, scores: torch.Tensor, records: torch.Tensor) -> None:
    """Scores of the hit copies: their record's, or zeros."""
    if prefix.init_blocks is None:
        return
    slots = prefix.init_slots
    values = records[slots.clamp(min=0)]
    scores[prefix.init_blocks] = torch.where((slots >= 0)[:, None, None], values, 0.0)


def snapshot(snap: tuple[torch.Tensor, torch.Tensor] | None, scores: torch.Tensor,
             records: torch.Tensor) -> None:
    if snap is not None:
        blocks, slots = snap
        records[slots] = scores[blocks]


def relocate(prefix: PrefixStep, views: Any, scores: torch.Tensor) -> None:
    """Copy the first KV blocks of rows compacting into fresh blocks there (K, V, scores)."""
    if prefix.fresh_src is None:
        return
    src, dst = prefix.fresh_src, prefix.fresh_dst
    views.keys[dst] = views.keys[src]
    views.values[dst] = views.values[src]
    scores[dst] = scores[src]
