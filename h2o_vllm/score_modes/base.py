"""``ScoreMode``: one way of scoring past the paper's H2O, as one small class (kvpress's presses).

Pure: stdlib and torch. A mode is a frozen dataclass whose one field is named by its
``additional_config["h2o"]`` key and holds that key's value; the same name gives its flag
(``--h2o-<key>``) and its per-request key (``h2o_<key>``). The class owns everything the mode
changes, each as a hook that the generic code calls for every registered mode
(``score_modes.MODES``), and whose default changes nothing:

- config: ``check`` (the range and its message), ``neutral`` (the value that is the paper's
  rule: a budget drops a mode set to it, so the paper's arithmetic runs unchanged), ``help``,
  ``choices`` (a key whose value is a name: the valid names, for the flag and the messages),
  ``check_with`` (the other modes set that it cannot combine with);
- the engine's step plan, vectorised over a batch whose rows each have their own value
  (``neutral`` where unset): ``query_factors`` and ``score_scales``, the two terms of the
  fused update ``s <- score_scale[row] * s + sum_i query_weight[i] * p_i`` (the kernels take
  only those); ``rank``, how the first compaction ranks the heavy candidates;
  ``key_scorer``, what replaces the accumulated scores at every compaction with a score read
  from the live cache (``Scorer``: KeyDiff, Expected Attention), None for the accumulated attention;
- prefix-cache records: ``record_key`` (what a prefix's scores depend on) and
  ``unrecorded_hit`` (records off, and how far a hit may reach without one);
- the dense oracle: ``oracle_query_scale``, ``oracle_query_weight`` and ``oracle_rank``, the
  same rules stated per query and per token, written apart from the vectorised ones so that
  the tests holding the engine to the oracle compare two statements (docs/semantics.md, "The
  oracle").

A score read from the keys rather than from the accumulated attention (KeyDiff, Expected
Attention) is a ``Scorer``, one small class each, chosen by the ``score`` key (``score_modes.score``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable

import torch


@dataclass(frozen=True)
class StepQueries:
    """The queries of one step, one entry per scheduled token (int64 [num_tokens], CPU)."""

    row: torch.Tensor        # its row in the batch
    index: torch.Tensor      # its index among its row's queries in this step
    row_len: torch.Tensor    # its row's queries in this step
    position: torch.Tensor   # logical position
    prompt_len: torch.Tensor
    chunk_start: torch.Tensor  # where the prefill chunk holding it starts (docs/semantics.md, "Prefill chunks")
    chunk_end: torch.Tensor    # where that chunk ends, exclusive; past the prompt, meaningless


@dataclass(frozen=True)
class ScoreMode:
    #: The flag's help (``frontend.flags``); its metavar and parser follow ``number``.
    help: ClassVar[str] = ""
    #: ``float``, ``int`` or ``str`` (a name among ``choices()``): the type of the value.
    number: ClassVar[type] = int
    #: The value that changes nothing; in a tensor of rows, the value of a row without the mode.
    neutral: ClassVar[Any] = None
    #: Whether ``rank`` is not the identity (the plan passes only such modes to the compaction).
    ranks: ClassVar[bool] = False

    @classmethod
    def key(cls) -> str:
        return dataclasses.fields(cls)[0].name

    @property
    def value(self) -> Any:
        return getattr(self, self.key())

    @classmethod
    def check(cls, value: Any) -> None:
        """Raise ``ValueError`` naming ``h2o.<key>`` when ``value`` is out of range."""

    @classmethod
    def choices(cls) -> tuple[str, ...] | None:
        """The valid values of a key whose value is a name (``number`` is ``str``); None: a number."""
        return None

    def check_with(self, scoring: tuple[ScoreMode, ...]) -> None:
        """Raise ``ValueError`` naming the keys when this mode cannot combine with the others set
        (``scoring``: every mode of the config, this one included, in registry order)."""

    # -- the engine's step plan: ``values`` [num_reqs], each row's value (``neutral`` where unset)

    @classmethod
    def query_factors(cls, values: torch.Tensor, queries: StepQueries) -> torch.Tensor | None:
        """fp64 [num_tokens]: what each query's probabilities are multiplied by before they are
        added, or None for 1 everywhere."""
        return None

    @classmethod
    def score_scales(cls, values: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor | None:
        """fp64 [num_reqs]: what each row's scores from before the step are multiplied by, or
        None for 1 everywhere."""
        return None

    def rank(self, candidates: torch.Tensor) -> torch.Tensor:
        """[..., m] the rank score of each heavy candidate at a sequence's first compaction
        (candidates: live slots between the sinks and the recent window, in order). The worker
        passes padded rows (``worker.due_pass``): -inf around a row's candidates, which must
        change no candidate's rank score (pooling: its own edge padding is -inf)."""
        return candidates

    def key_scorer(self) -> Scorer | None:
        """What ranks the heavy candidates at every compaction instead of the accumulated
        scores, from the row's live keys; None: the accumulated scores (the paper's)."""
        return None

    # -- prefix-cache records (scheduler/prefix_hits.py)

    def record_key(self) -> Hashable | None:
        """What of this mode a prefix's recorded scores depend on; None: nothing."""
        return None

    def unrecorded_hit(self, first_chunk_end: int) -> int | None:
        """None: records as usual. Else records are off for the request (its recorded scores
        would serve no one), and a hit may reach this many tokens, whose scores are all zero."""
        return None

    # -- the dense oracle: per query, per token

    def oracle_query_scale(self) -> float:
        """What each query multiplies every live score by before adding its attention."""
        return 1.0

    def oracle_query_weight(self, position: int, prompt_len: int, chunk: int | None) -> float:
        """What the query at logical ``position`` weighs in the scores."""
        return 1.0

    def oracle_rank(self, candidates: torch.Tensor) -> torch.Tensor:
        """``rank`` as the oracle states it."""
        return candidates


@dataclass(frozen=True)
class QueryContext:
    """What a scorer that reads queries (``Scorer.query_window``) gets beside the keys of a row
    at its compaction; leading dimensions as the keys' (``[R, Hkv]`` on the worker, ``[Hkv]`` in
    the oracle)."""
    values: torch.Tensor   # [..., kv_len, head_size] fp32, the live values in slot order
    queries: torch.Tensor  # [..., group, n, head_size] fp32 after RoPE: the row's last n <=
    #                        query_window queries of the compacting step, in logical order
    scale: float           # the model's attention scale (logits = scale * q . k)
    # The model's rotation by a position difference: deltas [m] int64 -> (cos, sin) [m, head_size]
    # fp32 in the rotate-half layout (``score_modes.rotary.Rotary.cos_sin`` on the worker).
    rotate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Scorer:
    """A score of the live tokens read from their keys (``views.keys`` on the worker, the
    oracle's ``LayerCache.keys``), computed at a row's compaction to rank its heavy candidates;
    one small class per choice of the ``score`` key (``score_modes.score.SCORERS``)."""

    #: The ``score`` value that chooses it.
    name: ClassVar[str] = ""
    #: The keys of the score modes that only shape the accumulated attention: meaningless
    #: when this scorer ranks, so refused at any other value than their neutral one.
    shapes_attention_only: ClassVar[tuple[str, ...]] = ()
    #: How many of the row's last queries of the compacting step ``scores`` reads, in a
    #: ``QueryContext`` with the values and the RoPE; 0: it reads the keys alone.
    query_window: ClassVar[int] = 0

    def scores(self, keys: torch.Tensor, context: QueryContext | None = None,
               live: torch.Tensor | None = None) -> torch.Tensor:
        """keys: [..., kv_len, head_size] fp32, a row's live keys per (layer, KV head) in slot
        order. Returns [..., kv_len] fp32: higher is kept first (``policy.select_keep``).
        live: [..., kv_len] bool (broadcast), the slots that are the row's (the worker's padded
        rows, ``worker.due_pass``); the others must not change the live slots' scores."""
        raise NotImplementedError

    def oracle_scores(self, keys: torch.Tensor, context: QueryContext | None = None) -> torch.Tensor:
        """``scores`` as the oracle states it (keys: [num_kv_heads, kv_len, head_size] fp32)."""
        raise NotImplementedError

    def hit_reach(self, first_chunk_end: int) -> int:
        """How far a prefix-cache hit may reach for a request ranked by this scorer (records
        are off: the accumulated scores rank nothing): the hit's queries never run, so a
        scorer that reads the first compaction's queries stops the hit before them."""
        return HIT_ANYWHERE


#: ``Scorer.hit_reach``'s "no limit": more tokens than any prompt (a hit stops before the first
#: compaction in any case, ``scheduler.prefix_hits``).
HIT_ANYWHERE = 2**62


def integer_at_least(key: str, value: Any, low: int) -> None:
    """The check of a count key: an int (not a bool) of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"h2o.{key} must be an integer >= {low}, got {value!r}")


def number_in_unit_interval(key: str, value: Any, low_open: bool, note: str = "") -> None:
    """The check of a fraction key: a number in [0, 1], or (0, 1] with ``low_open``."""
    span = "(0, 1]" if low_open else "[0, 1]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"h2o.{key} must be a number in {span}, got {value!r}")
    # Range first: a huge int would overflow math.isfinite; NaN fails the range too.
    inside = 0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0
    if not inside or not math.isfinite(value):
        raise ValueError(f"h2o.{key} must be in {span}{note}, got {value!r}")
