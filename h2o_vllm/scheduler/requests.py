"""Per-request H2O configs on the scheduler side (budgets from ``SamplingParams.extra_args``).

Runs in the engine-core process. A single-type KV-cache manager only sees request ids, so
the scheduler hook records here the config of each request that overrides the engine's.
"""
from __future__ import annotations

from h2o_vllm.config import H2OConfig

_configs: dict[str, H2OConfig] = {}


def record(request_id: str, config: H2OConfig) -> None:
    _configs[request_id] = config


def forget(request_id: str) -> None:
    _configs.pop(request_id, None)


def config_for(request_id: str, default: H2OConfig) -> H2OConfig:
    return _configs.get(request_id, default)
