"""Random eviction through the engine, for benchmarks only: the paper's budget (half heavy, half
recent) with the heavy half drawn at random instead of by accumulated attention.

Runs in a benchmark's engine child (in-process engine core: the worker shares its registry).
h2o_vllm has no random policy, and should not ship one; the control is still worth having,
since it tells what H2O's scores buy over keeping *some* old tokens. So this module adds a
score mode to the plugin's registry in the benchmark's process only (as
tests/unit/score_modes/test_registry.py does): the engine's own compaction runs, and only the
ranking of the heavy candidates is random. What it is not: a mode's ``rank`` applies at a
sequence's first compaction only (docs/score-modes.md), so the prompt's eviction is random and
any later one (decode past the interval, later prefill chunks) ranks by accumulated attention
over the randomly kept tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_devtools import bench
from h2o_vllm import score_modes
from h2o_vllm.score_modes.base import ScoreMode, integer_at_least

#: The policy name the benchmarks give it (``h2o_devtools.bench.h2o_config``'s names beside it).
POLICY = "random"


@dataclass(frozen=True)
class RandomHeavy(ScoreMode):
    random_heavy: int

    help: ClassVar[str] = "Benchmarks only: rank the prompt's heavy candidates at random (1: on)."
    neutral: ClassVar[int] = 0
    ranks: ClassVar[bool] = True

    @classmethod
    def check(cls, value) -> None:
        integer_at_least("random_heavy", value, 0)

    def rank(self, candidates: torch.Tensor) -> torch.Tensor:
        # torch's global generator, which vLLM seeds from the engine's seed: a rerun draws the same.
        return torch.rand(candidates.shape, dtype=torch.float32).to(candidates.device)

    oracle_rank = rank

    def record_key(self) -> Any:
        return ("random_heavy", self.random_heavy)


def register() -> None:
    """Add the mode to this process's registry, once (before the engine is built)."""
    if RandomHeavy not in score_modes.MODES:
        score_modes.MODES = (*score_modes.MODES, RandomHeavy)


def h2o_config(policy: str, budget: float | None) -> dict[str, Any] | None:
    """``bench.h2o_config`` with ``random`` (and ``random@c<N>``) beside its names."""
    base, sep, chunk = policy.partition(bench.CHUNK_SUFFIX)
    if base != POLICY:
        return bench.h2o_config(policy, budget)
    return {**bench.h2o_config("h2o" + sep + chunk, budget), "random_heavy": 1}
