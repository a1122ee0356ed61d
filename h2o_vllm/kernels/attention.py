"""Triton kernel of H2O's fused attention (worker process, CUDA path): ``h2o_attention``, the
paged causal attention of a whole vLLM batch (prefill chunks and decodes mixed) that also
produces H2O's scores, so the score work needs no second pass over K for decode rows.

Same cache layout, grid and tiling as vLLM's 2D ``kernel_unified_attention``
(``vllm/v1/attention/ops/triton_unified_attention.py``): one program per (block of BLOCK_Q
queries of one row, KV head), the GQA group's heads stacked into BLOCK_M rows, an online softmax
over KV tiles. What it adds, per row kind (docs/cuda.md, "Fused attention"):

- decode rows (one query; ``decode_offsets[row] >= 0``): the program is the only one of its
  (row, KV head), so it owns those score slots. While attending it writes each query head's
  logits (fp32, log2 units) to a scratch ``logits``; once the loop has the row's final
  log-sum-exp it reads them back, turns them into probabilities, sums them over the group and
  adds them into ``scores``. The scratch costs 4 bytes per key and query head, written once
  and read once, instead of K (2 * head_size bytes per key and KV head) read again.
- other rows (prefill chunks): several programs share a row's keys, so none owns a score slot;
  the kernel writes each (query, head)'s log-sum-exp to ``lse`` and
  ``prefill_scores.accumulate_prefill_scores_from_lse`` adds the probabilities in one pass over
  K (the separate LSE pass of the unfused path is gone).

Logit soft-capping (``softcap``, Gemma 2) applies to the logits before the softmax, as vLLM's
kernel does; the scores are the capped softmax. Sink logits (``sinks``, gpt-oss: one per query
head) join each softmax's denominator as in vLLM's kernel, which starts its running max and sum
from them: the output and the scores are the model's, and the sink's share is nobody's score.
Not supported (refused before an engine loads, see ``h2o_vllm.frontend.conflicts``, or by the
caller): sliding window, ALiBi, per-token-head quantised caches, non-causal rows.
Math: logits, softmax and the accumulator in fp32; Q.K and P.V as vLLM's kernel does them (the
query dtype's tensor-core dot, P cast to V's dtype), IEEE fp32 dots for fp32 queries. An fp8
cache (per-tensor scales) is dequantised on load, into the query's dtype, as vLLM's kernel does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_vllm.kernels import (FP8_CACHE_DTYPES, check_lens, check_paged, check_query, check_sinks,
                              check_tile, check_weights)
from h2o_vllm.kernels.tiles import LOG2E, soft_cap, softmax_start


@triton.jit
def _find_row(query_start_loc, q_block, num_rows, BLOCK_Q: tl.constexpr):
    """The row whose query blocks contain global block q_block (vLLM's grid: row r's blocks
    start at query_start_loc[r] // BLOCK_Q + r, an upper bound that leaves no row out)."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 cache: exact products, as the reference score kernels
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def kv_tile(key_cache, value_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size,
            k_scale, v_scale, dtype, FP8: tl.constexpr):
    """K [HEAD_PAD, TILE] and V [TILE, HEAD_PAD] of one KV head at positions offs_n of a row
    (bt_row: its block-table entries); an fp8 cache read as vLLM's unified_attention reads it,
    ``fp8 * scale`` in the query's dtype."""
    blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    slot = offs_n % block_size
    k = tl.load(key_cache + blk[None, :] * stride_kb + slot[None, :] * stride_ks
                + kv_head * stride_kh + offs_d[:, None],
                mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    v = tl.load(value_cache + blk[:, None] * stride_vb + slot[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(dtype)
        v = (v.to(tl.float32) * v_scale).to(dtype)
    return k, v


@triton.jit
def softmax_tile(m_i, l_i, acc, s, v, IEEE: tl.constexpr):
    """One KV tile of the online softmax: logits s (log2 units, masked at -inf) into the
    running max, sum and unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # padding lanes: no NaN
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def h2o_attention_kernel(
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        lse, logits, decode_offsets, scores, query_weight, score_scale, sinks, scale_log2, cap_log2,
        k_scale, v_scale, num_rows,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_bt, stride_lt, stride_lh, stride_gh,
        stride_sb, stride_sh, stride_ss, block_size,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE: tl.constexpr,
        SCORE_TILE: tl.constexpr, IEEE: tl.constexpr, SCORES: tl.constexpr,
        WEIGHTED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, FP8: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = _find_row(query_start_loc, q_block, num_rows, BLOCK_Q)
    q_start = tl.load(query_start_loc + row)
    q_len = tl.load(query_start_loc + row + 1) - q_start
    q_local = q_block - (q_start // BLOCK_Q + row)
    if q_local * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(seq_lens + row)
    ctx_len = kv_len - q_len  # keys written before this step (earlier chunks, decoded tokens)
    offs_m = tl.arange(0, BLOCK_M)  # (query j, group head hh) = j * GROUP + hh
    q_pos = q_local * BLOCK_Q + offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    # BLOCK_M may exceed BLOCK_Q * GROUP (GROUP not a power of two): those lanes belong to the
    # next block's first query, which that block computes.
    m_mask = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    tok = (q_start + q_pos).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    q = tl.load(query + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    bt_row = block_table + row.to(tl.int64) * stride_bt
    if SCORES:
        dec_off = tl.load(decode_offsets + row)
        keep_logits = dec_off >= 0  # uniform per program: a branch, not a mask
        lg_row = logits + q_head.to(tl.int64)[:, None] * stride_gh + dec_off
    m_i, l_i = softmax_start(sinks, q_head, m_mask, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Causal: no key of this block is past its last query.
    kv_end = ctx_len + tl.minimum((q_local + 1) * BLOCK_Q, q_len)
    for n0 in range(0, kv_end, TILE):
        offs_n = n0 + tl.arange(0, TILE)
        n_mask = offs_n < kv_end
        k, v = kv_tile(key_cache, value_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       block_size, k_scale, v_scale, q.dtype, FP8)
        s = soft_cap(_dot(q, k, IEEE) * scale_log2, cap_log2, SOFTCAP)
        visible = m_mask[:, None] & n_mask[None, :] & (offs_n[None, :] <= (ctx_len + q_pos)[:, None])
        s = tl.where(visible, s, float("-inf"))
        if SCORES:
            if keep_logits:  # decode rows keep their logits (one query: n_mask = live keys)
                tl.store(lg_row + offs_n[None, :], s, mask=m_mask[:, None] & n_mask[None, :])
        m_i, l_i, acc = softmax_tile(m_i, l_i, acc, s, v, IEEE)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l_i >= 1 on live lanes (the max term, a key's
    # or the sink's, is exp2(0))
    tl.store(out + tok[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             (acc / l_safe[:, None]).to(out.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    if SCORES:
        lse2 = m_i + tl.log2(l_safe)  # log2 units; padding lanes: 0, and their logits are -inf
        if keep_logits:
            _decode_scores(lg_row, lse2, m_mask, bt_row, kv_len, kv_head, scores, query_weight,
                           score_scale, row, q_start, stride_sb, stride_sh, stride_ss,
                           block_size, SCORE_TILE, WEIGHTED)
        else:  # natural log, the layout accumulate_prefill_scores_from_lse reads
            tl.store(lse + tok * stride_lt + q_head * stride_lh, lse2 * 0.6931471805599453,
                     mask=m_mask)


@triton.jit
def _decode_scores(lg_row, lse2, m_mask, bt_row, kv_len, kv_head, scores, query_weight,
                   score_scale, row, token, stride_sb, stride_sh, stride_ss, block_size,
                   TILE: tl.constexpr, WEIGHTED: tl.constexpr):
    """A decode row's probabilities from its stored logits and final LSE, summed over the
    group, added at the row's slots of this KV head. TILE can be wider than the attention's:
    no K or V here, only [BLOCK_M, TILE] fp32 logits, so fewer, longer iterations hide the
    latency of this loop's dependent loads and stores."""
    # The logits were stored by other threads of this program: order those stores first.
    tl.debug_barrier()
    if WEIGHTED:
        weight = tl.load(query_weight + token)
        old_scale = tl.load(score_scale + row)
    for n0 in range(0, kv_len, TILE):
        offs_n = n0 + tl.arange(0, TILE)
        n_mask = offs_n < kv_len
        s = tl.load(lg_row + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :],
                    other=float("-inf"))
        col = tl.sum(tl.exp2(s - lse2[:, None]), axis=0)
        blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        ptr = scores + blk * stride_sb + kv_head * stride_sh + (offs_n % block_size) * stride_ss
        # The row's new slot (its last position) starts at 0: its old score is not read.
        old = tl.load(ptr, mask=n_mask & (offs_n < kv_len - 1), other=0.0)
        if WEIGHTED:
            tl.store(ptr, old * old_scale + weight * col, mask=n_mask)
        else:
            tl.store(ptr, old + col, mask=n_mask)


def block_m_of(group: int) -> int:
    """Query-head rows per program, vLLM's choice: 16, or the group's power of two above 16."""
    return 16 if group <= 16 else triton.next_power_of_2(group)


def h2o_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  out: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, *, scores: torch.Tensor | None = None,
                  decode_offsets: torch.Tensor | None = None, num_decode_keys: int = 0,
                  query_weight: torch.Tensor | None = None,
                  score_scale: torch.Tensor | None = None,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None,
                  k_scale: float = 1.0, v_scale: float = 1.0, tile_n: int = 32,
                  score_tile: int = 128) -> torch.Tensor | None:
    """out = causal paged attention of the batch; with ``scores``, also H2O's scores.

    query, out: [num_tokens, num_q_heads, head_size] packed by query_start_loc [num_rows + 1]
    int32; seq_lens [num_rows] int32 keys of each row (this step's included, already in the
    cache); block_table [>= num_rows, max_blocks] int32; caches as ``h2o_vllm.kernels``.

    With scores (fp32 [num_blocks, num_kv_heads, block_size]): decode_offsets [num_rows] int64
    marks the decode rows (one query) with the start of their keys in the logits scratch
    (``decode_logit_offsets``; num_decode_keys = their kv lengths' sum), -1 elsewhere. A decode
    row's scores become scores + sum over the group of softmax (weighted as in
    ``accumulate_decode_scores``: score_scale [num_rows] by row, query_weight [num_tokens] by
    token). Returns lse [num_tokens, num_q_heads] fp32 (natural log, causal) for the other
    rows, whose scores the caller adds with ``accumulate_prefill_scores_from_lse``; entries of
    decode rows are not written. Without scores: plain attention, returns None.
    softcap > 0: the logits are soft-capped; sinks [num_q_heads] (any float dtype): each query
    head's sink logit joins its softmax's denominator (the lse includes it).
    An fp8 cache (``kernels.FP8_CACHE_DTYPES``) is read as ``fp8 * k_scale`` / ``fp8 * v_scale``
    in the query's dtype, as vLLM's Triton attention reads it.
    """
    _, block_size, num_kv_heads, head_size = check_paged("key_cache", key_cache, block_table,
                                                         scores)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache must match key_cache {tuple(key_cache.shape)} "
                         f"{key_cache.dtype}, got {tuple(value_cache.shape)} {value_cache.dtype}")
    if value_cache.stride(-1) != 1:
        raise ValueError("value_cache must be contiguous in head_size")
    group = check_query(query, key_cache, num_kv_heads)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, contiguous in "
                         f"head_size; got {tuple(out.shape)} {out.dtype}")
    check_tile(tile_n=tile_n, score_tile=score_tile)
    with_sinks = check_sinks(sinks, query.shape[1], key_cache.device)
    num_rows = query_start_loc.shape[0] - 1
    check_lens("query_start_loc", query_start_loc, num_rows + 1, key_cache.device)
    check_lens("seq_lens", seq_lens, num_rows, key_cache.device)
    if block_table.shape[0] < num_rows:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, need {num_rows}")
    weighted = False
    lse = logits = None
    if scores is not None:
        weighted = check_weights(query_weight, 0, score_scale, num_rows, key_cache.device)
        if (decode_offsets is None or decode_offsets.shape != (num_rows,)
                or decode_offsets.dtype != torch.int64):
            raise ValueError(f"with scores, decode_offsets must be [{num_rows}] int64")
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        logits = torch.empty(query.shape[1], max(num_decode_keys, 1), dtype=torch.float32,
                             device=query.device)
    if num_rows == 0 or query.shape[0] == 0:
        return lse
    block_m = block_m_of(group)
    block_q = block_m // group
    grid = (query.shape[0] // block_q + num_rows, num_kv_heads)  # vLLM's bound, no sync
    unused = out  # pointer arguments a compiled variant never reads
    h2o_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        unused if lse is None else lse, unused if logits is None else logits,
        unused if decode_offsets is None else decode_offsets,
        unused if scores is None else scores,
        query_weight if weighted else unused, score_scale if weighted else unused,
        sinks if with_sinks else unused, float(scale) * LOG2E, float(softcap) * LOG2E,
        float(k_scale), float(v_scale), num_rows,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        0 if lse is None else lse.stride(0), 0 if lse is None else lse.stride(1),
        0 if logits is None else logits.stride(0),
        *(scores.stride() if scores is not None else (0, 0, 0)), block_size,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)), TILE=tile_n, SCORE_TILE=score_tile,
        IEEE=query.dtype == torch.float32, SCORES=scores is not None, WEIGHTED=weighted,
        SOFTCAP=softcap > 0, SINKS=with_sinks, FP8=key_cache.dtype in FP8_CACHE_DTYPES)
    return lse


def decode_logit_offsets(query_lens: torch.Tensor,
                         kv_seq_lens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(decode_offsets [num_rows] int64, num_decode_keys) for h2o_attention, from the step's
    CPU lengths: decode rows (one query) get consecutive ranges of the logits scratch, sized by
    their kv length; the others -1."""
    decode = query_lens == 1
    lens = torch.where(decode, kv_seq_lens, 0).to(torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return torch.where(decode, starts, -1), int(lens.sum())
