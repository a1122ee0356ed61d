"""``--kv-eviction`` / ``--h2o-*`` command-line flags, folded into ``additional_config["h2o"]``.

Runs in process 0 (API server, ``vllm bench``), at argument parsing. Pure: argparse and
``h2o_vllm.config`` only; ``vllm_hooks.install_cli_flags_hook`` attaches it to vLLM's parser.

Rules (docs/serving.md, "Flags"):
- ``--kv-eviction h2o`` turns H2O on; ``--h2o-*`` flags alone also turn it on (a budget flag
  states the intent unambiguously); ``--kv-eviction none`` with an ``--h2o-*`` flag or with an
  ``h2o`` entry in ``--additional-config`` is an error.
- A flag and ``--additional-config '{"h2o": {...}}'`` may both be given; a key set both ways
  to different values (or one budget part given as a ratio one way and as tokens the other)
  is an error, never a silent override.
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping

from h2o_vllm import score_modes
from h2o_vllm.config import H2OConfig

GROUP_TITLE = "H2O KV eviction"
#: The help of each budget key's flag; each score mode's comes from its class (``score_modes``).
_HELP = {
    "heavy_ratio": "Heavy-hitter budget as a fraction of the prompt length, in [0, 1] (default 0.1).",
    "recent_ratio": "Recent-window budget as a fraction of the prompt length, in [0, 1] (default 0.1).",
    "heavy_tokens": "Heavy-hitter budget in tokens per (layer, KV head); instead of --h2o-heavy-ratio.",
    "recent_tokens": "Recent-window budget in tokens per (layer, KV head); instead of --h2o-recent-ratio.",
    "interval": "Compact each time the cache has grown this many tokens past the budget "
                "(>= 1; default one KV block; 1 is the paper's per-step eviction).",
    "sink_tokens": "Always keep the first INT tokens (attention sinks, StreamingLLM), in addition "
                   "to the heavy and recent budgets; default 0.",
    "min_tokens": "Never compact below INT tokens: a smaller budget gets a longer recent window "
                  "(short prompts under a ratio budget); default 32 for a budget with a ratio "
                  "part, 0 for one in tokens; 0 is the paper's rule.",
    "prefill_chunk": "Process prompts in chunks of INT tokens and evict between them, so a "
                     "request holds about budget + interval + INT tokens, not its prompt (and "
                     "max-model-len may exceed the KV pool); default: a prompt is held whole.",
}
_FLOAT_KEYS = ("heavy_ratio", "recent_ratio")


def flags() -> dict[str, str]:
    """H2OConfig key -> flag, every key (the registry's score modes as they are now)."""
    return {key: "--h2o-" + key.replace("_", "-") for key in H2OConfig.keys()}


def _help(key: str) -> tuple[str, type]:
    """(the flag's help, the type of its value: ``float``, ``int`` or ``str``, a name)."""
    mode = score_modes.by_key().get(key)
    if mode is None:
        return _HELP[key], float if key in _FLOAT_KEYS else int
    return mode.help, mode.number


def _choices(key: str) -> tuple[str, ...] | None:
    """The valid values of a key whose value is a name (``ScoreMode.choices``)."""
    mode = score_modes.by_key().get(key)
    return None if mode is None else mode.choices()


_METAVARS = {float: "FLOAT", int: "INT"}

#: Set on a parser that has the group: argparse lists its groups only in a private attribute.
_ADDED = "h2o_vllm_flags_added"


class FlagError(ValueError):
    """A bad or conflicting H2O flag; the message starts with the flag's name."""


def _checked(key: str):
    number = _help(key)[1]
    if number is str:
        return str  # argparse checks the name against the flag's choices, and names them

    def parse(text: str):
        try:
            value = number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a number' if number is float else 'an integer'}, "
                                             f"got {text!r}") from None
        try:
            H2OConfig(**{key: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    parse.__name__ = number.__name__  # argparse names the type in its messages
    return parse


def add_h2o_args(parser: argparse.ArgumentParser) -> None:
    """Add the "H2O KV eviction" group to a vLLM engine-argument parser, once per parser."""
    if getattr(parser, _ADDED, False):
        return
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="H2O (Heavy-Hitter Oracle) KV-cache eviction from the h2o-vllm plugin. The flags "
                    "fold into --additional-config '{\"h2o\": {...}}'; per request, vllm_xargs "
                    "h2o_<key> (h2o_heavy_ratio, h2o_interval, h2o_sink_tokens, ...) overrides them.")
    group.add_argument("--kv-eviction", choices=["none", "h2o"], default=None,
                       help="KV-cache eviction policy: 'h2o' keeps heavy hitters plus recent tokens. "
                            "Default: 'h2o' when any --h2o-* flag or an 'h2o' entry of "
                            "--additional-config is given, else 'none'.")
    for key, flag in flags().items():
        text, number = _help(key)
        choices = _choices(key)
        group.add_argument(flag, dest=f"h2o_{key}", type=_checked(key), default=None, choices=choices,
                           metavar=_METAVARS[number] if choices is None else None, help=text)
    setattr(parser, _ADDED, True)


def fold(kv_eviction: str | None, values: Mapping[str, Any],
         additional_config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``additional_config`` that the flags mean; raises ``FlagError`` naming the flag.

    ``values``: H2OConfig key -> flag value (None when the flag was not given).
    """
    given = {key: value for key, value in values.items() if value is not None}
    existing = additional_config.get("h2o") if additional_config else None
    if kv_eviction == "none":
        if given:
            raise FlagError(f"{flags()[next(iter(given))]} needs H2O on, but --kv-eviction is none; "
                            "drop one of them")
        if existing is not None:
            raise FlagError("--kv-eviction none conflicts with the 'h2o' entry of --additional-config; "
                            "drop one of them")
        return None if additional_config is None else dict(additional_config)
    if kv_eviction is None and not given:
        return None if additional_config is None else dict(additional_config)
    if existing is not None and not isinstance(existing, Mapping):
        raise FlagError(f"--additional-config: 'h2o' must be a dict of H2O settings, got "
                        f"{type(existing).__name__}")
    merged = dict(existing or {})
    names = flags()
    for key, value in given.items():
        part = key.rpartition("_")[0]
        other = f"{part}_tokens" if key.endswith("_ratio") else f"{part}_ratio"
        if key in merged and merged[key] != value:
            raise FlagError(f"{names[key]} {value} conflicts with --additional-config h2o.{key}="
                            f"{merged[key]!r}; give it one way")
        if key in ("heavy_ratio", "recent_ratio", "heavy_tokens", "recent_tokens") and other in merged:
            raise FlagError(f"{names[key]} conflicts with --additional-config h2o.{other}: give the "
                            f"{part} budget one way")
        merged[key] = value
    try:
        H2OConfig.from_dict(merged)
    except ValueError as exc:
        where = ", ".join(names[key] for key in given) or "--additional-config"
        raise FlagError(f"{where}: {exc}") from None
    return {**(additional_config or {}), "h2o": merged}


def fold_namespace(args: argparse.Namespace) -> None:
    """Fold parsed H2O flags into ``args.additional_config`` in place (idempotent)."""
    if not hasattr(args, "kv_eviction"):
        return
    values = {key: getattr(args, f"h2o_{key}", None) for key in flags()}
    folded = fold(args.kv_eviction, values, getattr(args, "additional_config", None))
    if folded is not None:
        args.additional_config = folded
