"""Per-sequence, per-layer H2O state of the dense oracle: live K/V, logical positions, scores.

Runs in the caller's process (tests, benchmarks); no vLLM. Semantics: docs/semantics.md,
"What H2O is, precisely".
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from h2o_vllm.config import Budget
from h2o_vllm.score_modes import QueryContext, ScoreMode, Scorer

#: The model's RoPE as a rotation by position differences: deltas [m] -> (cos, sin) [m, head_dim].
Rotate = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LayerCache:
    """The live tokens of one layer of one sequence, per KV head, in slot order.

    Every KV head holds the same number of live tokens (``kv_len``) but its own set of them.
    Slot order is logical order: appends go to the end and compaction preserves order.
    ``window``: a sliding-window layer's window (each query sees its last ``window`` tokens);
    such a layer is never compacted, so its slot index is the logical position.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, capacity: int = 64,
                 window: int | None = None) -> None:
        capacity = max(capacity, 1)
        self.window = window
        # keys, values: [num_kv_heads, capacity, head_dim] fp32, KV-space; keys after RoPE.
        self._keys = torch.zeros(num_kv_heads, capacity, head_dim)
        self._values = torch.zeros(num_kv_heads, capacity, head_dim)
        # positions: [num_kv_heads, capacity] int64, the logical position of each live slot.
        self._positions = torch.zeros(num_kv_heads, capacity, dtype=torch.long)
        # scores: [num_kv_heads, capacity] fp32, H2O accumulated attention (see Score).
        self._scores = torch.zeros(num_kv_heads, capacity)
        self.kv_len = 0
        # The last step's queries that a key scorer reads (Scorer.query_window): [num_q_heads,
        # n, head_dim] fp32 after RoPE; and the layer's attention scale.
        self.queries: torch.Tensor | None = None
        self.scale = 1.0

    @property
    def keys(self) -> torch.Tensor:
        """[num_kv_heads, kv_len, head_dim] fp32 live keys (after RoPE)."""
        return self._keys[:, : self.kv_len]

    @property
    def values(self) -> torch.Tensor:
        """[num_kv_heads, kv_len, head_dim] fp32 live values."""
        return self._values[:, : self.kv_len]

    @property
    def positions(self) -> torch.Tensor:
        """[num_kv_heads, kv_len] int64 logical positions of the live tokens, ascending per head."""
        return self._positions[:, : self.kv_len]

    @property
    def scores(self) -> torch.Tensor:
        """[num_kv_heads, kv_len] fp32 accumulated scores of the live tokens."""
        return self._scores[:, : self.kv_len]

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write new tokens: keys/values [num_kv_heads, n, head_dim], positions [n]; scores start at 0."""
        n = keys.shape[1]
        end = self.kv_len + n
        if end > self._keys.shape[1]:
            self._grow(max(end, 2 * self._keys.shape[1]))
        self._keys[:, self.kv_len:end] = keys
        self._values[:, self.kv_len:end] = values
        self._positions[:, self.kv_len:end] = positions
        self._scores[:, self.kv_len:end] = 0.0
        self.kv_len = end

    def _grow(self, capacity: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(t.shape[0], capacity, *t.shape[2:])
            out[:, : self.kv_len] = t[:, : self.kv_len]
            return out

        self._keys, self._values = grown(self._keys), grown(self._values)
        self._positions, self._scores = grown(self._positions), grown(self._scores)

    def _context(self, key_scorer: Scorer, rotate: Rotate | None) -> QueryContext | None:
        if not key_scorer.query_window:
            return None
        heads, _, head_dim = self._keys.shape
        queries = self.queries[:, -key_scorer.query_window:]  # [num_q_heads, n, head_dim]
        return QueryContext(values=self.values, queries=queries.reshape(heads, -1, queries.shape[1], head_dim),
                            scale=self.scale, rotate=rotate)

    def compact(self, heavy: int, recent: int, sinks: int = 0, rank: Sequence[ScoreMode] = (),
                key_scorer: Scorer | None = None, rotate: Rotate | None = None) -> None:
        """Keep, per KV head, the ``sinks`` first live tokens, the ``recent`` newest ones and the
        ``heavy`` highest-scored of the rest (ties keep the more recent token, see Eviction);
        order and scores move along. The first live slots are the first logical tokens: sinks
        are never evicted and compaction preserves order. ``rank``: score modes that rank the
        rest by ``ScoreMode.oracle_rank`` instead; kept scores are their own. ``key_scorer``: the
        candidates are ranked by ``Scorer.oracle_scores`` of every live key instead of the
        accumulated scores (KeyDiff, Expected Attention: the latter reads the last step's
        ``queries``, the values and ``rotate``, the model's RoPE by a position difference),
        before ``rank``."""
        n = self.kv_len
        if sinks + heavy + recent >= n:
            return
        num_candidates = n - recent  # slots [sinks, num_candidates) compete for the heavy part
        if key_scorer is None:
            ranked = self.scores
        else:
            ranked = key_scorer.oracle_scores(self.keys, self._context(key_scorer, rotate))
        candidates = ranked[:, sinks:num_candidates]  # [num_kv_heads, n - sinks - recent]
        for mode in rank:
            candidates = mode.oracle_rank(candidates)
        # Sorting the reversed candidates stably puts, among equal scores, the newer token first.
        order = torch.argsort(candidates.flip(-1), dim=-1, descending=True, stable=True)[:, :heavy]
        heavy_slots = (num_candidates - 1 - order).sort(dim=-1).values
        num_kv_heads = self._keys.shape[0]
        sink_slots = torch.arange(sinks).expand(num_kv_heads, sinks)
        recent_slots = torch.arange(num_candidates, n).expand(num_kv_heads, recent)
        # keep: [num_kv_heads, sinks + heavy + recent], ascending
        keep = torch.cat([sink_slots, heavy_slots, recent_slots], dim=-1)
        kept = sinks + heavy + recent
        for buf in (self._positions, self._scores):
            buf[:, :kept] = buf.gather(1, keep)
        for buf in (self._keys, self._values):
            buf[:, :kept] = buf.gather(1, keep.unsqueeze(-1).expand(-1, -1, buf.shape[-1]))
        self.kv_len = kept


@dataclass
class SequenceState:
    """Everything the oracle keeps for one sequence: one ``LayerCache`` per layer plus cadence.

    ``num_tokens`` counts the logical tokens whose K/V have been written (for ``generate``, the
    last generated token is never written). ``budget=None`` means a full cache, no eviction.
    ``layers`` holds ``None`` for a layer no step has reached yet.
    """

    prompt_len: int
    budget: Budget | None
    layers: list[LayerCache | None] = field(default_factory=list)
    num_tokens: int = 0
    rotate: Rotate | None = None  # the model's RoPE, for a key scorer that moves queries ahead

    @property
    def evicting(self) -> list[LayerCache]:
        """The full-attention layers: those H2O evicts from (sliding-window layers keep their own)."""
        return [layer for layer in self.layers if layer is not None and layer.window is None]

    @property
    def kv_len(self) -> int:
        """Live tokens per (full-attention layer, KV head); the same in every one of them."""
        return self.evicting[0].kv_len

    def compact_if_due(self) -> bool:
        """The cadence (see Cadence), checked after every step: once the prompt is written (or
        at the end of each of its chunks, with ``prefill_chunk``), shrink back to
        ``budget.tokens`` (sinks + heavy + recent) when the cache holds ``interval`` tokens or
        more past it. Returns whether it compacted."""
        budget = self.budget
        if budget is None or (self.num_tokens < self.prompt_len and budget.prefill_chunk is None):
            return False
        if self.kv_len < budget.tokens + budget.interval:
            return False
        # A mode ranks only the first compaction, the one that compresses the prompt.
        rank = budget.scoring if self.kv_len == self.num_tokens else ()
        for layer in self.evicting:
            layer.compact(budget.heavy, budget.recent, budget.sink_tokens, rank, budget.key_scorer, self.rotate)
        return True

    def query_scale(self) -> float:
        """What each query multiplies every live score by before adding its attention: the
        score modes' ``oracle_query_scale``, 1 for the paper's plain sum."""
        return math.prod(m.oracle_query_scale() for m in self.budget.scoring) if self.budget else 1.0

    def query_weights(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[n] fp32 weight of the queries at logical ``positions`` (the score modes'
        ``oracle_query_weight``, their own statement of the rule, apart from the engine's), or
        None when every one is 1 (the paper's plain sum)."""
        if self.budget is None or not self.budget.scoring:
            return None
        weights = torch.tensor([query_weight(self.budget, int(p), self.prompt_len) for p in positions],
                               dtype=torch.float32)
        return None if bool((weights == 1).all()) else weights


def query_weight(budget: Budget, position: int, prompt_len: int) -> float:
    """How much the query at logical ``position`` adds to the scores (before any scaling)."""
    return math.prod(m.oracle_query_weight(position, prompt_len, budget.prefill_chunk) for m in budget.scoring)
