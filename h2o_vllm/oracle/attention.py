"""fp32 attention over one layer's live tokens that also accumulates H2O scores (see Score).

Runs in the caller's process; plain torch, no vLLM.
"""
from __future__ import annotations

import torch

from h2o_vllm.oracle.cache import LayerCache

#: Queries per chunk: the probabilities held at once are [num_q_heads, chunk, kv_len] fp32.
DEFAULT_QUERY_CHUNK = 256


def attend_and_score(queries: torch.Tensor, cache: LayerCache, scaling: float,
                     query_chunk: int = DEFAULT_QUERY_CHUNK) -> torch.Tensor:
    """Attention of this step's queries over ``cache``, adding their probabilities to its scores.

    ``queries``: [num_q_heads, num_new, head_dim] fp32 (after RoPE), for the ``num_new`` tokens
    this step has just appended to ``cache`` (its last ``num_new`` slots). Query ``i`` sees every
    slot up to and including its own token (causal within the step). Each query's softmax runs
    over the tokens live when it runs; the probabilities, summed over the query heads of each KV
    group and over the queries, are added to ``cache.scores``. Returns [num_new, num_q_heads *
    head_dim] fp32 attention outputs.
    """
    num_q_heads, num_new, head_dim = queries.shape
    num_kv_heads = cache.keys.shape[0]
    group = num_q_heads // num_kv_heads
    kv_len = cache.kv_len
    num_old = kv_len - num_new
    # q: [num_kv_heads, group, num_new, head_dim]; query heads of one KV group are adjacent (HF order).
    q = queries.reshape(num_kv_heads, group, num_new, head_dim)
    keys, values, scores = cache.keys, cache.values, cache.scores
    outputs = []
    for start in range(0, num_new, query_chunk):
        end = min(start + query_chunk, num_new)
        visible = num_old + end  # slots [0, visible) are seen by at least one query of the chunk
        # logits: [num_kv_heads, group, chunk, visible] fp32
        logits = torch.matmul(q[:, :, start:end], keys[:, None, :visible].transpose(-1, -2)) * scaling
        if end - start > 1:
            rows = torch.arange(num_old + start, num_old + end).unsqueeze(-1)
            future = torch.arange(visible).unsqueeze(0) > rows  # [chunk, visible]
            logits = logits.masked_fill(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        scores[:, :visible] += probs.sum(dim=(1, 2))
        outputs.append(torch.matmul(probs, values[:, None, :visible]))  # [kv, group, chunk, head_dim]
    out = torch.cat(outputs, dim=2).reshape(num_q_heads, num_new, head_dim)
    return out.transpose(0, 1).reshape(num_new, num_q_heads * head_dim)
