"""Triton kernel that compacts rows of the paged cache: kept K, V and scores move to [0, target).

Runs in the worker process (CUDA path), after score accumulation, for the rows whose cadence
says so (ARCHITECTURE.md, "Eviction" and "Worker side"). key_cache and value_cache:
[num_blocks, block_size, num_kv_heads, head_size]; scores: [num_blocks, num_kv_heads,
block_size] fp32, KV-space. Positions [target, old kv_len) are left as they are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_vllm.kernels import check_paged


@triton.jit
def compact_rows_kernel(
        key_cache, value_cache, scores, block_table, rows, keep_idx, target,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_sb, stride_sh, stride_ss, stride_bt, stride_ir, stride_ih, stride_it, block_size,
        HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    # One program per (selected row, KV head); different programs touch disjoint memory.
    # In place, tiles in order: keep_idx is strictly ascending, so keep_idx[j] >= j and every
    # source of tile [t0, t0 + BLOCK_T) lies at or past t0, never where an earlier tile wrote.
    # Within a tile a lane may store where another lane still has to read (keep_idx[j'] = j
    # with j' < j): the barrier orders all of the tile's loads before any of its stores.
    sel = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows + sel).to(tl.int64)
    bt_row = block_table + row * stride_bt
    idx_row = keep_idx + sel.to(tl.int64) * stride_ir + kv_head * stride_ih
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    for t0 in range(0, target, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < target
        td_mask = t_mask[:, None] & d_mask[None, :]
        src = tl.load(idx_row + offs_t * stride_it, mask=t_mask, other=0)
        src_blk = tl.load(bt_row + src // block_size, mask=t_mask, other=0).to(tl.int64)
        src_off = src % block_size
        k = tl.load(key_cache + src_blk[:, None] * stride_kb + src_off[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=td_mask)
        v = tl.load(value_cache + src_blk[:, None] * stride_vb + src_off[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=td_mask)
        s = tl.load(scores + src_blk * stride_sb + kv_head * stride_sh + src_off * stride_ss,
                    mask=t_mask)
        tl.debug_barrier()  # every lane has read the tile before any lane overwrites it
        dst_blk = tl.load(bt_row + offs_t // block_size, mask=t_mask, other=0).to(tl.int64)
        dst_off = offs_t % block_size
        tl.store(key_cache + dst_blk[:, None] * stride_kb + dst_off[:, None] * stride_ks
                 + kv_head * stride_kh + offs_d[None, :], k, mask=td_mask)
        tl.store(value_cache + dst_blk[:, None] * stride_vb + dst_off[:, None] * stride_vs
                 + kv_head * stride_vh + offs_d[None, :], v, mask=td_mask)
        tl.store(scores + dst_blk * stride_sb + kv_head * stride_sh + dst_off * stride_ss,
                 s, mask=t_mask)


def compact_rows(key_cache: torch.Tensor, value_cache: torch.Tensor, scores: torch.Tensor,
                 block_table: torch.Tensor, rows: torch.Tensor, keep_idx: torch.Tensor, *,
                 block_t: int = 32) -> None:
    """For each selected row and KV head h: K, V, scores at KV positions keep_idx[i, h, :] of
    row rows[i] move to KV positions [0, target) of the same row, in place.

    rows: [num_sel_rows] int32/int64 indices into block_table (distinct).
    keep_idx: [num_sel_rows, num_kv_heads, target] int64, strictly ascending per (row, head),
    every entry < that row's kv_len (policy.select_keep's output); not checked on device.
    One program per (row, KV head), tiles of block_t positions in order: every kept value is
    read once and written once.
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
    for t, n in ((rows, "rows"), (keep_idx, "keep_idx")):
        if t.device != key_cache.device:
            raise ValueError(f"{n} is on {t.device}, key_cache on {key_cache.device}")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    if rows.shape[0] == 0 or target == 0:
        return
    rows = rows.contiguous()
    compact_rows_kernel[(rows.shape[0], num_kv_heads)](
        key_cache, value_cache, scores, block_table, rows, keep_idx, target,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        scores.stride(0), scores.stride(1), scores.stride(2), block_table.stride(0),
        keep_idx.stride(0), keep_idx.stride(1), keep_idx.stride(2), block_size,
        HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_T=block_t)
