"""A step's compactions as one pass of fixed padded width: the rows' live scores gathered into
[R, num_kv_heads, width], each row's keep-set chosen by one masked ranking, one compaction launch.

Runs in the worker process, for both devices (``worker.step`` calls it; a device supplies only
``DeviceOps.compact``). What the plan decides on the host (which rows are due, their lengths,
budgets and ranking modes) arrives as per-row tensors, so the ops the pass launches and their
shapes depend on (R, width) alone, never on which rows compact or how long each is: what a CUDA
graph replays (docs/cuda.md, "What full CUDA graphs would need"). The keep-sets are
``policy.select_keep``'s token for token: the same stable sort over the same candidates, the
padding and the tokens that are not candidates ranked last at -inf.

Rows are split into passes only by what ranks them from their keys (``StepPlan.key_scorers``:
reading every row's keys for a few KeyDiff rows would cost more than a second pass); ranking
modes (pooling) run over every row of a pass and count where the row ranks with them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_vllm.score_modes import ScoreMode, Scorer
from h2o_vllm.worker.plan import StepPlan
from h2o_vllm.worker.step_buffers import FreshTensors, StepBuffers


@dataclass(frozen=True)
class DuePass:
    """One pass's rows and their keep-set bounds, on the device. R rows, ``width`` KV positions
    (a power of two of blocks); positions past a row's live length are padding."""
    rows: torch.Tensor        # [R] int64: batch rows
    host_rows: tuple[int, ...]  # the same rows on the host: a per-row read needs no device sync
    blocks: torch.Tensor      # [R, width] int64: block of KV position t (block 0 for padding)
    offsets: torch.Tensor     # [width] int64: offset of KV position t in its block
    positions: torch.Tensor   # [width] int64: 0 .. width - 1
    live: torch.Tensor        # [R, width] bool: t < the row's live length (this step's keys)
    due: torch.Tensor         # [R] bool: rows that compact (the others keep 0 tokens, move nothing)
    sink_end: torch.Tensor    # [R] int64: sinks are [0, sink_end)
    recent_start: torch.Tensor  # [R] int64: the recent window is [recent_start, live length)
    num_heavy: torch.Tensor   # [R] int64: heavy hitters taken from [sink_end, recent_start)
    targets: torch.Tensor     # [R] int64: tokens kept (0 where not due)
    # (mode, [R] bool: rows ranked by it at this step), in the order the modes apply.
    rank: tuple[tuple[ScoreMode, torch.Tensor], ...] = ()
    key_scorer: Scorer | None = None  # ranks from the live keys (None: the accumulated scores)


def due_passes(plan: StepPlan, block_table: torch.Tensor, block_size: int, *,
               every_row: bool = False, min_width: int = 0,
               buffers: StepBuffers | FreshTensors | None = None) -> tuple[DuePass, ...]:
    """The step's passes (``block_table``: the table due rows compact through). Eager steps
    pass the due rows only (none: no pass); ``every_row`` passes every row of the batch, due or
    not, so that a fixed batch launches the same pass every step. ``min_width``: KV positions
    the pass spans at least (graph-shaped decode: the engine's, ``decode_graph.engine_width``);
    a row whose decode peak needs more widens the pass. ``buffers``: where the pass's tensors
    live (default: fresh ones)."""
    buffers = buffers or FreshTensors(block_table.device)
    due = plan.due
    scorers = plan.key_scorers or (None,) * due.shape[0]
    rows_of: dict[Scorer | None, list[int]] = {}
    for row in (range(due.shape[0]) if every_row else due.nonzero().flatten().tolist()):
        rows_of.setdefault(scorers[row], []).append(row)
    return tuple(_due_pass(plan, torch.tensor(rows), block_table, block_size, scorer, min_width,
                           _Named(buffers, f"due{i}."))
                 for i, (scorer, rows) in enumerate(rows_of.items()))


class _Named:
    """A pass's names in the step's buffers (a step may run one pass per key scorer)."""

    def __init__(self, buffers, prefix: str) -> None:
        self.buffers, self.prefix = buffers, prefix

    def put(self, name: str, t: torch.Tensor, dtype=torch.int64, reserve: int = 0) -> torch.Tensor:
        return self.buffers.put(self.prefix + name, t, dtype, reserve)


def _due_pass(plan: StepPlan, rows: torch.Tensor, block_table: torch.Tensor, block_size: int,
              key_scorer: Scorer | None, min_width: int, buffers: _Named) -> DuePass:
    n = plan.kv_seq_lens[rows]
    due = plan.due[rows]
    # policy.select_keep's bounds, per row: recent = target - sinks - heavy.
    sinks, heavy = plan.sink_tokens[rows], plan.heavy[rows]
    sink_end = torch.minimum(sinks, n)
    num_recent = torch.minimum(plan.kv_lens_after[rows] - sinks - heavy, n - sink_end)
    recent_start = n - num_recent
    num_heavy = torch.where(due, torch.minimum(heavy, recent_start - sink_end), 0)
    targets = torch.where(due, sink_end + num_heavy + num_recent, 0)
    # A power of two of blocks, at least every row's decode peak: a decode batch keeps one
    # width from step to step, and a batch whose budgets differ a little shares it.
    peak = n if plan.kv_peak_lens is None else torch.maximum(n, plan.kv_peak_lens[rows])
    num_blocks = max(-(-int(peak.max()) // block_size), -(-min_width // block_size))
    width = min(1 << (num_blocks - 1).bit_length(), block_table.shape[1]) * block_size
    positions = torch.arange(width)
    live = positions[None, :] < n[:, None]
    num_rows = buffers.buffers.rows
    put = buffers.put
    rows_d, live_d = put("rows", rows, reserve=num_rows), put("live", live, torch.bool, num_rows * width)
    offsets = put("offsets", positions % block_size, reserve=width)
    positions_d = put("positions", positions, reserve=width)
    blocks = block_table[rows_d][:, positions_d // block_size].to(torch.int64)
    return DuePass(rows=rows_d, host_rows=tuple(rows.tolist()),
                   blocks=put("blocks", torch.where(live_d, blocks, 0), reserve=num_rows * width),
                   offsets=offsets, positions=positions_d, live=live_d,
                   due=put("due", due, torch.bool, num_rows),
                   sink_end=put("sink_end", sink_end, reserve=num_rows),
                   recent_start=put("recent_start", recent_start, reserve=num_rows),
                   num_heavy=put("num_heavy", num_heavy, reserve=num_rows),
                   targets=put("targets", targets, reserve=num_rows),
                   rank=_rank(plan, rows.tolist(), buffers), key_scorer=key_scorer)


def _rank(plan: StepPlan, rows: list[int], buffers: _Named) -> tuple[tuple[ScoreMode, torch.Tensor], ...]:
    """Every ranking mode of the rows' budgets (``StepPlan.ranking``), each with the rows that
    rank with it at this step (``StepPlan.rank``): the i-th mode of each row applies i-th."""
    ranking = plan.ranking or plan.rank
    out = []
    for i in range(max((len(ranking[r]) for r in rows), default=0)):
        modes = dict.fromkeys(ranking[r][i] for r in rows if len(ranking[r]) > i)
        for mode in modes:
            ranks = [len(plan.rank[r]) > i and plan.rank[r][i] == mode for r in rows]
            name = f"rank{len(out)}"
            out.append((mode, buffers.put(name, torch.tensor(ranks), torch.bool, buffers.buffers.rows)))
    return tuple(out)


def live_scores(due: DuePass, scores: torch.Tensor) -> torch.Tensor:
    """[R, Hkv, width] fp32: the rows' scores by KV position, 0 on the padding."""
    gathered = scores[due.blocks, :, due.offsets[None, :]].transpose(1, 2)
    return gathered.masked_fill(~due.live[:, None, :], 0.0)


def ranked_candidates(due: DuePass, ranked: torch.Tensor) -> torch.Tensor:
    """[R, Hkv, width] fp32: what the heavy hitters are chosen by, the rows' ranking modes
    applied; -inf outside each row's candidates [sink_end, recent_start)."""
    pos = due.positions[None, :]
    candidate = ((pos >= due.sink_end[:, None]) & (pos < due.recent_start[:, None]))[:, None, :]
    masked = ranked.masked_fill(~candidate, float("-inf"))
    for mode, rows in due.rank:
        # A mode sees -inf past the candidates (pooling's own edge padding); its value there is dropped.
        masked = torch.where(candidate & rows[:, None, None], mode.rank(masked), masked)
    return masked


def keep_sets(due: DuePass, ranked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [R, Hkv, width] bool, keep_idx [R, Hkv, width] int64): the tokens each (row, KV
    head) keeps, and their positions, ascending, in the first ``targets[row]`` entries.

    ``policy.select_keep`` over padded rows: sinks, recent window, and the ``num_heavy`` best
    candidates ranked by a stable sort of the reversed row, so that among equal scores the more
    recent token wins (docs/semantics.md, "Eviction"); padding and non-candidates sort last."""
    pos = due.positions[None, :]
    masked = ranked_candidates(due, ranked)
    width = ranked.shape[-1]
    order = torch.sort(masked.flip(-1), dim=-1, descending=True, stable=True).indices
    chosen = (pos < due.num_heavy[:, None])[:, None, :].expand_as(order)  # the first num_heavy
    heavy = torch.zeros(order.shape, dtype=torch.bool, device=order.device)
    heavy.scatter_(-1, width - 1 - order, chosen)
    fixed = (pos < due.sink_end[:, None]) | ((pos >= due.recent_start[:, None]) & due.live)
    keep = heavy | fixed[:, None, :]
    keep_idx = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    return keep, keep_idx


def masses(due: DuePass, live: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[2] fp32: the due rows' attention mass before and after compaction."""
    counted = live.masked_fill(~due.due[:, None, None], 0.0)
    return torch.stack([counted.sum(), counted.masked_fill(~keep, 0.0).sum()])
