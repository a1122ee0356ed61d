"""The H2O rules both sides of vLLM share: the live KV length of a Budget, the keep-set.

Pure: torch and ``config`` only. The scheduler (engine-core process) and the workers evaluate
``kv_len_after`` on the same inputs, so they agree on every block count without exchanging a
message; see ARCHITECTURE.md, "Shared deterministic rule".
"""
from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F

from h2o_vllm.config import Budget

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def cadence_start(prompt_len: IntOrTensor, budget_tokens: IntOrTensor,
                  interval: IntOrTensor) -> IntOrTensor:
    """Tokens processed at the first compaction: the prompt is never evicted, and the cache
    first shrinks once it has grown ``interval`` past the budget (ARCHITECTURE.md, "Cadence")."""
    if any(isinstance(x, torch.Tensor) for x in (prompt_len, budget_tokens, interval)):
        return torch.maximum(torch.as_tensor(prompt_len), torch.as_tensor(budget_tokens + interval))
    return max(prompt_len, budget_tokens + interval)


def live_kv_len(tokens_processed: IntOrTensor, prompt_len: IntOrTensor,
                budget_tokens: IntOrTensor, interval: IntOrTensor) -> IntOrTensor:
    """Live KV length after ``tokens_processed`` logical tokens have been written.

    The first compaction comes at ``cadence_start``, then one every ``interval`` tokens, each
    back to ``budget_tokens``: hence the closed form. A request recomputed after preemption
    (one prefill step past its prompt) lands on the same length an uninterrupted request would
    have: both sides only ever see this function. Elementwise on tensors (the worker's rows)
    and on ints (the scheduler's requests).
    """
    start = cadence_start(prompt_len, budget_tokens, interval)
    if isinstance(tokens_processed, torch.Tensor):
        compacted = budget_tokens + torch.remainder(tokens_processed - start, interval)
        return torch.where(tokens_processed < start, tokens_processed, compacted)
    if tokens_processed < start:
        return tokens_processed
    return budget_tokens + (tokens_processed - start) % interval


def kv_len_after(tokens_processed: int, prompt_len: int, budget: Budget) -> int:
    """Live KV length of a sequence after ``tokens_processed`` tokens."""
    return live_kv_len(tokens_processed, prompt_len, budget.tokens, budget.interval)


def peak_kv_len(prompt_len: int, max_len: int, budget: Budget) -> int:
    """Most KV-space slots a sequence of at most ``max_len`` logical tokens needs in one step
    after its prompt: the live length before a decode step plus the token it writes.

    Bounded by budget + interval whatever ``max_len`` is: what makes H2O's memory per
    sequence predictable, and the bound of what admission keeps free for a running sequence
    (``H2OManager.admission_headroom``).
    """
    start = cadence_start(prompt_len, budget.tokens, budget.interval)
    last = max_len - 1  # the last decode step starts from max_len - 1 processed tokens
    peak = min(start, last + 1) - 1 if prompt_len < start else 0
    if last >= start:
        peak = max(peak, budget.tokens + min(budget.interval - 1, last - start))
    return max(peak + 1, 1) if last >= prompt_len else prompt_len


def select_keep(scores: torch.Tensor, heavy: int, recent: int, sinks: int = 0,
                pool: int = 1) -> torch.Tensor:
    """Indices of the tokens to keep, per head: the ``sinks`` first ones, the ``recent`` last
    ones, and the ``heavy`` highest-ranked among the rest; ties keep the more recent token;
    ascending order.

    scores: [..., n] accumulated attention of the n live tokens (oldest first). The first
    ``sinks`` live tokens are the first logical ones: they are never evicted, and compaction
    keeps order. ``pool`` (odd): the rest are ranked on ``pooled_scores``, not on their own.
    Returns int64 [..., min(n, sinks + heavy + recent)]; the same count per head.
    """
    n = scores.shape[-1]
    num_sinks = min(sinks, n)
    num_recent = min(recent, n - num_sinks)
    num_older = n - num_recent
    num_heavy = min(heavy, num_older - num_sinks)
    lead = scores.shape[:-1]
    device = scores.device
    sink_idx = torch.arange(num_sinks, device=device).expand(*lead, num_sinks)
    recent_idx = torch.arange(num_older, n, device=device).expand(*lead, num_recent)
    if num_heavy == 0:
        return torch.cat([sink_idx, recent_idx], dim=-1).contiguous()
    candidates = pooled_scores(scores[..., num_sinks:num_older], pool)
    # Flip so that, among equal scores, the stable sort meets the more recent token first.
    order = torch.sort(candidates.flip(-1), dim=-1, descending=True, stable=True).indices[..., :num_heavy]
    heavy_idx = torch.sort(num_older - 1 - order, dim=-1).values
    return torch.cat([sink_idx, heavy_idx, recent_idx], dim=-1)


def pooled_scores(candidates: torch.Tensor, pool: int) -> torch.Tensor:
    """[..., m] each candidate's rank score: the largest score among the ``pool`` candidates
    centred on it (fewer at the ends), or its own when ``pool`` is 1. Candidates are live slots
    in order, so after a compaction the neighbours are the nearest surviving tokens."""
    if pool == 1:
        return candidates
    m = candidates.shape[-1]
    flat = candidates.reshape(-1, 1, m)
    # max_pool1d pads with -inf: a window at the edge takes the max of what it covers.
    return F.max_pool1d(flat, pool, stride=1, padding=pool // 2).view(candidates.shape)
