"""H2O score accumulation in torch: the probabilities this step's queries gave each live key.

Runs in the worker process. The stock CPU kernel returns no probabilities, so they are
recomputed here against the same live keys (fp32), summed over each KV head's query group
and added into the layer's score buffer (ARCHITECTURE.md, "Score").
Keys are read whole blocks at a time in the cache's own layout (``layout.py``: K transposed,
[num_blocks, num_kv_heads, head_size, block_size]) and scores are added per block with
``index_add_``: no per-token gathers. Positions past a row's length get probability exactly
0, so the stale block-table entries they come from are left unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Upper bound on one prefill chunk's fp32 logits (elements): about 64 MiB.
_PREFILL_CHUNK_ELEMENTS = 16 * 1024 * 1024


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


@dataclass(frozen=True)
class DecodeIndex:
    """Where a step's decode rows read their keys; the same for every layer, built once."""
    blocks: torch.Tensor   # int64 [R * nb]: each row's first nb blocks, row-major
    padding: torch.Tensor  # bool [R, 1, 1, nb * block_size]: True past the row's length


def decode_index(block_table: torch.Tensor, kv_seq_lens: torch.Tensor, block_size: int) -> DecodeIndex:
    """block_table: [R, max_blocks]; kv_seq_lens: [R] int64 (padded to the longest row)."""
    num_row_blocks = int((kv_seq_lens.max() + block_size - 1) // block_size)
    pos = torch.arange(num_row_blocks * block_size)
    return DecodeIndex(blocks=block_table[:, :num_row_blocks].long().flatten(),
                       padding=(pos[None, :] >= kv_seq_lens[:, None])[:, None, None, :])


def accumulate_decode_scores(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                             block_table: torch.Tensor, kv_seq_lens: torch.Tensor, scale: float) -> None:
    """One query per row, all rows at once. query: [R, num_heads, head_size]; block_table:
    [R, max_blocks]; kv_seq_lens: [R] int64. key_blocks: [num_blocks, num_kv_heads,
    head_size, block_size]; scores: [num_blocks, num_kv_heads, block_size] fp32.
    """
    index = decode_index(block_table, kv_seq_lens, key_blocks.shape[3])
    accumulate_decode_scores_at(query, key_blocks, scores, index, scale)


def accumulate_decode_scores_at(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                                index: DecodeIndex, scale: float) -> None:
    """``accumulate_decode_scores`` with the step's ``DecodeIndex`` already built.

    Each (row, block, KV head) key tile is already a contiguous [head_size, block_size]
    matrix in the cache, so one broadcast matmul takes it as is: no transposed copy of K.
    """
    num_rows, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_blocks.shape[1], key_blocks.shape[3]
    num_row_blocks = index.blocks.shape[0] // num_rows
    k = _fp32(key_blocks.index_select(0, index.blocks))
    k = k.view(num_rows, num_row_blocks, num_kv_heads, head_size, block_size)
    q = _fp32(query).view(num_rows, 1, num_kv_heads, num_heads // num_kv_heads, head_size)
    logits = torch.matmul(q, k)                                     # [R, nb, Hkv, G, bs]
    logits = logits.permute(0, 2, 3, 1, 4).reshape(num_rows, num_kv_heads, -1, num_row_blocks * block_size)
    logits.mul_(scale).masked_fill_(index.padding, float("-inf"))
    probs = logits.softmax(dim=-1).sum(dim=2).view(num_rows, num_kv_heads, num_row_blocks, block_size)
    scores.index_add_(0, index.blocks, probs.transpose(1, 2).reshape(-1, num_kv_heads, block_size))


def accumulate_prefill_scores(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                              block_table_row: torch.Tensor, kv_seq_len: int, scale: float) -> None:
    """Several causal queries of one row (a prompt or a chunk of it), in query chunks.

    query: [q_len, num_heads, head_size], the row's last q_len KV positions; key_blocks and
    scores as in ``accumulate_decode_scores``. Never holds more than one chunk of logits.
    """
    q_len, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_blocks.shape[1], key_blocks.shape[3]
    num_row_blocks = (kv_seq_len + block_size - 1) // block_size
    blocks = block_table_row[:num_row_blocks].long()
    k = _fp32(key_blocks[blocks]).permute(1, 2, 0, 3).reshape(num_kv_heads, head_size, -1)  # [Hkv, D, L']
    q = _fp32(query).view(q_len, num_kv_heads, num_heads // num_kv_heads, head_size)
    key_pos = torch.arange(k.shape[-1])
    total = torch.zeros(num_kv_heads, k.shape[-1])
    chunk = max(1, _PREFILL_CHUNK_ELEMENTS // (num_heads * k.shape[-1]))
    for start in range(0, q_len, chunk):
        qc = q[start:start + chunk]
        query_pos = kv_seq_len - q_len + start + torch.arange(qc.shape[0])
        logits = torch.einsum("chgd,hdl->hgcl", qc, k).mul_(scale)
        logits.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        total += logits.softmax(dim=-1).sum(dim=(1, 2))
    scores.index_add_(0, blocks, total.view(num_kv_heads, num_row_blocks, block_size).transpose(0, 1))
