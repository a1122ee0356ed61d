"""Triton kernel of a due pass's keep-sets (worker process, CUDA path): ``select_keep_rows``,
what ``worker.due_pass.keep_sets`` computes with two sorts, in one launch whose programs
return at once for rows not due.

Why: a captured decode step replays its due pass at every step, due or not (docs/cuda.md, "What
full CUDA graphs would need"); with torch's sorts every row of the batch pays the sort of its
whole padded width at every layer. Here a row not due costs one load.

One program per (row, KV head), the row's padded width W (a power of two) in one tile. The
heavy hitters are the ``num_heavy`` best candidates ([sink_end, recent_start)): the threshold
is found by bisecting the scores' order-preserving integer keys bit by bit (32 steps, each a
count over the tile) instead of sorting; ties at the threshold go to the more recent positions
(a second bisection, over positions), which is the rule ``policy.select_keep``'s stable sort of
the reversed row implements (docs/semantics.md, "Eviction"). Sinks and the recent window up to
the live length are kept whatever their scores. Outputs: ``keep`` (bool) and ``keep_idx``, the
kept positions ascending in its first ``target`` entries (what ``compact_rows`` reads); nothing
is written for rows not due.

Exact: the same set as ``keep_sets`` for finite scores (-0.0 ranks as 0.0, as a sort compares
it). Not the same where a candidate's score is -inf or NaN: the sort then lets a -inf tie pick
a position outside the candidates, which this kernel never does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """An int64 in [0, 2**32) that orders as the fp32 x does (-0.0 folded into +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648


@triton.jit
def select_keep_rows_kernel(
        ranked, live, due, sink_end, recent_start, num_heavy, keep, keep_idx,
        stride_rr, stride_rh, stride_lr, stride_kr, stride_kh, stride_ir, stride_ih,
        W: tl.constexpr, LOG_W: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    if tl.load(due + row) == 0:
        return
    pos = tl.arange(0, W)
    se = tl.load(sink_end + row)
    rs = tl.load(recent_start + row)
    nh = tl.load(num_heavy + row)
    candidate = (pos >= se) & (pos < rs)
    x = tl.load(ranked + row.to(tl.int64) * stride_rr + head * stride_rh + pos)
    key = tl.where(candidate, _order_key(x), -1)  # non-candidates below every candidate
    # The largest t with at least nh candidates >= t: the nh-th best score's key.
    t = tl.zeros([], tl.int64)
    for b in tl.static_range(31, -1, -1):
        trial = t | (1 << b)
        t = tl.where(tl.sum((key >= trial).to(tl.int32)) >= nh, trial, t)
    above = key > t
    need = nh - tl.sum(above.to(tl.int32))
    tie = key == t
    # Of the ties, the `need` most recent: the largest p with at least `need` ties at >= p.
    p = tl.zeros([], tl.int32)
    for b in tl.static_range(LOG_W - 1, -1, -1):
        trial = p | (1 << b)
        p = tl.where(tl.sum((tie & (pos >= trial)).to(tl.int32)) >= need, trial, p)
    heavy = (above | (tie & (pos >= p))) & ((pos * 0 + nh) > 0)  # a vector: no heavy, none
    in_live = tl.load(live + row.to(tl.int64) * stride_lr + pos) != 0
    kept = heavy | (pos < se) | ((pos >= rs) & in_live)
    tl.store(keep + row.to(tl.int64) * stride_kr + head * stride_kh + pos, kept)
    rank = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.store(keep_idx + row.to(tl.int64) * stride_ir + head * stride_ih + rank, pos.to(tl.int64),
             mask=kept)


def select_keep_rows(ranked: torch.Tensor, live: torch.Tensor, due: torch.Tensor,
                     sink_end: torch.Tensor, recent_start: torch.Tensor,
                     num_heavy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [R, Hkv, W] bool, keep_idx [R, Hkv, W] int64) of a due pass (``worker.due_pass``):
    ranked [R, Hkv, W] fp32, the candidates' ranking scores (what ``keep_sets`` sorts, the modes
    applied); live [R, W] bool; due, sink_end, recent_start, num_heavy [R] as ``DuePass`` holds
    them. Rows not due are left unwritten (``torch.empty``): readers mask them by ``due``."""
    num_rows, num_heads, width = ranked.shape
    if width & (width - 1) or ranked.dtype != torch.float32 or ranked.stride(-1) != 1:
        raise ValueError(f"ranked must be [R, Hkv, W] float32, W a power of two, contiguous in W; "
                         f"got {tuple(ranked.shape)} {ranked.dtype}")
    if live.shape != (num_rows, width) or live.dtype != torch.bool:
        raise ValueError(f"live must be [{num_rows}, {width}] bool, got {tuple(live.shape)} {live.dtype}")
    keep = torch.empty(ranked.shape, dtype=torch.bool, device=ranked.device)
    keep_idx = torch.empty(ranked.shape, dtype=torch.int64, device=ranked.device)
    if num_rows == 0:
        return keep, keep_idx
    live = live.contiguous()
    select_keep_rows_kernel[(num_rows, num_heads)](
        ranked, live, due, sink_end, recent_start, num_heavy, keep, keep_idx,
        ranked.stride(0), ranked.stride(1), live.stride(0), keep.stride(0), keep.stride(1),
        keep_idx.stride(0), keep_idx.stride(1), W=width, LOG_W=max(1, width.bit_length() - 1))
    return keep, keep_idx
