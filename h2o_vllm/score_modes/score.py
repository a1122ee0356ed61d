"""``score``: what ranks the heavy candidates at a compaction, chosen by name (docs/semantics.md,
"Score modes"): ``h2o``, the paper's accumulated attention (the default), or a ``Scorer`` read
from the live cache (``keydiff``, ``expected``). ``SCORERS`` is the registry of the choices, one small class each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_vllm.score_modes.base import ScoreMode, Scorer
from h2o_vllm.score_modes.expected import ExpectedAttention
from h2o_vllm.score_modes.keydiff import KeyDiff


@dataclass(frozen=True)
class AccumulatedAttention(Scorer):
    """The paper's score: each token's accumulated attention (docs/semantics.md, "Score")."""
    name: ClassVar[str] = "h2o"


#: The choices of ``score``, in the order the flag and the messages list them; the first is the default.
SCORERS: tuple[type[Scorer], ...] = (AccumulatedAttention, KeyDiff, ExpectedAttention)


@dataclass(frozen=True)
class Score(ScoreMode):
    score: str

    help: ClassVar[str] = ("What ranks the heavy hitters at a compaction: 'h2o' (default), the paper's "
                           "accumulated attention; 'keydiff', each key's distance from the mean of the "
                           "live keys (KeyDiff; query-agnostic); 'expected', the attention the next "
                           "queries are expected to give each token, from the last queries moved "
                           "ahead with RoPE, times its value's norm (Expected Attention). Neither "
                           "takes decay or obs-window.")
    number: ClassVar[type] = str
    neutral: ClassVar[str] = AccumulatedAttention.name

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        return tuple(s.name for s in SCORERS)

    @classmethod
    def check(cls, value: Any) -> None:
        if value not in cls.choices():
            raise ValueError(f"h2o.score must be one of {', '.join(map(repr, cls.choices()))}, got {value!r}")

    @property
    def scorer(self) -> Scorer:
        return next(s for s in SCORERS if s.name == self.score)()

    def check_with(self, scoring: tuple[ScoreMode, ...]) -> None:
        meaningless = [m for m in scoring
                       if m.key() in self.scorer.shapes_attention_only and m.value != m.neutral]
        if meaningless:
            keys = " and ".join(f"h2o.{m.key()}" for m in meaningless)
            nulls = ", ".join(f"h2o_{m.key()}: null" for m in meaningless)
            them = "them" if len(meaningless) > 1 else "it"
            raise ValueError(f"h2o.score {self.score!r} cannot be combined with {keys}: it ranks tokens by "
                             f"their keys, never by the attention {keys} "
                             f"{'weigh' if len(meaningless) > 1 else 'weighs'}, so it would change nothing; "
                             f"unset {them} (a request may send {nulls}) or choose score 'h2o'")

    def key_scorer(self) -> Scorer | None:
        return None if isinstance(self.scorer, AccumulatedAttention) else self.scorer

    def unrecorded_hit(self, first_chunk_end: int) -> int | None:
        # A key score is recomputed from the live cache at each compaction, and a hit copies the
        # keys: the accumulated scores a record would restore rank nothing.
        scorer = self.key_scorer()
        return None if scorer is None else scorer.hit_reach(first_chunk_end)
