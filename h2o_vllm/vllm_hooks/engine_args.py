"""Hooks on vLLM's engine arguments: H2O flags, validation, conflicts.

Runs in the process that parses flags and builds the engine config (process 0).
"""
from __future__ import annotations

import functools

from h2o_vllm.frontend import flags, settings
from h2o_vllm.vllm_hooks import triton_on_cpu
from h2o_vllm.vllm_hooks.wrapping import _MARK, _wrap
from h2o_vllm.vllm_shims.symbols import _require


def install_engine_args_hook() -> None:
    """Validate ``additional_config["h2o"]`` and refuse conflicts before the model loads."""
    _wrap("vllm.engine.arg_utils:EngineArgs.create_engine_config", _create_engine_config_wrapper)


def _create_engine_config_wrapper(original):
    def create_engine_config(self, *args, **kwargs):
        triton_on_cpu.install()  # this process's plugin may have loaded before the switch was set
        h2o = settings.settle_engine_args(self)
        vllm_config = original(self, *args, **kwargs)
        triton_on_cpu.check_vllm_config(vllm_config)
        settings.check_engine_config(vllm_config, h2o)
        return vllm_config
    return create_engine_config


def install_cli_flags_hook() -> None:
    """Add ``--kv-eviction`` / ``--h2o-*`` to vLLM's engine parsers, folded at parse time."""
    owner, original = _require("vllm.engine.arg_utils:EngineArgs.add_cli_args")
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        flags.add_h2o_args(parser)
        _fold_after_parse(parser)
        return parser
    setattr(add_cli_args, _MARK, True)
    owner.add_cli_args = staticmethod(add_cli_args)


def _fold_after_parse(parser) -> None:
    """Make ``parser`` fold the H2O flags into ``additional_config`` as it parses.

    ``parse_known_args`` is the one method that both a top-level ``parse_args`` and a
    subcommand (argparse's ``_SubParsersAction``) go through."""
    original = parser.parse_known_args
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def parse_known_args(args=None, namespace=None):
        namespace, rest = original(args, namespace)
        try:
            flags.fold_namespace(namespace)
        except flags.FlagError as exc:
            parser.error(str(exc))
        return namespace, rest
    setattr(parse_known_args, _MARK, True)
    parser.parse_known_args = parse_known_args

