"""Causal attention of one row's queries and their H2O scores from one softmax, in torch.

Runs in the worker process. The stock CPU kernel returns no probabilities, and recomputing
them after it doubled a long prompt's time to first token (issue 24; docs/results.md, "Prefill cost").
Here each query tile's probabilities serve both the attention output and the scores, so the
prefill rows pay one attention, not two: the CPU path runs this instead of vLLM's kernel for
them (``CPUOps.attend``), and, without ``out``, as the score pass alone (``CPUOps.accumulate``).

Work per tile of queries: their logits against the keys up to the tile's last position only
(the fully masked tiles right of the diagonal are never computed), exp once, then
  out    = (P_unnormalised @ V) / row_sum
  scores += (weight / row_sum) @ P_unnormalised
so P is never divided out in full and the column sums are a matrix-vector product per head. Queries
of weight 0 (outside an observation window, or masked by prefix caching) add nothing to the
scores: a score-only pass skips them.
"""
from __future__ import annotations

import torch

from h2o_vllm.worker.cpu.scores import as_fp32, scale_blocks, soft_cap_

#: Queries per tile. Small tiles waste less of the diagonal tile and keep a tile's
#: probabilities ([kv heads, tile * group, keys] fp32) in cache. In a one-off probe of a
#: 2,048-token row (SmolLM2's 3 KV heads x 3, head 64, 30 layers, 2 cores; not committed)
#: tiles of 64 / 128 / 256 / 512 took 4.06 / 4.05 / 4.73 / 6.43 s.
TILE = 128


def prefill_attention(query: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor | None,
                      scores: torch.Tensor, blocks: torch.Tensor, kv_seq_len: int, scale: float,
                      out: torch.Tensor | None = None, query_weight: torch.Tensor | None = None,
                      score_scale: torch.Tensor | None = None, first_scored: int = 0,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None,
                      v_scale: float = 1.0) -> None:
    """One row: ``query`` [q_len, num_heads, head_size] sits at the row's last q_len KV
    positions and attends causally over its first ``kv_seq_len`` keys.

    key_blocks: [num_blocks, num_kv_heads, head_size, block_size] (the CPU cache's K);
    value_blocks: [num_blocks, block_size, num_kv_heads, head_size] (may be None without out);
    scores: [num_blocks, num_kv_heads, block_size] fp32; blocks: the row's block table (its
    first cdiv(kv_seq_len, block_size) entries are read). out: [q_len, num_heads, head_size]
    or None for the scores alone. Weighted (both or neither): query_weight [q_len] fp32,
    score_scale the row's factor (0-dim): scores = score_scale * scores + sum_i w_i * p_i.
    first_scored: queries before it weigh 0 (``H2OStep.prefill_first_scored``); without out
    they are not computed at all. softcap > 0: the logits are soft-capped before the softmax
    (``softcap * tanh(logits / softcap)``, Gemma 2), as vLLM's kernels do. sinks [num_heads]
    (gpt-oss): each query head's sink logit joins its softmax's max and denominator, as in
    vLLM's kernels; it owns no key, so its share is in neither the output nor the scores.
    An fp8 cache: key_blocks / value_blocks typed fp8, ``scale`` with the key scale folded in,
    ``v_scale`` the value scale (applied to the output).
    """
    q_len, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_blocks.shape[1], key_blocks.shape[3]
    group = num_heads // num_kv_heads
    num_row_blocks = -(-kv_seq_len // block_size)
    blocks = blocks[:num_row_blocks].long()
    first = kv_seq_len - q_len  # KV position of the row's first query
    start = 0 if out is not None else first_scored
    total = torch.zeros(num_kv_heads, num_row_blocks * block_size)
    if start < q_len:
        keys = as_fp32(key_blocks[blocks]).permute(1, 2, 0, 3).reshape(num_kv_heads, head_size, -1)
        values = None if out is None else (
            as_fp32(value_blocks[blocks]).permute(2, 0, 1, 3).reshape(num_kv_heads, -1, head_size))
        q = (as_fp32(query) * scale).view(q_len, num_kv_heads, group, head_size).transpose(0, 1)
        causal = torch.ones(TILE, TILE, dtype=torch.bool).triu_(1)[None, :, None, :]
        sink = None if sinks is None else as_fp32(sinks).view(num_kv_heads, 1, group)
        for s in range(start, q_len, TILE):
            e = min(q_len, s + TILE)
            n, end = e - s, first + e  # queries in the tile, keys they reach
            probs = torch.matmul(q[:, s:e].reshape(num_kv_heads, n * group, head_size),
                                 keys[:, :, :end])                       # [Hkv, n * G, end]
            soft_cap_(probs, softcap)
            diagonal = probs.view(num_kv_heads, n, group, end)[..., end - n:]
            diagonal.masked_fill_(causal[:, :n, :, :n], float("-inf"))
            if sink is None:
                probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
                inv_sum = probs.sum(dim=-1, keepdim=True).reciprocal_()  # [Hkv, n * G, 1]
            else:
                tile_sink = sink.expand(num_kv_heads, n, group).reshape(num_kv_heads, n * group, 1)
                top = torch.maximum(probs.amax(dim=-1, keepdim=True), tile_sink)
                probs.sub_(top).exp_()
                inv_sum = probs.sum(dim=-1, keepdim=True).add_((tile_sink - top).exp_()).reciprocal_()
            if out is not None:
                tile_out = torch.matmul(probs, values[:, :end]).mul_(inv_sum)
                if v_scale != 1.0:
                    tile_out.mul_(v_scale)
                out[s:e] = tile_out.view(num_kv_heads, n, group, head_size).transpose(0, 1).reshape(
                    n, num_heads, head_size).to(out.dtype)
            if e <= first_scored:
                continue
            weight = inv_sum.view(num_kv_heads, n, group)
            if query_weight is not None:
                weight = weight * query_weight[s:e, None]
            weight = weight.reshape(num_kv_heads, n * group)
            # One product per head: a batched one rounds differently with the batch size, and
            # a tensor-parallel rank holding some heads must score what the whole model does.
            for head in range(num_kv_heads):
                total[head, :end] += weight[head] @ probs[head]
    if score_scale is not None:  # blocks: this row's live blocks, each once
        scale_blocks(scores, blocks, score_scale.expand(num_row_blocks))
    scores.index_add_(0, blocks, total.view(num_kv_heads, num_row_blocks, block_size).transpose(0, 1))
