"""``pool_kernel``: SnapKV's pooling at the prompt's compaction (Li et al. 2024, arXiv
2404.14469; docs/score-modes.md, "Definitions").

A sequence's first compaction ranks each heavy candidate on the largest score among the
``pool_kernel`` candidates centred on it (fewer at the ends), so a fact spanning a few tokens is
kept whole; kept tokens keep their own scores, and later compactions rank by score alone.
Candidates are live slots in order, so pooling never reaches into the sinks or the recent window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from h2o_vllm.score_modes.base import ScoreMode, integer_at_least


@dataclass(frozen=True)
class Pooling(ScoreMode):
    pool_kernel: int

    help: ClassVar[str] = ("At the prompt's compaction, rank heavy hitters on their scores max-pooled "
                           "over INT neighbouring tokens (odd; SnapKV's pooling), so a fact spanning a "
                           "few tokens is kept whole; default 1, no pooling.")
    neutral: ClassVar[int] = 1
    ranks: ClassVar[bool] = True

    @classmethod
    def check(cls, value) -> None:
        integer_at_least("pool_kernel", value, 1)
        if value % 2 == 0:
            # An even window has no centre: the pooled score of a token would lean to one side.
            raise ValueError(f"h2o.pool_kernel must be odd (1 is no pooling), got {value!r}")

    def rank(self, candidates: torch.Tensor) -> torch.Tensor:
        k, m = self.pool_kernel, candidates.shape[-1]
        # max_pool1d pads with -inf: a window at the edge takes the max of what it covers.
        return F.max_pool1d(candidates.reshape(-1, 1, m), k, stride=1, padding=k // 2).view(candidates.shape)

    def oracle_rank(self, candidates: torch.Tensor) -> torch.Tensor:
        half = self.pool_kernel // 2
        padded = torch.nn.functional.pad(candidates, (half, half), value=-torch.inf)
        return padded.unfold(-1, self.pool_kernel, 1).amax(-1)
