"""The score modes past the paper, one class per mode (docs/score-modes.md, "Adding a mode").

Pure: stdlib and torch; below ``config``, which takes its mode keys from here. ``MODES`` is the
registry, in the order the keys are listed, checked and applied; the generic code reads it
through ``modes()`` at each call, so a mode added to it reaches config parsing, the flags, the
step plan, the records and the oracle without another module naming it. The ``score`` key's
choices have a registry of their own, ``score.SCORERS``.
"""
from h2o_vllm.score_modes.base import QueryContext, ScoreMode, Scorer, StepQueries
from h2o_vllm.score_modes.decay import Decay
from h2o_vllm.score_modes.expected import ExpectedAttention
from h2o_vllm.score_modes.keydiff import KeyDiff
from h2o_vllm.score_modes.obs_window import ObsWindow
from h2o_vllm.score_modes.pooling import Pooling
from h2o_vllm.score_modes.score import SCORERS, AccumulatedAttention, Score

MODES: tuple[type[ScoreMode], ...] = (Decay, ObsWindow, Pooling, Score)


def modes() -> tuple[type[ScoreMode], ...]:
    return MODES


def by_key() -> dict[str, type[ScoreMode]]:
    return {mode.key(): mode for mode in MODES}


__all__ = ["MODES", "SCORERS", "AccumulatedAttention", "Decay", "ExpectedAttention", "KeyDiff", "ObsWindow",
           "Pooling", "QueryContext", "Score", "ScoreMode", "Scorer", "StepQueries", "by_key", "modes"]
