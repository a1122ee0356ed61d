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

import torch

# Upper bound on one prefill chunk's fp32 logits (elements): about 64 MiB.
_PREFILL_CHUNK_ELEMENTS = 16 * 1024 * 1024


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def accumulate_decode_scores(query: torch.Tensor, key_blocks: torch.Tensor, scores: torch.Tensor,
                             block_table: torch.Tensor, kv_seq_lens: torch.Tensor, scale: float) -> None:
    """One query per row, all rows at once (padded to the longest row's blocks).

    query: [R, num_heads, head_size]; block_table: [R, max_blocks]; kv_seq_lens: [R] int64.
    key_blocks: [num_blocks, num_kv_heads, head_size, block_size]; scores: [num_blocks,
    num_kv_heads, block_size] fp32.
    """
    num_rows, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_blocks.shape[1], key_blocks.shape[3]
    num_row_blocks = int((kv_seq_lens.max() + block_size - 1) // block_size)
    blocks = block_table[:, :num_row_blocks].long()                          # [R, nb]
    k = _fp32(key_blocks[blocks])                                            # [R, nb, Hkv, D, bs]
    q = _fp32(query).view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_size)
    logits = torch.einsum("rhgd,rnhdb->rhgnb", q, k).reshape(num_rows, num_kv_heads, -1, num_row_blocks * block_size)
    pos = torch.arange(num_row_blocks * block_size)
    logits.mul_(scale).masked_fill_((pos[None, :] >= kv_seq_lens[:, None])[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).sum(dim=2).view(num_rows, num_kv_heads, num_row_blocks, block_size)
    scores.index_add_(0, blocks.flatten(), probs.transpose(1, 2).reshape(-1, num_kv_heads, block_size))


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
