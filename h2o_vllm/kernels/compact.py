"""Triton kernel that compacts rows of the paged cache: kept K, V and scores move to [0, target).

Runs in the worker process (CUDA path), after score accumulation, for the rows whose cadence
says so (docs/semantics.md, "Eviction" and "Worker side"). key_cache and value_cache:
[num_blocks, block_size, num_kv_heads, head_size]; scores: [num_blocks, num_kv_heads,
block_size] fp32, KV-space. Positions [target, old kv_len) are left as they are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_vllm.kernels import FP8_CACHE_DTYPES, check_paged


@triton.jit
def compact_rows_kernel(
        cache, scores, block_table, rows, keep_idx, targets,
        stride_cb, stride_cs, stride_ch, stride_sb, stride_sh, stride_ss,
        stride_bt, stride_ir, stride_ih, stride_it, block_size,
        WIDTH: tl.constexpr, D_CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
        SCORES: tl.constexpr):
    # One program per (selected row, KV head, chunk of D_CHUNK of the WIDTH columns); programs
    # touch disjoint memory, so splitting the columns multiplies the programs (and the loads in
    # flight) at no cost. In place, tiles in order: keep_idx is strictly ascending, so
    # keep_idx[j] >= j and every source of tile [t0, t0 + BLOCK_T) lies at or past t0, never
    # where an earlier tile wrote. Within a tile a lane may store where another lane still has
    # to read (keep_idx[j'] = j with j' < j): the barrier orders all of the tile's loads before
    # any of its stores. Kept tokens already in place (keep_idx[j] = j: every one before the
    # first evicted token) are neither read nor written. Each row keeps its own number of
    # tokens (targets[sel] <= keep_idx's width): a row that keeps none (not due) moves nothing.
    sel = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    row = tl.load(rows + sel).to(tl.int64)
    bt_row = block_table + row * stride_bt
    idx_row = keep_idx + sel.to(tl.int64) * stride_ir + kv_head * stride_ih
    offs_d = chunk * D_CHUNK + tl.arange(0, D_CHUNK)
    d_mask = offs_d < WIDTH
    target = tl.load(targets + sel)
    for t0 in range(0, target, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        src = tl.load(idx_row + offs_t * stride_it, mask=offs_t < target, other=0)
        moves = (offs_t < target) & (src != offs_t)
        td_mask = moves[:, None] & d_mask[None, :]
        src_blk = tl.load(bt_row + src // block_size, mask=moves, other=0).to(tl.int64)
        src_off = src % block_size
        x = tl.load(cache + src_blk[:, None] * stride_cb + src_off[:, None] * stride_cs
                    + kv_head * stride_ch + offs_d[None, :], mask=td_mask)
        if SCORES:  # by chunk 0 only: one writer per score, in tile order like the rest
            s_mask = moves & (offs_t * 0 + chunk == 0)  # a vector: the interpreter wants one
            s = tl.load(scores + src_blk * stride_sb + kv_head * stride_sh + src_off * stride_ss,
                        mask=s_mask)
        tl.debug_barrier()  # every lane has read the tile before any lane overwrites it
        dst_blk = tl.load(bt_row + offs_t // block_size, mask=moves, other=0).to(tl.int64)
        dst_off = offs_t % block_size
        tl.store(cache + dst_blk[:, None] * stride_cb + dst_off[:, None] * stride_cs
                 + kv_head * stride_ch + offs_d[None, :], x, mask=td_mask)
        if SCORES:
            tl.store(scores + dst_blk * stride_sb + kv_head * stride_sh + dst_off * stride_ss,
                     s, mask=s_mask)


def _k_and_v_in_one_row(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether V sits right after K in every (block, slot, head) row of one buffer: Triton
    attention's [num_blocks, num_kv_heads, block_size, 2 * head_size] cache seen through
    ``TritonOps.cache_views``. Then one launch moves both as rows of 2 * head_size."""
    head_size = key_cache.shape[-1]
    return (key_cache.stride() == value_cache.stride()
            and key_cache.untyped_storage().data_ptr() == value_cache.untyped_storage().data_ptr()
            and value_cache.data_ptr() == key_cache.data_ptr() + head_size * key_cache.element_size()
            and min(key_cache.stride()[:3]) >= 2 * head_size)


def compact_rows(key_cache: torch.Tensor, value_cache: torch.Tensor, scores: torch.Tensor,
                 block_table: torch.Tensor, rows: torch.Tensor, keep_idx: torch.Tensor,
                 targets: torch.Tensor | None = None, *,
                 block_t: int = 64, d_chunk_max: int = 64) -> None:
    """For each selected row and KV head h: K, V, scores at KV positions keep_idx[i, h, :] of
    row rows[i] move to KV positions [0, target) of the same row, in place.
    targets: [num_sel_rows] int64, each row's own target (the first targets[i] entries of
    keep_idx[i] count; 0: the row moves nothing); None: keep_idx's width for every row. The
    grid depends on the shapes only, so a step replays the same launch whatever its rows keep.

    rows: [num_sel_rows] int32/int64 indices into block_table (distinct).
    keep_idx: [num_sel_rows, num_kv_heads, target] int64, strictly ascending per (row, head),
    every entry < that row's kv_len (policy.select_keep's output); not checked on device.
    One program per (row, KV head, d_chunk_max columns), tiles of block_t positions in order:
    every kept value that moves is read once and written once; one already in place is not
    touched. K and V go in one launch when they share a buffer's rows (the Triton cache).
    """
    num_blocks, block_size, num_kv_heads, head_size = check_paged(
        "key_cache", key_cache, block_table, scores)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache must match key_cache {tuple(key_cache.shape)} "
                         f"{key_cache.dtype}, got {tuple(value_cache.shape)} {value_cache.dtype}")
    if value_cache.stride(-1) != 1 or value_cache.device != key_cache.device:
        raise ValueError("value_cache must be contiguous in head_size and on key_cache's device")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [num_sel_rows] int32/int64, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    if (keep_idx.dim() != 3 or keep_idx.dtype != torch.int64
            or tuple(keep_idx.shape[:2]) != (rows.shape[0], num_kv_heads)):
        raise ValueError(f"keep_idx must be [{rows.shape[0]}, {num_kv_heads}, target] int64, "
                         f"got {tuple(keep_idx.shape)} {keep_idx.dtype}")
    target = keep_idx.shape[2]
    if target > block_table.shape[1] * block_size:
        raise ValueError(f"target {target} exceeds a row's capacity "
                         f"{block_table.shape[1] * block_size}")
    if targets is None:
        targets = torch.full((rows.shape[0],), target, dtype=torch.int64, device=rows.device)
    elif targets.shape != rows.shape:
        raise ValueError(f"targets must be [{rows.shape[0]}] like rows, got {tuple(targets.shape)}")
    for t, n in ((rows, "rows"), (keep_idx, "keep_idx"), (targets, "targets")):
        if t.device != key_cache.device:
            raise ValueError(f"{n} is on {t.device}, key_cache on {key_cache.device}")
    for name, size in (("block_t", block_t), ("d_chunk_max", d_chunk_max)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two, got {size}")
    if rows.shape[0] == 0 or target == 0:
        return
    rows = rows.contiguous()
    if key_cache.dtype in FP8_CACHE_DTYPES:  # moved as bytes: no float conversion on the way
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    # One launch for K and V together where they share rows (the CUDA path), else one each.
    parts = ([(key_cache, 2 * head_size)] if _k_and_v_in_one_row(key_cache, value_cache)
             else [(key_cache, head_size), (value_cache, head_size)])
    for i, (cache, width) in enumerate(parts):
        d_chunk = min(d_chunk_max, triton.next_power_of_2(width))
        compact_rows_kernel[(rows.shape[0], num_kv_heads, triton.cdiv(width, d_chunk))](
            cache, scores, block_table, rows, keep_idx, targets.contiguous(),
            cache.stride(0), cache.stride(1), cache.stride(2),
            scores.stride(0), scores.stride(1), scores.stride(2), block_table.stride(0),
            keep_idx.stride(0), keep_idx.stride(1), keep_idx.stride(2), block_size,
            WIDTH=width, D_CHUNK=d_chunk, BLOCK_T=block_t, SCORES=i == 0)
