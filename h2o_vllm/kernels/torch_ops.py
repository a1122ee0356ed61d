"""Plain-torch twins of the Triton kernels in h2o_vllm.kernels, same names and arguments.

Runs wherever it is called (tests; any worker without Triton). Same layouts as the kernels:
key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_size], scores
[num_blocks, num_kv_heads, block_size] fp32, KV-space; block_table [num_rows, max_blocks] int32.
Clarity first: each row's keys are gathered through block_table and the row's whole probability
matrix is materialised; math in fp32. Tile-size keywords of the launchers are accepted and ignored.
"""
from __future__ import annotations

import torch


def _slots(block_table: torch.Tensor, row: int, kv_pos: torch.Tensor,
           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of KV positions kv_pos (any shape) of row ``row``."""
    return block_table[row].long()[kv_pos // block_size], kv_pos % block_size


def _row_keys(key_cache: torch.Tensor, block_table: torch.Tensor, row: int,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [kv_len, num_kv_heads, head_size] fp32 of a row, with their (block, offset)."""
    pos = torch.arange(kv_len, device=key_cache.device)
    blk, off = _slots(block_table, row, pos, key_cache.shape[1])
    return key_cache[blk, off].float(), blk, off


def _capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """The model's logit soft-cap (``softcap * tanh(logits / softcap)``; 0: none)."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def _with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """logits [kv_head, group, ..., keys] with each query head's sink logit appended as one
    more key (gpt-oss; ``sinks`` [num_q_heads], None: none)."""
    if sinks is None:
        return logits
    sink = sinks.float().view(logits.shape[0], logits.shape[1], *[1] * (logits.dim() - 2))
    return torch.cat([logits, sink.expand(*logits.shape[:-1], 1)], dim=-1)


def _row_probs(q: torch.Tensor, k: torch.Tensor, scale: float,
               weight: torch.Tensor | None = None, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax of the q_len last positions of a row, summed over queries and group
    (each query's probabilities times weight[query] when given; the sinks' share dropped).

    q: [q_len, num_q_heads, head_size] fp32; k: [kv_len, num_kv_heads, head_size] fp32;
    weight: [q_len] fp32. Returns [kv_len, num_kv_heads] fp32.
    """
    q_len, kv_len, num_kv_heads = q.shape[0], k.shape[0], k.shape[1]
    q = q.view(q_len, num_kv_heads, -1, q.shape[-1])  # [q_len, kv_head, group, head_size]
    logits = _capped(torch.einsum("qhgd,khd->hgqk", q, k) * scale, softcap)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
    visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
    logits = _with_sinks(logits.masked_fill(~visible, float("-inf")), sinks)
    probs = logits.softmax(dim=-1)[..., :kv_len]
    if weight is not None:
        probs = probs * weight[:, None]
    return probs.sum(dim=(1, 2)).T


def accumulate_decode_scores(query: torch.Tensor, key_cache: torch.Tensor,
                             block_table: torch.Tensor, kv_seq_lens: torch.Tensor,
                             scores: torch.Tensor, scale: float, *,
                             query_weight: torch.Tensor | None = None,
                             score_scale: torch.Tensor | None = None, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None, **_tiles: int) -> None:
    """scores[slot(row, t), kv_head] += sum over the group of softmax(scale * q . K^T)[t]
    (logits soft-capped first with softcap > 0; sinks [num_q_heads] in the denominator).

    query: [num_rows, num_q_heads, head_size], one decode query per row. Weighted (query_weight,
    score_scale [num_rows]): scores = score_scale[row] * scores + query_weight[row] * that sum.
    """
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    accumulate_prefill_scores(query, key_cache, block_table, query_start_loc, kv_seq_lens,
                              scores, scale, query_weight=query_weight, score_scale=score_scale,
                              softcap=softcap, sinks=sinks)


def prefill_lse(query: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                query_start_loc: torch.Tensor, kv_seq_lens: torch.Tensor, scale: float,
                softcap: float = 0.0, sinks: torch.Tensor | None = None, **_tiles: int) -> torch.Tensor:
    """lse [num_tokens, num_q_heads] fp32: ln(sum over visible keys of exp(scale * q . k)
    [+ exp(sinks[head])])."""
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    num_kv_heads = key_cache.shape[2]
    for row in range(query_start_loc.shape[0] - 1):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        kv_len, q_len = int(kv_seq_lens[row]), end - start
        k, _, _ = _row_keys(key_cache, block_table, row, kv_len)
        q = query[start:end].float().view(q_len, num_kv_heads, -1, query.shape[-1])
        logits = _capped(torch.einsum("qhgd,khd->qhgk", q, k) * scale, softcap)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, num_kv_heads, -1, 1).expand(q_len, -1, -1, 1)
            logits = torch.cat([logits, sink], dim=-1)
        lse[start:end] = logits.logsumexp(dim=-1).reshape(q_len, -1)
    return lse


def accumulate_prefill_scores(query: torch.Tensor, key_cache: torch.Tensor,
                              block_table: torch.Tensor, query_start_loc: torch.Tensor,
                              kv_seq_lens: torch.Tensor, scores: torch.Tensor, scale: float, *,
                              query_weight: torch.Tensor | None = None,
                              score_scale: torch.Tensor | None = None,
                              first_scored: torch.Tensor | None = None, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None, **_tiles: int) -> None:
    """scores[slot(row, t), kv_head] += sum over this step's queries of the row and over the
    group of the causal softmax(scale * q . K^T)[t]; kv_seq_lens includes this step's tokens.

    Weighted (query_weight [num_tokens] indexed like query, score_scale [num_rows]): each
    live t first becomes score_scale[row] * scores, then adds query_weight[q] * q's group sum.
    first_scored (weighted only, [num_rows]): a row's queries before it are left out."""
    if (query_weight is None) != (score_scale is None):
        raise ValueError("query_weight and score_scale go together: give both or neither")
    if first_scored is not None:
        query_weight = query_weight.clone()
        for row, first in enumerate(first_scored.tolist()):
            start = int(query_start_loc[row])
            query_weight[start:start + first] = 0.0
    for row in range(query_start_loc.shape[0] - 1):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        kv_len = int(kv_seq_lens[row])
        if end == start or kv_len == 0:
            continue
        k, blk, off = _row_keys(key_cache, block_table, row, kv_len)
        weight = None if query_weight is None else query_weight[start:end]
        col = _row_probs(query[start:end].float(), k, scale, weight, softcap, sinks)  # [kv_len, num_kv_heads]
        heads = torch.arange(k.shape[1], device=k.device)
        index = (blk[:, None], heads[None, :], off[:, None])
        if score_scale is not None:  # live slots of one row are distinct: no slot scaled twice
            scores[index] = scores[index] * score_scale[row]
        scores.index_put_(index, col, accumulate=True)


def compact_rows(key_cache: torch.Tensor, value_cache: torch.Tensor, scores: torch.Tensor,
                 block_table: torch.Tensor, rows: torch.Tensor, keep_idx: torch.Tensor,
                 targets: torch.Tensor | None = None, **_tiles: int) -> None:
    """K, V, scores at KV positions keep_idx[i, h, :targets[i]] of row rows[i] move to KV
    positions [0, targets[i]) of the same row, per KV head h, in place (targets None: keep_idx's
    width for every row; 0: the row moves nothing).

    keep_idx: [num_sel_rows, num_kv_heads, width] int64, ascending per (row, head) up to its target.
    """
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    width = keep_idx.shape[2]
    counts = [width] * rows.shape[0] if targets is None else targets.tolist()
    heads = torch.arange(num_kv_heads, device=key_cache.device)[:, None]  # [num_kv_heads, 1]
    for i, (row, target) in enumerate(zip(rows.tolist(), counts)):
        if target == 0:
            continue
        src_blk, src_off = _slots(block_table, row, keep_idx[i, :, :target], block_size)  # [heads, target]
        dst_blk, dst_off = _slots(block_table, row,
                                  torch.arange(target, device=key_cache.device), block_size)
        # Gather everything first (advanced indexing copies), then scatter: overlap is harmless.
        k = key_cache[src_blk, src_off, heads]  # [num_kv_heads, target, head_size]
        v = value_cache[src_blk, src_off, heads]
        s = scores[src_blk, heads, src_off]  # [num_kv_heads, target]
        key_cache[dst_blk[None, :], dst_off[None, :], heads] = k
        value_cache[dst_blk[None, :], dst_off[None, :], heads] = v
        scores[dst_blk[None, :], heads, dst_off[None, :]] = s
