"""Per-(layer, KV head) compaction of one row: the kept K, V and scores move to KV positions
[0, target) of the row's own blocks, order preserved (ARCHITECTURE.md, "Eviction").

Runs in the worker process. Each head keeps its own set, every head the same count.
"""
from __future__ import annotations

import torch

from h2o_vllm.policy import select_keep


def row_slots(block_table_row: torch.Tensor, kv_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of KV positions [0, kv_len) of one row, int64 [kv_len] each."""
    pos = torch.arange(kv_len)
    return block_table_row[pos // block_size].long(), pos % block_size


def compact_row(keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor,
                block_table_row: torch.Tensor, kv_len: int, target: int, heavy: int) -> torch.Tensor:
    """Keep ``heavy`` top-score tokens plus the ``target - heavy`` most recent ones.

    keys/values: [num_blocks, block_size, num_kv_heads, head_size]; scores: [num_blocks,
    block_size, num_kv_heads] fp32. ``target`` exceeds heavy + recent only when a recomputed
    request lands past a compaction point; the extra slots then go to the recent window.
    Returns the kept KV positions, [num_kv_heads, target].
    """
    block_size, num_kv_heads = keys.shape[1], keys.shape[2]
    blocks, offsets = row_slots(block_table_row, kv_len, block_size)
    keep = select_keep(scores[blocks, offsets].T, heavy, target - heavy)     # [Hkv, target]
    heads = torch.arange(num_kv_heads)[:, None]
    src = (blocks[keep], offsets[keep], heads)
    dst = (blocks[:target].expand(num_kv_heads, -1), offsets[:target].expand(num_kv_heads, -1), heads)
    # Gather everything before writing: sources and destinations overlap in place.
    kept_keys, kept_values, kept_scores = keys[src], values[src], scores[src]
    keys[dst], values[dst], scores[dst] = kept_keys, kept_values, kept_scores
    return keep
