"""``score: keydiff``: KeyDiff (Park et al. 2025, arXiv 2504.15364; docs/semantics.md, "KeyDiff").

At a row's compaction, per (layer, KV head), a live token's score is the negative cosine
similarity of its key to the anchor, the mean of the row's live keys each normalised to unit
length: the keys least like the rest are kept. It reads keys only (no attention), so it is
query-agnostic; it is computed from the cache at each compaction, never accumulated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_vllm.score_modes.base import QueryContext, Scorer

#: The least norm a key or the anchor is divided by: a zero key has no direction and scores 0
#: (so does every key of a zero anchor); keys of real models are many orders above it.
EPS = 1e-12


@dataclass(frozen=True)
class KeyDiff(Scorer):
    name: ClassVar[str] = "keydiff"
    # Decay and the observation window weigh queries' attention, which KeyDiff never reads.
    shapes_attention_only: ClassVar[tuple[str, ...]] = ("decay", "obs_window")

    def scores(self, keys: torch.Tensor, context: QueryContext | None = None,
               live: torch.Tensor | None = None) -> torch.Tensor:
        unit = keys / torch.linalg.vector_norm(keys, dim=-1, keepdim=True).clamp_min(EPS)
        if live is None:
            anchor = unit.mean(dim=-2, keepdim=True)                   # [..., 1, head_size]
        else:  # the mean of the live keys: padding adds nothing, nor counts
            unit = unit.masked_fill(~live[..., None], 0.0)
            anchor = unit.sum(dim=-2, keepdim=True) / live.sum(-1)[..., None, None]
        anchor = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(EPS)
        return -(unit * anchor).sum(dim=-1)

    def oracle_scores(self, keys: torch.Tensor, context: QueryContext | None = None) -> torch.Tensor:
        heads, kv_len, _ = keys.shape
        units = []
        for t in range(kv_len):  # token by token: the rule as written, not the batched one
            key = keys[:, t]                                           # [num_kv_heads, head_size]
            norm = torch.sqrt((key * key).sum(dim=-1, keepdim=True))
            units.append(key / torch.clamp(norm, min=EPS))
        anchor = units[0].clone()
        for unit in units[1:]:
            anchor += unit
        anchor /= kv_len
        anchor = anchor / torch.clamp(torch.sqrt((anchor * anchor).sum(dim=-1, keepdim=True)), min=EPS)
        out = torch.empty(heads, kv_len)
        for t, unit in enumerate(units):
            out[:, t] = -(unit * anchor).sum(dim=-1)
        return out
