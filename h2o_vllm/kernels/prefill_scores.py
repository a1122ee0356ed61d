"""Triton kernels that add a prefill step's causal attention probabilities into the H2O score
buffer (worker process, CUDA path): ``prefill_lse`` (pass 1) and ``accumulate_prefill_scores``.

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
def prefill_lse_kernel(
        query, key_cache, block_table, query_start_loc, kv_seq_lens, lse, sinks, scale_log2,
        cap_log2, k_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
        stride_lt, stride_lh, block_size,
        GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    # One program per (row, KV head, tile of BLOCK_M (query, group head) pairs).
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_loc + row)
    q_len = tl.load(query_start_loc + row + 1) - q_start
    kv_len = tl.load(kv_seq_lens + row)
    if m0 >= q_len * GROUP:
        return
    ctx_len = kv_len - q_len  # KV positions written before this step (earlier chunks)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # flattened (query j, group head hh) = j * GROUP + hh
    m_mask = offs_m < q_len * GROUP
    tok = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    q_pos = ctx_len + tok
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    q = tl.load(query + (q_start + tok).to(tl.int64)[:, None] * stride_qt
                + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    bt_row = block_table + row.to(tl.int64) * stride_bt
    last_tok = (tl.minimum(m0 + BLOCK_M, q_len * GROUP) - 1) // GROUP
    kv_end = ctx_len + last_tok + 1  # causal: no key of this tile is past the last query
    m_i, l_i = softmax_start(sinks, q_head, m_mask, BLOCK_M, SINKS)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        _, k = load_key_tile(key_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                             stride_kb, stride_ks, stride_kh, block_size, k_scale)
        s = soft_cap(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2, cap_log2, SOFTCAP)
        # Key 0 is visible to every query (padded ones too), so m_i is finite after tile 0.
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i = online_softmax_step(m_i, l_i, s)
    # Natural-log LSE of the unscaled-by-log2e logits: lse = ln(sum_k exp(scale * q.k)
    # [+ exp(sink)]).
    tl.store(lse + (q_start + tok).to(tl.int64) * stride_lt + q_head * stride_lh,
             (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=m_mask)


@triton.jit
def accumulate_prefill_scores_kernel(
        query, key_cache, block_table, query_start_loc, kv_seq_lens, lse, scores, query_weight,
        score_scale, first_scored, scale_log2, cap_log2, k_scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
        stride_lt, stride_lh, stride_sb, stride_sh, stride_ss, block_size,
        GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WEIGHTED: tl.constexpr, FRESH: tl.constexpr, SOFTCAP: tl.constexpr):
    # One program per (row, KV head, tile of BLOCK_N KV positions): it owns those score columns
    # and loops over the (query, group head) tiles that can see them. Weighted: the columns'
    # old scores are decayed once, at the store, and each query's probabilities are weighted
    # (the lse of pass 1 is the plain softmax normaliser: weights scale probabilities only).
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    kv_len = tl.load(kv_seq_lens + row)
    if n0 >= kv_len:
        return
    q_start = tl.load(query_start_loc + row)
    q_len = tl.load(query_start_loc + row + 1) - q_start
    ctx_len = kv_len - q_len
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_len
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    bt_row = block_table + row.to(tl.int64) * stride_bt
    blk, k = load_key_tile(key_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                           stride_kb, stride_ks, stride_kh, block_size, k_scale)
    acc = tl.zeros([BLOCK_N], tl.float32)
    # Queries j < n0 - ctx_len see none of these keys (causal): start at the first that can.
    first = tl.maximum(n0 - ctx_len, 0) * GROUP
    first_weighted = 0
    if WEIGHTED:  # queries before the row's first scored one add nothing: skip their tiles
        first_weighted = tl.load(first_scored + row) * GROUP
        first = tl.maximum(first, first_weighted)
    for m0 in range((first // BLOCK_M) * BLOCK_M, q_len * GROUP, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len * GROUP
        tok = offs_m // GROUP
        q_head = kv_head * GROUP + offs_m % GROUP
        q = tl.load(query + (q_start + tok).to(tl.int64)[:, None] * stride_qt
                    + q_head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        row_lse = tl.load(lse + (q_start + tok).to(tl.int64) * stride_lt + q_head * stride_lh,
                          mask=m_mask, other=0.0) * 1.4426950408889634
        s = soft_cap(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2, cap_log2, SOFTCAP)
        visible = (m_mask[:, None] & n_mask[None, :]
                   & (offs_n[None, :] <= (ctx_len + tok)[:, None]))
        p = tl.where(visible, tl.exp2(s - row_lse[:, None]), 0.0)
        if WEIGHTED:
            w = tl.load(query_weight + (q_start + tok).to(tl.int64), mask=m_mask, other=0.0)
            w = tl.where(offs_m >= first_weighted, w, 0.0)  # the first tile's earlier queries
            p = p * w[:, None]
        acc += tl.sum(p, axis=0)
    ptr = scores + blk * stride_sb + kv_head * stride_sh + (offs_n % block_size) * stride_ss
    # FRESH: the slots this step wrote (positions >= ctx_len) start at 0, unread.
    old_mask = n_mask
    if FRESH:
        old_mask = n_mask & (offs_n < ctx_len)
    old = tl.load(ptr, mask=old_mask, other=0.0)
    if WEIGHTED:
        tl.store(ptr, old * tl.load(score_scale + row) + acc, mask=n_mask)
    else:
        tl.store(ptr, old + acc, mask=n_mask)


def prefill_lse(query: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                query_start_loc: torch.Tensor, kv_seq_lens: torch.Tensor, scale: float, *,
                max_query_len: int | None = None, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: float = 1.0, block_m: int = 64,
                block_n: int = 64) -> torch.Tensor:
    """Per query and query head, ln(sum over visible keys of exp(scale * q . k)), causal
    (with ``softcap`` > 0, of the capped logits ``softcap * tanh(scale * q . k / softcap)``;
    with ``sinks`` [num_q_heads], gpt-oss's sink logits, ``+ exp(sinks[head])`` in the sum:
    the probabilities ``exp(logit - lse)`` are then the model's, the sink's share nobody's).

    Returns lse: [num_tokens, num_q_heads] fp32. Pass 1 of accumulate_prefill_scores.
    """
    _, _, num_kv_heads, head_size = check_paged("key_cache", key_cache, block_table, None)
    check_tile(block_m=block_m, block_n=block_n)
    group = check_query(query, key_cache, num_kv_heads)
    num_rows = query_start_loc.shape[0] - 1
    check_lens("query_start_loc", query_start_loc, num_rows + 1, key_cache.device)
    check_lens("kv_seq_lens", kv_seq_lens, num_rows, key_cache.device)
    if block_table.shape[0] < num_rows:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, need {num_rows}")
    with_sinks = check_sinks(sinks, query.shape[1], key_cache.device)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    if max_query_len is None:  # pass it (vLLM metadata has it) to avoid a device sync
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_rows else 0
    if num_rows == 0 or max_query_len == 0:
        return lse
    grid = (num_rows, num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    prefill_lse_kernel[grid](
        query, key_cache, block_table, query_start_loc, kv_seq_lens, lse,
        sinks if with_sinks else lse, float(scale) * LOG2E, float(softcap) * LOG2E, float(k_scale),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), block_table.stride(0), lse.stride(0), lse.stride(1),
        key_cache.shape[1], GROUP=group, HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype), SOFTCAP=softcap > 0, SINKS=with_sinks)
    return lse


def accumulate_prefill_scores(query: torch.Tensor, key_cache: torch.Tensor,
                              block_table: torch.Tensor, query_start_loc: torch.Tensor,
                              kv_seq_lens: torch.Tensor, scores: torch.Tensor, scale: float, *,
                              max_query_len: int | None = None, max_kv_len: int | None = None,
                              query_weight: torch.Tensor | None = None,
                              score_scale: torch.Tensor | None = None,
                              first_scored: torch.Tensor | None = None, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                              block_m: int = 64, block_n: int = 64) -> None:
    """scores[slot(row, t), kv_head] += sum over this step's queries of the row and over the
    group of the causal softmax(scale * q . K^T)[t] (soft-capped and with sinks as in
    ``prefill_lse``).

    Weighted (both or neither, fp32): query_weight [num_tokens] indexed like query and
    score_scale [num_rows]; scores of every live t of a row become score_scale[row] * scores
    + sum over its queries q of query_weight[q] * (q's group sum). A separately compiled
    variant: the unweighted kernel is unchanged, and prefill_lse is the same for both.
    first_scored (weighted only, int32 [num_rows], optional): each row's first query of nonzero
    weight (``H2OStep.prefill_first_scored``); pass 2 starts there (an observation window).

    query: [num_tokens, num_q_heads, head_size] packed by query_start_loc [num_rows + 1] int32;
    kv_seq_lens [num_rows] int32 counts this step's tokens (already in the cache), so a row may
    hold earlier chunks. Two tiled passes, never the full matrix: prefill_lse (K read once per
    query tile), then one program per KV tile reads its K once and loops over the query tiles
    that see it (Q and lse read once per KV tile); QK^T is computed twice in all. The CUDA
    path runs the fused attention instead (``h2o_vllm.kernels.attention``); this is its
    tested reference. An fp8 key_cache is read as ``fp8 * k_scale``.
    """
    check_paged("key_cache", key_cache, block_table, scores)  # fail before any launch
    check_weights(query_weight, 0, score_scale, query_start_loc.shape[0] - 1, key_cache.device)
    lse = prefill_lse(query, key_cache, block_table, query_start_loc, kv_seq_lens, scale,
                      max_query_len=max_query_len, softcap=softcap, sinks=sinks, k_scale=k_scale,
                      block_m=block_m, block_n=block_n)
    accumulate_prefill_scores_from_lse(query, key_cache, block_table, query_start_loc,
                                       kv_seq_lens, lse, scores, scale, max_kv_len=max_kv_len,
                                       query_weight=query_weight, score_scale=score_scale,
                                       first_scored=first_scored, softcap=softcap, k_scale=k_scale,
                                       block_m=block_m, block_n=block_n)


def accumulate_prefill_scores_from_lse(query: torch.Tensor, key_cache: torch.Tensor,
                                       block_table: torch.Tensor, query_start_loc: torch.Tensor,
                                       kv_seq_lens: torch.Tensor, lse: torch.Tensor,
                                       scores: torch.Tensor, scale: float, *,
                                       max_kv_len: int | None = None,
                                       query_weight: torch.Tensor | None = None,
                                       score_scale: torch.Tensor | None = None,
                                       fresh_new_slots: bool = False,
                                       first_scored: torch.Tensor | None = None, softcap: float = 0.0,
                                       k_scale: float = 1.0, block_m: int = 64,
                                       block_n: int = 64) -> None:
    """Pass 2 of accumulate_prefill_scores, given each (query, query head)'s causal
    log-sum-exp lse [num_tokens, num_q_heads] fp32 (natural log, indexed like query): from
    prefill_lse, or from the fused attention (``h2o_vllm.kernels.attention``), which computes
    it anyway. One program per KV tile reads its K once; QK^T is computed once. Sink logits
    (gpt-oss) need nothing here: they are in the lse.

    fresh_new_slots: the scores of this step's slots (each row's last q_len positions) are
    taken as 0 instead of read, so the caller need not zero them first (the fused path).
    first_scored: as in ``accumulate_prefill_scores``."""
    check_paged("key_cache", key_cache, block_table, scores)
    check_tile(block_m=block_m, block_n=block_n)
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    group = check_query(query, key_cache, num_kv_heads)
    num_rows = query_start_loc.shape[0] - 1
    check_lens("query_start_loc", query_start_loc, num_rows + 1, key_cache.device)
    check_lens("kv_seq_lens", kv_seq_lens, num_rows, key_cache.device)
    if block_table.shape[0] < num_rows:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, need {num_rows}")
    if lse.shape != query.shape[:2] or lse.dtype != torch.float32 or lse.device != query.device:
        raise ValueError(f"lse must be {tuple(query.shape[:2])} float32 on {query.device}, "
                         f"got {tuple(lse.shape)} {lse.dtype} on {lse.device}")
    # query_weight's length is query_start_loc[-1], on the device: not checked (no sync).
    weighted = check_weights(query_weight, 0, score_scale, num_rows, key_cache.device)
    if first_scored is None:
        first_scored = torch.zeros(num_rows if weighted else 1, dtype=torch.int32, device=key_cache.device)
    elif not weighted:
        raise ValueError("first_scored needs query_weight and score_scale")
    else:
        check_lens("first_scored", first_scored, num_rows, key_cache.device)
    if max_kv_len is None:
        max_kv_len = int(kv_seq_lens.max()) if num_rows else 0
    if num_rows == 0 or max_kv_len == 0:
        return
    grid = (num_rows, num_kv_heads, triton.cdiv(max_kv_len, block_n))
    accumulate_prefill_scores_kernel[grid](
        query, key_cache, block_table, query_start_loc, kv_seq_lens, lse, scores,
        query_weight if weighted else scores, score_scale if weighted else scores,  # unread
        first_scored, float(scale) * LOG2E, float(softcap) * LOG2E, float(k_scale), query.stride(0), query.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        lse.stride(0), lse.stride(1), scores.stride(0), scores.stride(1), scores.stride(2),
        key_cache.shape[1], GROUP=group, HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype), WEIGHTED=weighted, FRESH=fresh_new_slots,
        SOFTCAP=softcap > 0)
