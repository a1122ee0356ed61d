"""H2O score accumulation of decode rows in torch: the probabilities each row's one query gave
each live key. (Rows with several queries: ``prefill.py``.)

Runs in the worker process. The stock CPU kernel returns no probabilities, so a decode row's
are recomputed here against the same live keys (fp32), summed over each KV head's query group
and added into the layer's score buffer (docs/semantics.md, "Score").
Keys are read whole blocks at a time in the cache's own layout (``layout.py``: K transposed,
[num_blocks, num_kv_heads, head_size, block_size]) and scores are added per block with
``index_add_``: no per-token gathers. Positions past a row's length get probability exactly
0, so the stale block-table entries they come from are left unchanged.
Weighted steps (score scales, query weights; ``StepPlan.score_scale``): a row's live blocks
are scaled by its factor before the add. Rows never share blocks (a prefix-cache hit is copied
into the row's own blocks, docs/prefix-caching.md), so this touches no other row; slots past the row's length in its last block are stale
and are zeroed before their next use, so scaling them is harmless.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

def as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def soft_cap_(logits: torch.Tensor, softcap: float) -> None:
    """The model's logit soft-cap (Gemma 2: ``softcap * tanh(logits / softcap)``), in place,
    before the softmax as vLLM's kernels do; 0: none."""
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)


@dataclass(frozen=True)
class DecodeIndex:
    """Where rows of decode queries read their keys; built once per step, read by every layer."""
    blocks: torch.Tensor   # int64 [R * nb]: each row's first nb blocks, row-major
    # fp32 [R, 1, T, 1, nb * block_size], added to the logits: -inf where the key position is
    # past the kv length query t of the row saw, else 0 (T = 1: this step's one query per row;
    # ``deferred.py``: a row's waiting queries). An add, where a broadcast masked_fill is slow.
    bias: torch.Tensor
    # Weighted steps only (else None): the blocks holding each row's live tokens, and the row
    # of each. ``blocks`` cannot be scaled: a short row's entries past its length are stale
    # and may name another row's blocks (adding 0 there is harmless, scaling is not).
    live_blocks: torch.Tensor | None = None  # int64 [sum of each row's block count]
    live_rows: torch.Tensor | None = None    # int64, same length: index into the R rows


def decode_index(block_table: torch.Tensor, kv_seq_lens: torch.Tensor, block_size: int,
                 weighted: bool = False) -> DecodeIndex:
    """block_table: [R, max_blocks]; kv_seq_lens: [R] int64 (one query per row), or [R, T]:
    the kv length each of a row's T queries saw, the last the row's longest."""
    lens = kv_seq_lens if kv_seq_lens.dim() == 2 else kv_seq_lens[:, None]
    row_lens = lens.max(dim=1).values
    num_row_blocks = int((row_lens.max() + block_size - 1) // block_size)
    pos = torch.arange(num_row_blocks * block_size)
    blocks = block_table[:, :num_row_blocks].long()
    live_blocks = live_rows = None
    if weighted:
        live = torch.arange(num_row_blocks)[None, :] * block_size < row_lens[:, None]
        live_blocks = blocks[live]
        live_rows = torch.arange(blocks.shape[0])[:, None].expand_as(blocks)[live]
    past = (pos[None, None, :] >= lens[:, :, None])[:, None, :, None, :]
    return DecodeIndex(blocks=blocks.flatten(),
                       bias=torch.zeros(past.shape, dtype=torch.float32).masked_fill_(past, float("-inf")),
                       live_blocks=live_blocks, live_rows=live_rows)


def scale_blocks(scores: torch.Tensor, blocks: torch.Tensor, factor: torch.Tensor) -> None:
    """scores[blocks[i]] *= factor[i] (blocks distinct), in place; scores may be a strided view."""
    scores.index_copy_(0, blocks, scores.index_select(0, blocks) * factor[:, None, None])


def accumulate_decode_scores(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                             block_table: torch.Tensor, kv_seq_lens: torch.Tensor, scale: float,
                             query_weight: torch.Tensor | None = None,
                             score_scale: torch.Tensor | None = None, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None) -> None:
    """One query per row, all rows at once. query: [R, num_heads, head_size]; block_table:
    [R, max_blocks]; kv_seq_lens: [R] int64. key_blocks: [num_blocks, num_kv_heads,
    head_size, block_size]; scores: [num_blocks, num_kv_heads, block_size] fp32.
    Weighted (both or neither, [R] fp32): scores = score_scale[row] * scores
    + query_weight[row] * probs. softcap > 0: the logits are soft-capped first; sinks
    [num_heads] (gpt-oss): each query head's sink logit is in its softmax's denominator.
    """
    index = decode_index(block_table, kv_seq_lens, key_blocks.shape[3], score_scale is not None)
    accumulate_decode_scores_at(query, key_blocks, scores, index, scale, query_weight, score_scale,
                                softcap, sinks)


def accumulate_decode_scores_at(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                                index: DecodeIndex, scale: float,
                                query_weight: torch.Tensor | None = None,
                                score_scale: torch.Tensor | None = None, softcap: float = 0.0,
                                sinks: torch.Tensor | None = None) -> None:
    """``accumulate_decode_scores`` with the step's ``DecodeIndex`` already built (with
    ``weighted=True`` when score_scale is given)."""
    accumulate_row_queries(query[:, None], key_blocks, scores, index, scale,
                           None if query_weight is None else query_weight[:, None], score_scale,
                           softcap, sinks)


def accumulate_row_queries(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                           index: DecodeIndex, scale: float, weights: torch.Tensor | None = None,
                           factor: torch.Tensor | None = None, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> None:
    """T queries per row, each over the keys its kv length allows (``index.bias``):
    scores = factor[row] * scores + sum_t weights[row, t] * probs_t (weights None: all 1;
    factor needs ``decode_index(..., weighted=True)``). query: [R, T, num_heads, head_size].

    One query per row (any number of rows): each (row, block, KV head) key tile is already a
    contiguous [head_size, block_size] matrix in the cache, so one broadcast matmul takes K
    as gathered. Several queries per row (``deferred.py``: few rows flush at a time): K is
    gathered as [KV head, head_size, keys] and each row is one GEMM of its T x group queries
    against all its keys, landing in the softmax's layout; per-block tiles there would be
    GEMMs of 32 columns and a transposed copy of the logits (1.3-1.7x slower at T = 16).
    """
    num_rows, num_queries, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_blocks.shape[1], key_blocks.shape[3]
    group = num_heads // num_kv_heads
    num_row_blocks = index.blocks.shape[0] // num_rows
    num_keys = num_row_blocks * block_size
    # Scaled before the product, as in prefill.py: one small multiply instead of one over the logits.
    q = (as_fp32(query) * scale).view(num_rows, num_queries, num_kv_heads, group, head_size)
    if num_queries == 1:
        k = as_fp32(key_blocks.index_select(0, index.blocks))
        k = k.view(num_rows, num_row_blocks, num_kv_heads, head_size, block_size)
        logits = torch.matmul(q.view(num_rows, 1, num_kv_heads, group, head_size), k)  # [R, nb, Hkv, G, bs]
        logits = logits.permute(0, 2, 3, 1, 4).reshape(num_rows, num_kv_heads, 1, group, num_keys)
    else:
        k = as_fp32(key_blocks.permute(1, 2, 0, 3).index_select(2, index.blocks))
        k = k.view(num_kv_heads, head_size, num_rows, num_keys)
        q = q.transpose(1, 2).reshape(num_rows, num_kv_heads, num_queries * group, head_size)
        logits = q.new_empty(num_rows, num_kv_heads, num_queries * group, num_keys)
        for row in range(num_rows):
            torch.matmul(q[row], k[:, :, row], out=logits[row])
        logits = logits.view(num_rows, num_kv_heads, num_queries, group, num_keys)
    soft_cap_(logits, softcap)
    logits.add_(index.bias)
    if sinks is None:
        probs = logits.softmax(dim=-1)
    else:  # the sink is one more entry of each softmax, and nobody's score
        sink = as_fp32(sinks).view(1, num_kv_heads, 1, group, 1).expand(num_rows, -1, num_queries, -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    probs = probs.sum(dim=3)                                        # [R, Hkv, T, nb * bs]
    if weights is None:
        probs = probs.sum(dim=2)
    else:
        probs = torch.matmul(weights[:, None, None, :], probs).squeeze(2)
    probs = probs.view(num_rows, num_kv_heads, num_row_blocks, block_size)
    if factor is not None:
        if index.live_blocks is None:
            raise ValueError("a weighted decode step needs decode_index(..., weighted=True)")
        scale_blocks(scores, index.live_blocks, factor[index.live_rows])
    scores.index_add_(0, index.blocks, probs.transpose(1, 2).reshape(-1, num_kv_heads, block_size))
