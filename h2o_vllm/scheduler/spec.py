"""H2OAttentionSpec: the KV-cache spec that carries the H2O config to the scheduler.

Built in the worker (the engine core never sees ``vllm_config.additional_config`` in a
manager), pickled to the engine core with the other specs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

from vllm.v1.kv_cache_interface import FullAttentionSpec

from h2o_vllm.config import H2OConfig


@dataclass(frozen=True, kw_only=True)
class H2OAttentionSpec(FullAttentionSpec):
    # The default only exists because FullAttentionSpec.merge calls cls() with base fields.
    h2o: H2OConfig = H2OConfig()

    @classmethod
    def from_full(cls, spec: FullAttentionSpec, h2o: H2OConfig) -> "H2OAttentionSpec":
        return cls(**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, h2o=h2o)

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        # FullAttentionSpec.merge rebuilds from base fields only and would drop `h2o`.
        configs = {spec.h2o for spec in specs}
        if len(configs) != 1:
            raise ValueError(f"all layers of a KV-cache group must share one H2O config, got {configs}")
        return replace(super().merge(specs), h2o=configs.pop())


def h2o_specs(specs: dict, config: H2OConfig | None) -> dict:
    """The runner's KV-cache specs with each full-attention spec carrying the H2O config
    (unchanged when H2O is off)."""
    if config is None:
        return specs
    return {name: H2OAttentionSpec.from_full(spec, config) if type(spec) is FullAttentionSpec else spec
            for name, spec in specs.items()}
