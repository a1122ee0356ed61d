"""``decay``: A2SF's forgetting factor (Jo & Shin 2024, arXiv 2407.20485; docs/score-modes.md).

Each query multiplies every live score by ``decay`` before adding its attention, so attention
long past fades. A step of queries ``a..b`` is that, fused: query ``i`` adds ``decay^(b-i)``
times its probabilities and the scores from before the step are scaled by ``decay^(b-a+1)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable

import torch

from h2o_vllm.score_modes.base import ScoreMode, StepQueries, number_in_unit_interval


@dataclass(frozen=True)
class Decay(ScoreMode):
    decay: float

    help: ClassVar[str] = ("Forgetting factor in (0, 1]: each query scales every score by it before adding "
                           "its attention (A2SF); default 1, the paper's plain sum.")
    number: ClassVar[type] = float
    neutral: ClassVar[float] = 1.0

    @classmethod
    def check(cls, value) -> None:
        number_in_unit_interval("decay", value, low_open=True, note=" (1 is the paper's plain sum)")

    @classmethod
    def query_factors(cls, values: torch.Tensor, queries: StepQueries) -> torch.Tensor | None:
        # Powers in fp64, rounded to fp32 once by the caller: the oracle's arithmetic.
        return values.to(torch.float64)[queries.row] ** (queries.row_len - 1 - queries.index)

    @classmethod
    def score_scales(cls, values: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor | None:
        return values.to(torch.float64) ** query_lens

    def record_key(self) -> Hashable:
        return self.decay  # every score of a prefix is shaped by it

    def oracle_query_scale(self) -> float:
        return float(self.decay)
