"""``obs_window``: SnapKV's observation window (Li et al. 2024, arXiv 2404.14469; docs/score-modes.md).

A prompt query adds to the scores only if it is among the last ``obs_window`` queries of its
prefill chunk (the whole prompt without ``prefill_chunk``); every later query counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_vllm.score_modes.base import ScoreMode, StepQueries, integer_at_least


@dataclass(frozen=True)
class ObsWindow(ScoreMode):
    obs_window: int

    help: ClassVar[str] = ("Score the prompt's tokens by its last INT queries only (SnapKV's observation "
                           "window; >= 1); default: every prompt query.")
    # A window longer than any chunk: every query counts.
    neutral: ClassVar[int] = 2**62

    @classmethod
    def check(cls, value) -> None:
        integer_at_least("obs_window", value, 1)

    @classmethod
    def query_factors(cls, values: torch.Tensor, queries: StepQueries) -> torch.Tensor | None:
        window = values[queries.row]
        first = torch.maximum(queries.chunk_start, queries.chunk_end - window)
        counts = (queries.position >= queries.prompt_len) | (queries.position >= first)
        return counts.to(torch.float64)

    def unrecorded_hit(self, first_chunk_end: int) -> int:
        # Queries before the first chunk's window add nothing: a prefix up to there scores zeros.
        return max(0, first_chunk_end - self.obs_window)

    def oracle_query_weight(self, position: int, prompt_len: int, chunk: int | None) -> float:
        if position >= prompt_len:
            return 1.0
        chunk = chunk or prompt_len
        end = min((position // chunk + 1) * chunk, prompt_len)
        return 0.0 if position < end - self.obs_window else 1.0
