"""H2O configuration: parsed and validated from the plain dict in ``additional_config["h2o"]``.

Pure: stdlib and ``score_modes`` (whose classes own their keys). Every process (API server, engine core, workers) parses the dict itself, so
the same rules apply everywhere and an invalid dict fails before any model weight is loaded.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from h2o_vllm import score_modes
from h2o_vllm.score_modes.base import ScoreMode, Scorer, integer_at_least, number_in_unit_interval

#: The paper's default: 10% heavy hitters + 10% recent tokens ("20% budget").
DEFAULT_RATIO = 0.1
#: The floor of a budget that scales with the prompt (``min_tokens`` unset), in tokens. Measured
#: (docs/score-modes.md, "Budget floor"): at 20%, 32- and 128-token prompts diverge from the
#: full cache more than 512-token ones do without it, and no more with it.
DEFAULT_MIN_TOKENS = 32

_RATIO_KEYS = ("heavy_ratio", "recent_ratio")
_TOKEN_KEYS = ("heavy_tokens", "recent_tokens")
_COUNT_KEYS = ("interval", "sink_tokens", "min_tokens", "prefill_chunk")


@dataclass(frozen=True, init=False)
class H2OConfig:
    """What H2O keeps per (layer, KV head) of each sequence, and how often it compacts.

    Each part of the budget (heavy, recent) is either a fraction of the prompt length
    (``*_ratio``, the paper's budgets) or an absolute token count (``*_tokens``); giving both
    for one part is an error. A part given neither way defaults to ``DEFAULT_RATIO``.

    Short prompts: a ratio part is ``max(1, floor(ratio * prompt_len))`` when the ratio is
    positive, so an enabled part never rounds down to zero tokens; a ratio of 0 disables the
    part (``heavy_ratio=0`` is the recent-only "Local" baseline).

    ``interval``: after the prompt, the cache is compacted back to the budget each time it has
    grown ``interval`` tokens past it. ``None`` means one KV block, everywhere (the natural
    unit: each compaction then frees whole blocks); the oracle is given the block size of the
    engine it stands for. ``interval=1`` is the paper's per-step eviction.

    Past the paper (docs/score-modes.md; unset, each is the paper's H2O):

    - the score modes (``h2o_vllm.score_modes``, one class each): each is one more key,
      validated by its class, kept in ``scoring`` and read as an attribute (None where unset).
    - ``sink_tokens``: the first ``sink_tokens`` logical tokens are always kept, in addition to
      heavy + recent (StreamingLLM's attention sinks).
    - ``min_tokens``: a floor on the cache size: when sinks + heavy + recent is smaller, the
      recent window grows to make up ``min_tokens`` (short prompts under a ratio budget).
      Unset, it is ``DEFAULT_MIN_TOKENS`` for a budget with a positive ratio part and 0 for a
      budget given in tokens alone (a token count is taken as given); 0 is the paper's rule.
    - ``prefill_chunk``: the prompt is processed in chunks ending at multiples of
      ``prefill_chunk`` tokens (and at its end), and the cadence applies at the end of each
      chunk as it does after each decode token: a chunk's queries see what earlier chunks
      kept plus the chunk itself, and a sequence's peak is about budget + interval + chunk,
      not its prompt (docs/semantics.md, "Prefill chunks"). Unset: the prompt is held whole.
    """

    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    heavy_tokens: int | None = None
    recent_tokens: int | None = None
    interval: int | None = None
    sink_tokens: int | None = None
    min_tokens: int | None = None
    prefill_chunk: int | None = None
    #: The score modes set, each checked, in ``score_modes.modes()`` order.
    scoring: tuple[ScoreMode, ...] = ()

    def __init__(self, **settings: Any) -> None:
        for f in fields(self)[:-1]:
            object.__setattr__(self, f.name, settings.pop(f.name, None))
        modes = score_modes.modes()
        unexpected = sorted(set(settings) - {mode.key() for mode in modes}, key=repr)
        if unexpected:
            raise TypeError(f"H2OConfig got unexpected keyword argument(s) {unexpected}")
        scoring = []
        for mode in modes:
            value = settings.get(mode.key())
            if value is not None:
                mode.check(value)
                scoring.append(mode(value))
        object.__setattr__(self, "scoring", tuple(scoring))
        for mode in scoring:
            mode.check_with(self.scoring)
        self._check()

    def __getattr__(self, name: str) -> Any:
        """A score mode's key reads as an attribute: its value, None where unset."""
        mode = score_modes.by_key().get(name)
        if mode is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return next((m.value for m in self.__dict__.get("scoring", ()) if isinstance(m, mode)), None)

    @classmethod
    def keys(cls) -> list[str]:
        """Every key ``additional_config["h2o"]`` accepts: the budget's, then each score mode's."""
        return [f.name for f in fields(cls)[:-1]] + [mode.key() for mode in score_modes.modes()]

    def _check(self) -> None:
        for key in _RATIO_KEYS:
            if getattr(self, key) is not None:
                number_in_unit_interval(key, getattr(self, key), low_open=False)
        for key in (*_TOKEN_KEYS, *_COUNT_KEYS):
            if getattr(self, key) is not None:
                integer_at_least(key, getattr(self, key), 1 if key in ("interval", "prefill_chunk") else 0)
        for part in ("heavy", "recent"):
            if getattr(self, f"{part}_ratio") is not None and getattr(self, f"{part}_tokens") is not None:
                raise ValueError(
                    f"h2o.{part}_ratio and h2o.{part}_tokens both set: give the {part} budget one way, "
                    f"as a fraction of the prompt ({part}_ratio) or as a token count ({part}_tokens)")
        if self._part_is_zero("heavy") and self._part_is_zero("recent") and not self.sink_tokens:
            raise ValueError("h2o budget is zero: heavy and recent are both 0; enable at least one part "
                             "(for example heavy_ratio=0.1, recent_ratio=0.1)")

    def _part_is_zero(self, part: str) -> bool:
        ratio, tokens = getattr(self, f"{part}_ratio"), getattr(self, f"{part}_tokens")
        return (ratio is not None and ratio == 0) or (tokens is not None and tokens == 0)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "H2OConfig":
        """Parse ``additional_config["h2o"]``; raises ``ValueError`` naming the bad key."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ValueError(f"additional_config['h2o'] must be a dict of H2O settings, got {type(data).__name__}")
        known = cls.keys()
        unknown = sorted(set(data) - set(known), key=repr)  # keys may be of mixed types
        if unknown:
            raise ValueError(f"unknown h2o key(s) {unknown}; accepted keys: {known}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """The explicitly set keys, round-trippable through ``from_dict``."""
        return {key: getattr(self, key) for key in self.keys() if getattr(self, key) is not None}

    def with_overrides(self, overrides: Mapping[str, Any]) -> "H2OConfig":
        """This config with some keys replaced (per-request budgets); a part set one way
        in ``overrides`` drops the other way inherited from ``self``."""
        merged = self.to_dict()
        for key in overrides:
            for part in ("heavy", "recent"):
                if key in (f"{part}_ratio", f"{part}_tokens"):
                    merged.pop(f"{part}_ratio", None)
                    merged.pop(f"{part}_tokens", None)
        merged.update(overrides)
        return H2OConfig.from_dict(merged)

    def part_budget(self, part: str, prompt_len: int) -> int:
        """Tokens kept for ``part`` ("heavy" or "recent") of a prompt of ``prompt_len`` tokens."""
        tokens = getattr(self, f"{part}_tokens")
        if tokens is not None:
            return tokens
        ratio = getattr(self, f"{part}_ratio")
        ratio = DEFAULT_RATIO if ratio is None else ratio
        if ratio == 0:
            return 0
        # The epsilon keeps 0.3 * 10 from flooring to 2 through fp error.
        return max(1, math.floor(ratio * prompt_len + 1e-9))

    def floor_tokens(self) -> int:
        """``min_tokens``, or its default: ``DEFAULT_MIN_TOKENS`` when the budget scales with
        the prompt (a part with a positive ratio, given or by default), else 0."""
        if self.min_tokens is not None:
            return self.min_tokens
        scales = any(getattr(self, f"{part}_tokens") is None and getattr(self, f"{part}_ratio") != 0
                     for part in ("heavy", "recent"))
        return DEFAULT_MIN_TOKENS if scales else 0

    def budget(self, prompt_len: int, block_size: int) -> "Budget":
        """The ``Budget`` of one prompt length; ``block_size`` (KV block) is the default interval."""
        sink_tokens, heavy = self.sink_tokens or 0, self.part_budget("heavy", prompt_len)
        recent = self.part_budget("recent", prompt_len)
        recent += max(0, self.floor_tokens() - (sink_tokens + heavy + recent))
        return Budget(heavy=heavy, recent=recent,
                      interval=self.interval if self.interval is not None else block_size,
                      sink_tokens=sink_tokens, prefill_chunk=self.prefill_chunk,
                      scoring=tuple(m for m in self.scoring if m.value != m.neutral))


@dataclass(frozen=True)
class Budget:
    """What one request keeps per (layer, KV head), in tokens, and its cadence: resolved once
    per request (``H2OConfig.budget``) and passed on, never re-derived."""

    heavy: int
    recent: int
    interval: int
    sink_tokens: int = 0  # the first logical tokens, always kept (attention sinks)
    prefill_chunk: int | None = None  # None: the prompt is one chunk, held whole
    # The score modes that change something, in registry order; none: the paper's scores.
    scoring: tuple[ScoreMode, ...] = ()

    def mode(self, mode: type[ScoreMode]) -> ScoreMode | None:
        """This budget's instance of ``mode``, None when it runs without it."""
        return next((m for m in self.scoring if type(m) is mode), None)

    @property
    def key_scorer(self) -> Scorer | None:
        """What ranks the heavy candidates from the live keys at every compaction
        (``ScoreMode.key_scorer``); None: the accumulated attention, the paper's."""
        return next((s for m in self.scoring if (s := m.key_scorer()) is not None), None)

    @property
    def tokens(self) -> int:
        """sink_tokens + heavy + recent: the size the cache is compacted back to."""
        return self.sink_tokens + self.heavy + self.recent


#: The prefix of H2O's per-request keys: every key with it is H2O's (an unknown one is refused).
REQUEST_PREFIX = "h2o_"


def request_keys() -> dict[str, str]:
    """Per-request overrides travel in ``SamplingParams.extra_args`` (OpenAI: ``vllm_xargs``)
    under these names: each per-request key and the ``H2OConfig`` key it sets, from the
    registry as it is now (a mode registered later has its key too)."""
    return {f"{REQUEST_PREFIX}{key}": key for key in H2OConfig.keys()}


_parsed: dict[str, H2OConfig] = {}


def config_from_additional(additional_config: Mapping[str, Any] | None) -> H2OConfig | None:
    """The engine's H2O config, or None when H2O is off (no ``h2o`` key).

    Every process parses its engine's dict once: builders, impls and hooks all ask here, so a
    valid config is one shared frozen object and an invalid one raises the same error anywhere.
    """
    if not additional_config or "h2o" not in additional_config:
        return None
    data = additional_config["h2o"]
    key = repr(data)
    if key not in _parsed:
        _parsed[key] = H2OConfig.from_dict(data)
    return _parsed[key]


def h2o_config(vllm_config) -> H2OConfig | None:
    """The H2O config of a ``VllmConfig`` (None when H2O is off)."""
    return config_from_additional(vllm_config.additional_config)


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The H2O keys of one request's ``extra_args`` (``h2o_heavy_ratio`` -> ``heavy_ratio``)."""
    if not extra_args:
        return {}
    keys = request_keys()
    return {keys[k]: v for k, v in extra_args.items() if k in keys}


def request_config(base: H2OConfig, extra_args: Mapping[str, Any] | None) -> H2OConfig:
    """The config one request runs with: ``base`` with its ``extra_args`` overrides, if any."""
    overrides = request_overrides(extra_args)
    return base.with_overrides(overrides) if overrides else base


#: Decode queries a row keeps waiting on the CPU backend at most (``worker.cpu.deferred``): 16 x
#: the query group makes the tile products efficient; each costs one query vector per layer of
#: memory. Here because process 0 refuses more drafts per step than it holds (``frontend.conflicts``).
MAX_PENDING = 16

#: The environment switch of the test mode that runs H2O's CUDA path inside vLLM's CPU engine,
#: every Triton kernel interpreted (``vllm_hooks.triton_on_cpu``); here because process 0's
#: settings (``frontend.cuda_config``) read it as well as the hooks.
TRITON_ON_CPU_SWITCH = "H2O_VLLM_TRITON_ON_CPU"

#: The quantised KV caches H2O runs with, on the CUDA path only: fp8 e4m3 with per-tensor scales,
#: read as vLLM's Triton attention reads them (docs/semantics.md, "FP8 KV cache").
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def triton_on_cpu_enabled() -> bool:
    return os.environ.get(TRITON_ON_CPU_SWITCH, "0").strip().lower() in ("1", "true")
