"""``score: expected``: Expected Attention (Devoto et al. 2025, arXiv 2510.00636; kvpress's
``ExpectedAttentionPress``; docs/semantics.md, "Expected Attention").

At a row's compaction, per (layer, KV head), each live token is scored by the attention that
queries of the next ``FUTURE_POSITIONS`` positions are expected to give it, modelling those
queries as Gaussian with the mean and covariance of the row's last ``QUERY_WINDOW`` queries
(of the compacting step) moved ahead with the model's RoPE; the expectation of ``exp(s q.k)``
under that Gaussian has the closed form ``exp(s k.mu + s^2 k^T Sigma k / 2)``. The softmax of
that over the live tokens, averaged over the KV head's query group and multiplied by the
value's norm, ranks the heavy candidates. Computed at each compaction, never accumulated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_vllm.score_modes.base import QueryContext, Scorer

#: The row's last queries of the compacting step whose statistics model the future queries
#: (all of them when the step has fewer: a decode step's one query, whose covariance is 0).
#: SnapKV's observation window, the one this project recommends for ``obs_window``.
QUERY_WINDOW = 32
#: The future positions the statistics are moved ahead to, averaged (kvpress's default).
FUTURE_POSITIONS = 512
#: Added to each expected attention before the value norm multiplies it (kvpress's default 0:
#: a zero value then scores 0, whatever its attention).
EPSILON = 0.0


def rotate_half(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The rotate-half partner of each element along ``dim``: ``(-x2, x1)`` (HF's layout)."""
    x1, x2 = x.chunk(2, dim=dim)
    return torch.cat([-x2, x1], dim=dim)


@dataclass(frozen=True)
class ExpectedAttention(Scorer):
    name: ClassVar[str] = "expected"
    # Decay and the observation window weigh the accumulated attention, which it never reads.
    shapes_attention_only: ClassVar[tuple[str, ...]] = ("decay", "obs_window")
    query_window: ClassVar[int] = QUERY_WINDOW

    def hit_reach(self, first_chunk_end: int) -> int:
        # The window's queries must run: a hit never covers the first compaction's window.
        return max(0, first_chunk_end - QUERY_WINDOW)

    def scores(self, keys: torch.Tensor, context: QueryContext | None = None,
               live: torch.Tensor | None = None) -> torch.Tensor:
        queries, scale = context.queries, context.scale
        n = queries.shape[-2]
        # Each query moved to the last one's position (a rotation by their distance), so that
        # their spread is the queries', not RoPE's.
        cos, sin = context.rotate(torch.arange(n - 1, -1, -1, device=queries.device))
        aligned = queries * cos + rotate_half(queries) * sin               # [..., g, n, d]
        mean = aligned.mean(dim=-2)                                          # [..., g, d]
        centered = aligned - mean[..., None, :]
        cov = centered.transpose(-1, -2) @ centered / n                     # [..., g, d, d]
        # M = the rotation by 1..FUTURE_POSITIONS, averaged: x -> x * cos_bar + rotate_half(x) * sin_bar.
        cos, sin = context.rotate(torch.arange(1, FUTURE_POSITIONS + 1, device=queries.device))
        cos_bar, sin_bar = cos.mean(dim=0), sin.mean(dim=0)                  # [d]
        mean = mean * cos_bar + rotate_half(mean) * sin_bar                  # M mu
        cov = cov * cos_bar[:, None] + rotate_half(cov, dim=-2) * sin_bar[:, None]  # M Sigma
        cov = cov * cos_bar + rotate_half(cov) * sin_bar                     # (M Sigma) M^T
        logits = scale * (keys[..., None, :, :] @ mean[..., :, None]).squeeze(-1)   # [..., g, kv_len]
        spread = ((keys[..., None, :, :] @ cov) * keys[..., None, :, :]).sum(dim=-1)
        logits = logits + 0.5 * scale * scale * spread
        if live is not None:  # the padding takes no share of the softmax
            logits = logits.masked_fill(~live[..., None, :], float("-inf"))
        expected = torch.softmax(logits, dim=-1).mean(dim=-2)               # [..., kv_len]
        return (expected + EPSILON) * torch.linalg.vector_norm(context.values, dim=-1)

    def oracle_scores(self, keys: torch.Tensor, context: QueryContext | None = None) -> torch.Tensor:
        heads, kv_len, d = keys.shape
        group, n = context.queries.shape[1:3]
        half = d // 2
        swap = torch.zeros(d, d)  # P: P @ x = rotate_half(x)
        swap[:half, half:], swap[half:, :half] = -torch.eye(half), torch.eye(half)

        def rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return torch.diag(cos) + torch.diag(sin) @ swap

        cos, sin = context.rotate(torch.arange(1, FUTURE_POSITIONS + 1))
        ahead = rotation(cos.sum(dim=0) / FUTURE_POSITIONS, sin.sum(dim=0) / FUTURE_POSITIONS)
        cos, sin = context.rotate(torch.arange(n))
        back = [rotation(cos[n - 1 - i], sin[n - 1 - i]) for i in range(n)]  # query i to the last's position
        out = torch.zeros(heads, kv_len)
        for h in range(heads):
            for j in range(group):  # one query head at a time, its statistics query by query
                moved = [back[i] @ context.queries[h, j, i] for i in range(n)]
                mu = sum(moved[1:], moved[0].clone()) / n
                sigma = torch.zeros(d, d)
                for q in moved:
                    sigma += torch.outer(q - mu, q - mu)
                sigma /= n
                mu, sigma = ahead @ mu, ahead @ sigma @ ahead.T
                spread = ((keys[h] @ sigma) * keys[h]).sum(dim=-1)  # k_t^T Sigma k_t, per token
                logit = context.scale * (keys[h] @ mu) + 0.5 * context.scale ** 2 * spread
                weight = torch.exp(logit - logit.max())
                out[h] += weight / weight.sum() / group
        norms = torch.sqrt((context.values * context.values).sum(dim=-1))
        return (out + EPSILON) * norms
