"""H2O score accumulation in torch: the probabilities this step's queries gave each live key.

Runs in the worker process. The stock CPU kernel returns no probabilities, so they are
recomputed here against the same live keys (fp32), summed over each KV head's query group
and added into the layer's score buffer (ARCHITECTURE.md, "Score").
All cache views are indexed [block, offset, kv_head, ...] (see ``layout.py``).
"""
from __future__ import annotations

import torch

# Upper bound on one chunk's fp32 logits in prefill (elements): about 64 MiB.
_PREFILL_CHUNK_ELEMENTS = 16 * 1024 * 1024


def row_slots(block_table_row: torch.Tensor, kv_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of KV positions [0, kv_len) of one row, int64 [kv_len] each."""
    pos = torch.arange(kv_len)
    return block_table_row[pos // block_size].long(), pos % block_size


def accumulate_decode_scores(query: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor,
                             block_table: torch.Tensor, kv_seq_lens: torch.Tensor, scale: float) -> None:
    """One query per row, all rows at once (padded to the longest row).

    query: [R, num_heads, head_size]; block_table: [R, max_blocks]; kv_seq_lens: [R] int64.
    keys: [num_blocks, block_size, num_kv_heads, head_size]; scores: [num_blocks, block_size, num_kv_heads] fp32.
    """
    num_rows, num_heads, head_size = query.shape
    block_size, num_kv_heads = keys.shape[1], keys.shape[2]
    pos = torch.arange(int(kv_seq_lens.max()))
    valid = pos[None, :] < kv_seq_lens[:, None]                            # [R, L]
    blocks = block_table[:, pos // block_size].long()                      # [R, L]
    offsets = (pos % block_size).expand(num_rows, -1)
    k = keys[blocks, offsets].float()                                      # [R, L, Hkv, D]
    q = query.float().view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_size)
    logits = torch.einsum("rhgd,rlhd->rhgl", q, k).mul_(scale)
    logits.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).sum(dim=2).transpose(1, 2)              # [R, L, Hkv]
    scores[blocks[valid], offsets[valid]] += probs[valid]


def accumulate_prefill_scores(query: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor,
                              block_table_row: torch.Tensor, kv_seq_len: int, scale: float) -> None:
    """Several causal queries of one row (a prompt or a chunk of it), in query chunks.

    query: [q_len, num_heads, head_size], the row's last q_len KV positions; keys/scores as
    in ``accumulate_decode_scores``. Never holds more than one chunk of logits.
    """
    q_len, num_heads, head_size = query.shape
    block_size, num_kv_heads = keys.shape[1], keys.shape[2]
    blocks, offsets = row_slots(block_table_row, kv_seq_len, block_size)
    k = keys[blocks, offsets].float()                                      # [L, Hkv, D]
    q = query.float().view(q_len, num_kv_heads, num_heads // num_kv_heads, head_size)
    key_pos = torch.arange(kv_seq_len)
    total = torch.zeros(num_kv_heads, kv_seq_len)
    chunk = max(1, _PREFILL_CHUNK_ELEMENTS // (num_heads * kv_seq_len))
    for start in range(0, q_len, chunk):
        qc = q[start:start + chunk]
        query_pos = kv_seq_len - q_len + start + torch.arange(qc.shape[0])
        logits = torch.einsum("chgd,lhd->hgcl", qc, k).mul_(scale)
        logits.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        total += logits.softmax(dim=-1).sum(dim=(1, 2))
    scores[blocks, offsets] += total.T
