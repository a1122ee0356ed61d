"""Triton kernel that adds a decode step's attention probabilities into the H2O score buffer
(worker process, CUDA path): ``accumulate_decode_scores``, one query per row.

What every score kernel guarantees (one writer per score, fp32 math, layouts): see
``h2o_vllm.kernels``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_vllm.kernels import (check_lens, check_paged, check_query, check_sinks, check_tile,
                              check_weights, dot_precision)
from h2o_vllm.kernels.tiles import LOG2E, load_key_tile, online_softmax_step, soft_cap, softmax_start


@triton.jit
def accumulate_decode_scores_kernel(
        query, key_cache, block_table, kv_seq_lens, scores, query_weight, score_scale, sinks,
        scale_log2, cap_log2, k_scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
        stride_sb, stride_sh, stride_ss, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WEIGHTED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    # One program per (row, KV head): the whole GQA group at once, so K is shared by the group.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_len = tl.load(kv_seq_lens + row)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_SIZE
    q = tl.load(query + row.to(tl.int64) * stride_qt
                + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    bt_row = block_table + row.to(tl.int64) * stride_bt
    m_i, l_i = softmax_start(sinks, kv_head * GROUP + offs_g, g_mask, GROUP_PAD, SINKS)
    # Pass 1: running max and sum of exp2 per query head (online softmax).
    for n0 in range(0, kv_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        _, k = load_key_tile(key_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                             stride_kb, stride_ks, stride_kh, block_size, k_scale)
        s = soft_cap(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2, cap_log2, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i = online_softmax_step(m_i, l_i, s)
    # Pass 2: exact probabilities, summed over the group, added at the row's slots.
    # l_i >= 1 whenever kv_len > 0 (the max term, a key's or the sink's, is exp2(0)); the
    # floor only spares padding rows.
    inv_l = tl.where(g_mask, 1.0 / tl.maximum(l_i, 1.0), 0.0)
    if WEIGHTED:  # pass 2 visits every live key of the row once: decay them all there
        weight = tl.load(query_weight + row)
        old_scale = tl.load(score_scale + row)
    for n0 in range(0, kv_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        blk, k = load_key_tile(key_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                               stride_kb, stride_ks, stride_kh, block_size, k_scale)
        s = soft_cap(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2, cap_log2, SOFTCAP)
        p = tl.exp2(s - m_i[:, None]) * inv_l[:, None]
        col = tl.sum(p, axis=0)
        ptr = scores + blk * stride_sb + kv_head * stride_sh + (offs_n % block_size) * stride_ss
        if WEIGHTED:
            tl.store(ptr, tl.load(ptr, mask=n_mask, other=0.0) * old_scale + weight * col,
                     mask=n_mask)
        else:
            tl.store(ptr, tl.load(ptr, mask=n_mask, other=0.0) + col, mask=n_mask)


def accumulate_decode_scores(query: torch.Tensor, key_cache: torch.Tensor,
                             block_table: torch.Tensor, kv_seq_lens: torch.Tensor,
                             scores: torch.Tensor, scale: float, *,
                             query_weight: torch.Tensor | None = None,
                             score_scale: torch.Tensor | None = None, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                             block_n: int = 64) -> None:
    """scores[slot(row, t), kv_head] += sum over the group of softmax(scale * q . K^T)[t]
    (the logits soft-capped first with ``softcap`` > 0, and ``sinks`` in the denominator, as
    in ``prefill_lse``).

    query: [num_rows, num_q_heads, head_size], one decode query per row. Weighted (both or
    neither of query_weight [num_rows] and score_scale [num_rows], fp32): scores of every live
    t become score_scale[row] * scores + query_weight[row] * (that sum); a separately compiled
    variant, so the unweighted kernel is unchanged.
    One program per (row, KV head) holds the whole GQA group's queries and makes two passes
    over the row's keys (online max/sum, then probabilities): K read twice, scores read and
    written once, no split over the key axis (parallelism num_rows * num_kv_heads). Rows with
    kv_seq_lens 0 (padding) are no-ops. An fp8 key_cache is read as ``fp8 * k_scale``.
    """
    _, _, num_kv_heads, head_size = check_paged("key_cache", key_cache, block_table, scores)
    check_tile(block_n=block_n)
    group = check_query(query, key_cache, num_kv_heads)
    num_rows = query.shape[0]
    if block_table.shape[0] < num_rows:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, query {num_rows}")
    check_lens("kv_seq_lens", kv_seq_lens, num_rows, key_cache.device)
    weighted = check_weights(query_weight, num_rows, score_scale, num_rows, key_cache.device)
    with_sinks = check_sinks(sinks, query.shape[1], key_cache.device)
    if num_rows == 0:
        return
    accumulate_decode_scores_kernel[(num_rows, num_kv_heads)](
        query, key_cache, block_table, kv_seq_lens, scores,
        query_weight if weighted else scores, score_scale if weighted else scores,  # unread
        sinks if with_sinks else scores,
        float(scale) * LOG2E, float(softcap) * LOG2E, float(k_scale),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), block_table.stride(0),
        scores.stride(0), scores.stride(1), scores.stride(2), key_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype), WEIGHTED=weighted,
        SOFTCAP=softcap > 0, SINKS=with_sinks)
