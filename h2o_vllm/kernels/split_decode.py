"""Triton kernels of H2O's split-KV decode (worker process, CUDA path): ``h2o_split_decode``,
the fused attention + score work of a decode-only batch with each row's keys split over
several programs, as vLLM's 3D ``unified_attention`` splits them (flash-decoding).

Why: ``attention.h2o_attention`` runs one program per (row, KV head). A few long rows (small
batches, long contexts: 4 rows x 32k keys) leave most SMs idle and one program walks 32k keys;
splitting each row's keys fills the GPU as vLLM's 3D kernel does (docs/cuda.md, "Split-KV decode").

Two launches:

1. ``split_attention_kernel``, grid (row, KV head, split): each program attends its contiguous
   range of the row's keys (a whole number of tiles, vLLM's segment rule) and writes each query
   head's logits (fp32, log2 units, after scale and soft-cap) to the logits scratch, its running
   (max, sum of exp2) and its unnormalised fp32 partial output. Sink logits join split 0 only.
2. ``split_reduce_kernel``, grid (row, KV head, tile of keys): combines the splits' (max, sum)
   into the row's log-sum-exp, turns its tile's stored logits into probabilities, sums them over
   the group and adds them into ``scores`` (weighted like ``h2o_attention``); tile 0 also
   combines the partial outputs into the output, as vLLM's ``reduce_segments`` does.

The logits are stored, not recomputed: recomputing them reads K again (2 * head_size bytes per
key and KV head) where storing costs 8 bytes per key and query head, written once, read once.
What is exact: each logit is the attention's own fp32 value, and the probabilities use the final
normaliser. What is not bitwise: the splits' sums combine in another order than one program's
running sum, so output and scores differ from ``h2o_attention``'s by fp32 reassociation (and,
for 16-bit queries, P's rounding before P.V against a per-split max), as vLLM's 3D output
differs from its 2D output.

Every row has one query, token i of row i. A row of 0 keys (a padded row) writes zeros.
Grids depend on (rows, KV heads, splits, ``max_kv_len``) only: a CUDA graph can replay them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_vllm.kernels import (FP8_CACHE_DTYPES, check_lens, check_paged, check_query, check_sinks,
                              check_tile, check_weights)
from h2o_vllm.kernels.attention import _dot, block_m_of, kv_tile, softmax_tile
from h2o_vllm.kernels.tiles import LOG2E, soft_cap, softmax_start

#: vLLM's rule for its 3D kernel (``MIN_LAUNCH_GRID_SIZE_2D``, ``NUM_PAR_SOFTMAX_SEGMENTS``):
#: split when one program per (row, KV head) makes fewer than 128 programs, into up to 16.
MIN_GRID_2D = 128
MAX_SPLITS = 16
#: Keys a split walks at least: a shorter split costs its reduce more than it saves.
MIN_SPLIT_KEYS = 128


def num_splits(num_rows: int, num_kv_heads: int, max_kv_len: int) -> int:
    """How many programs split each row's keys in a decode-only step; 1: the 2D kernel
    (``attention.h2o_attention``) fills the GPU already, or the rows are too short to split.
    Depends on the batch's shape and a bound on its lengths: a captured step passes its fixed
    bound and keeps one launch shape."""
    if num_rows * num_kv_heads > MIN_GRID_2D:
        return 1
    return max(1, min(MAX_SPLITS, max_kv_len // MIN_SPLIT_KEYS))


@triton.jit
def split_attention_kernel(
        query, key_cache, value_cache, block_table, seq_lens, logits, decode_offsets,
        m_part, l_part, out_part, sinks, scale_log2, cap_log2, k_scale, v_scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, stride_gh, block_size, num_splits,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(seq_lens + row)
    # vLLM's segments: a whole number of tiles each, so a split's tiles are the 2D kernel's.
    seg = tl.cdiv(kv_len, num_splits * TILE) * TILE
    start = split * seg
    end = tl.minimum(start + seg, kv_len)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < GROUP
    q_head = kv_head * GROUP + offs_m
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    q = tl.load(query + row.to(tl.int64) * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    bt_row = block_table + row.to(tl.int64) * stride_bt
    lg_row = logits + q_head.to(tl.int64)[:, None] * stride_gh + tl.load(decode_offsets + row)
    first = (offs_m * 0 + split) == 0  # a vector: the sink joins split 0's lanes only
    m_i, l_i = softmax_start(sinks, q_head, m_mask & first, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for n0 in range(start, end, TILE):
        offs_n = n0 + tl.arange(0, TILE)
        n_mask = offs_n < end
        k, v = kv_tile(key_cache, value_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       block_size, k_scale, v_scale, q.dtype, FP8)
        s = soft_cap(_dot(q, k, IEEE) * scale_log2, cap_log2, SOFTCAP)
        live = m_mask[:, None] & n_mask[None, :]
        s = tl.where(live, s, float("-inf"))
        tl.store(lg_row + offs_n[None, :], s, mask=live)
        m_i, l_i, acc = softmax_tile(m_i, l_i, acc, s, v, IEEE)
    # [row, query head, split]: num_programs(1) * GROUP is the number of query heads.
    ml = (row.to(tl.int64) * GROUP * tl.num_programs(1) + q_head) * num_splits + split
    tl.store(m_part + ml, m_i, mask=m_mask)
    tl.store(l_part + ml, l_i, mask=m_mask)
    tl.store(out_part + ml[:, None] * HEAD_SIZE + offs_d[None, :], acc,
             mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def split_reduce_kernel(
        out, seq_lens, logits, decode_offsets, m_part, l_part, out_part, scores,
        block_table, query_weight, score_scale,
        stride_ot, stride_oh, stride_bt, stride_gh, stride_sb, stride_sh, stride_ss,
        block_size, num_splits,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, TILE: tl.constexpr,
        WEIGHTED: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_len = tl.load(seq_lens + row)
    if tile > 0 and tile * TILE >= kv_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < GROUP
    q_head = kv_head * GROUP + offs_m
    base = (row.to(tl.int64) * GROUP * tl.num_programs(1) + q_head) * num_splits  # [BLOCK_M]
    offs_s = tl.arange(0, SPLITS_PAD)
    ms_mask = m_mask[:, None] & (offs_s < num_splits)[None, :]
    m_s = tl.load(m_part + base[:, None] + offs_s[None, :], mask=ms_mask, other=float("-inf"))
    l_s = tl.load(l_part + base[:, None] + offs_s[None, :], mask=ms_mask, other=0.0)
    big = tl.max(m_s, axis=1)
    big = tl.where(big > float("-inf"), big, 0.0)  # a row of no keys (and padding lanes)
    weight_s = tl.exp2(m_s - big[:, None])  # an empty split (max -inf) weighs 0
    total = tl.sum(l_s * weight_s, axis=1)
    total = tl.where(total > 0.0, total, 1.0)
    if tile == 0:
        offs_d = tl.arange(0, HEAD_PAD)
        d_mask = offs_d < HEAD_SIZE
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for s in range(0, num_splits):
            w = tl.exp2(tl.load(m_part + base + s, mask=m_mask, other=float("-inf")) - big)
            acc += w[:, None] * tl.load(out_part + (base + s)[:, None] * HEAD_SIZE + offs_d[None, :],
                                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        tl.store(out + row.to(tl.int64) * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
                 (acc / total[:, None]).to(out.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])
    lse2 = big + tl.log2(total)
    offs_n = tile * TILE + tl.arange(0, TILE)
    n_mask = offs_n < kv_len
    lg_row = logits + q_head.to(tl.int64)[:, None] * stride_gh + tl.load(decode_offsets + row)
    s = tl.load(lg_row + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=float("-inf"))
    col = tl.sum(tl.exp2(s - lse2[:, None]), axis=0)
    bt_row = block_table + row.to(tl.int64) * stride_bt
    blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    ptr = scores + blk * stride_sb + kv_head * stride_sh + (offs_n % block_size) * stride_ss
    # The row's new slot (its last position) starts at 0: its old score is not read.
    old = tl.load(ptr, mask=n_mask & (offs_n < kv_len - 1), other=0.0)
    if WEIGHTED:
        tl.store(ptr, old * tl.load(score_scale + row) + tl.load(query_weight + row) * col, mask=n_mask)
    else:
        tl.store(ptr, old + col, mask=n_mask)


def h2o_split_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, scores: torch.Tensor, decode_offsets: torch.Tensor,
                     num_decode_keys: int, *, num_splits: int = 16, max_kv_len: int | None = None,
                     query_weight: torch.Tensor | None = None,
                     score_scale: torch.Tensor | None = None, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, tile_n: int = 32, score_tile: int = 256) -> None:
    """A decode-only batch's attention into out and its scores into scores, each row's keys
    split over ``num_splits`` programs: what ``h2o_attention`` computes for decode rows.

    query, out: [num_rows, num_q_heads, head_size], row i's one query at token i; seq_lens
    [num_rows] int32, this step's key included; decode_offsets [num_rows] int64 and
    num_decode_keys as ``attention.decode_logit_offsets`` gives them (any disjoint ranges of
    at least each row's length do). ``max_kv_len``: a bound on seq_lens that sizes the reduce's
    grid (default: none given, read from seq_lens, a device sync on a GPU; a captured step
    passes its fixed bound). Weights, softcap, sinks and fp8 scales as ``h2o_attention``
    (query_weight indexed by row, since token i is row i)."""
    _, block_size, num_kv_heads, head_size = check_paged("key_cache", key_cache, block_table, scores)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache must match key_cache {tuple(key_cache.shape)} "
                         f"{key_cache.dtype}, got {tuple(value_cache.shape)} {value_cache.dtype}")
    group = check_query(query, key_cache, num_kv_heads)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, contiguous in "
                         f"head_size; got {tuple(out.shape)} {out.dtype}")
    check_tile(tile_n=tile_n, score_tile=score_tile)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_rows = query.shape[0]
    check_lens("seq_lens", seq_lens, num_rows, key_cache.device)
    if block_table.shape[0] < num_rows:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, need {num_rows}")
    if decode_offsets.shape != (num_rows,) or decode_offsets.dtype != torch.int64:
        raise ValueError(f"decode_offsets must be [{num_rows}] int64")
    weighted = check_weights(query_weight, num_rows, score_scale, num_rows, key_cache.device)
    with_sinks = check_sinks(sinks, query.shape[1], key_cache.device)
    if num_rows == 0:
        return
    if max_kv_len is None:
        max_kv_len = int(seq_lens.max())
    device, q_heads = query.device, query.shape[1]
    logits = torch.empty(q_heads, max(num_decode_keys, 1), dtype=torch.float32, device=device)
    m_part = torch.empty(num_rows, q_heads, num_splits, dtype=torch.float32, device=device)
    l_part = torch.empty_like(m_part)
    out_part = torch.empty(num_rows, q_heads, num_splits, head_size, dtype=torch.float32, device=device)
    block_m = block_m_of(group)
    head_pad = max(16, triton.next_power_of_2(head_size))
    unused = out  # pointer arguments a compiled variant never reads
    split_attention_kernel[(num_rows, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_table, seq_lens, logits, decode_offsets,
        m_part, l_part, out_part, sinks if with_sinks else unused,
        float(scale) * LOG2E, float(softcap) * LOG2E, float(k_scale), float(v_scale),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), logits.stride(0), block_size, num_splits,
        GROUP=group, BLOCK_M=block_m, HEAD_SIZE=head_size, HEAD_PAD=head_pad, TILE=tile_n,
        IEEE=query.dtype == torch.float32, SOFTCAP=softcap > 0, SINKS=with_sinks,
        FP8=key_cache.dtype in FP8_CACHE_DTYPES)
    split_reduce_kernel[(num_rows, num_kv_heads, max(1, triton.cdiv(max_kv_len, score_tile)))](
        out, seq_lens, logits, decode_offsets, m_part, l_part, out_part, scores, block_table,
        query_weight if weighted else unused, score_scale if weighted else unused,
        out.stride(0), out.stride(1), block_table.stride(0), logits.stride(0), *scores.stride(),
        block_size, num_splits,
        GROUP=group, BLOCK_M=block_m, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), TILE=score_tile, WEIGHTED=weighted)
