"""fp32 attention over one layer's live tokens that also accumulates H2O scores (see Score).

Runs in the caller's process; plain torch, no vLLM.
"""
from __future__ import annotations

import torch

from h2o_vllm.oracle.cache import LayerCache

#: Queries per chunk: the probabilities held at once are [num_q_heads, chunk, kv_len] fp32.
DEFAULT_QUERY_CHUNK = 256


def query_coefficients(num_new: int, query_scale: float = 1.0,
                       weights: torch.Tensor | None = None) -> torch.Tensor | None:
    """[num_new] fp32 factor of each query's probabilities in this step's score update, or
    None for the paper's plain sum (``query_scale == 1`` and no weights: every factor is 1).

    Queries ``a..b`` run in order, each doing ``s <- query_scale * s + w_i * p_i``; so query
    ``i`` adds ``query_scale ** (b - i) * w_i * p_i`` and the scores from before the step are
    scaled by ``query_scale ** num_new`` once. Computed in fp64, rounded to fp32 once.
    """
    if query_scale == 1.0 and weights is None:
        return None
    coef = torch.full((num_new,), float(query_scale), dtype=torch.float64) ** torch.arange(
        num_new - 1, -1, -1, dtype=torch.float64)
    if weights is not None:
        coef = coef * weights.to(torch.float64)
    return coef.float()


def attend_and_score(queries: torch.Tensor, cache: LayerCache, scaling: float,
                     query_chunk: int = DEFAULT_QUERY_CHUNK, *, query_scale: float = 1.0,
                     weights: torch.Tensor | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this step's queries over ``cache``, adding their probabilities to its scores.

    ``queries``: [num_q_heads, num_new, head_dim] fp32 (after RoPE), for the ``num_new`` tokens
    this step has just appended to ``cache`` (its last ``num_new`` slots). Query ``i`` sees every
    slot up to and including its own token (causal within the step). Each query's softmax runs
    over the tokens live when it runs; the probabilities, summed over the query heads of each KV
    group, go into ``cache.scores``. Returns [num_new, num_q_heads * head_dim] fp32 outputs.

    Score update, queries taken in order: ``s <- query_scale * s + weights[i] * p_i`` for each
    query ``i`` (the score modes' rules: ``SequenceState.query_scale``, ``oracle.cache.query_weight``).
    With ``query_scale == 1`` and ``weights=None`` (the paper's H2O) this is the plain sum and
    runs no scaling at all; otherwise the scores from before the step are scaled by
    ``query_scale ** num_new`` once and query ``i`` adds
    ``query_scale ** (num_new - 1 - i) * weights[i] * p_i`` (``query_coefficients``). ``weights``:
    [num_new] (None: all 1). Scores of the step's own new slots start at 0, so scaling them
    is moot.

    The probabilities are the model's own: logits soft-capped (``cap * tanh(logits / cap)``,
    Gemma 2) before the softmax, and ``sinks`` ([num_q_heads] logits, gpt-oss) in each softmax's
    denominator without a slot of their own (their share is nobody's score). A sliding-window
    cache (``cache.window``) shows each query its last ``window`` tokens.
    """
    num_q_heads, num_new, head_dim = queries.shape
    num_kv_heads = cache.keys.shape[0]
    group = num_q_heads // num_kv_heads
    kv_len = cache.kv_len
    num_old = kv_len - num_new
    # q: [num_kv_heads, group, num_new, head_dim]; query heads of one KV group are adjacent (HF order).
    q = queries.reshape(num_kv_heads, group, num_new, head_dim)
    keys, values, scores = cache.keys, cache.values, cache.scores
    coef = query_coefficients(num_new, query_scale, weights)
    if query_scale != 1.0 and num_old:
        scores[:, :num_old] *= float(query_scale) ** num_new
    outputs = []
    for start in range(0, num_new, query_chunk):
        end = min(start + query_chunk, num_new)
        visible = num_old + end  # slots [0, visible) are seen by at least one query of the chunk
        # logits: [num_kv_heads, group, chunk, visible] fp32
        logits = torch.matmul(q[:, :, start:end], keys[:, None, :visible].transpose(-1, -2)) * scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        rows = torch.arange(num_old + start, num_old + end).unsqueeze(-1)
        slots = torch.arange(visible).unsqueeze(0)
        hidden = slots > rows  # [chunk, visible]: the future
        if cache.window is not None:  # slots are positions there (never compacted)
            hidden = hidden | (slots <= rows - cache.window)
        if bool(hidden.any()):
            logits = logits.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = torch.softmax(logits, dim=-1)
        else:
            sink = sinks.reshape(num_kv_heads, group, 1, 1).expand(-1, -1, end - start, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        if coef is None:
            scores[:, :visible] += probs.sum(dim=(1, 2))
        else:
            chunk_coef = coef[start:end]
            if bool(chunk_coef.any()):  # an all-zero chunk (outside the observation window) adds nothing
                # [kv, chunk, visible] group sums, each query's row weighted by its coefficient
                scores[:, :visible] += (probs.sum(dim=1) * chunk_coef[None, :, None]).sum(dim=1)
        outputs.append(torch.matmul(probs, values[:, None, :visible]))  # [kv, group, chunk, head_dim]
    out = torch.cat(outputs, dim=2).reshape(num_q_heads, num_new, head_dim)
    return out.transpose(0, 1).reshape(num_new, num_q_heads * head_dim)
