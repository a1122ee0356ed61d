"""H2OAttentionSpec: the KV-cache spec that carries the H2O config to the scheduler.

Built in the worker (the engine core never sees ``vllm_config.additional_config`` in a
manager), pickled to the engine core with the other specs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

from vllm.v1.kv_cache_interface import FullAttentionSpec

from h2o_vllm.config import H2OConfig
from h2o_vllm.policy import engine_peak_blocks


@dataclass(frozen=True, kw_only=True)
class H2OAttentionSpec(FullAttentionSpec):
    # The default only exists because FullAttentionSpec.merge calls cls() with base fields.
    h2o: H2OConfig = H2OConfig()

    @classmethod
    def from_full(cls, spec: FullAttentionSpec, h2o: H2OConfig) -> "H2OAttentionSpec":
        return cls(**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, h2o=h2o)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """What vLLM's start-up check asks the KV pool to hold for one request of
        ``max_model_len`` tokens. Held whole, a prompt needs all of it (vLLM's answer); with
        ``prefill_chunk`` a request holds at most its peak (``policy.engine_peak_blocks``), so
        an engine whose ``max_model_len`` exceeds the pool starts when that peak fits."""
        if self.h2o.prefill_chunk is None:
            return super().max_memory_usage_bytes(vllm_config)
        blocks = engine_peak_blocks(self.h2o, vllm_config.model_config.max_model_len, self.block_size,
                                    bool(vllm_config.cache_config.enable_prefix_caching))
        return min(blocks * self.page_size_bytes, super().max_memory_usage_bytes(vllm_config))

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        # vLLM tells uniform models from hybrid ones by whether the first layer's merge raises
        # AssertionError (``is_kv_cache_spec_uniform``): a hybrid model whose first layer is
        # full attention lands here with sliding-window specs in the list.
        if not all(isinstance(spec, H2OAttentionSpec) for spec in specs):
            raise AssertionError("H2O layers share a KV-cache group only with H2O layers")
        # FullAttentionSpec.merge rebuilds from base fields only and would drop `h2o`.
        configs = {spec.h2o for spec in specs}
        if len(configs) != 1:
            raise ValueError(f"all layers of a KV-cache group must share one H2O config, got {configs}")
        return replace(super().merge(specs), h2o=configs.pop())


def h2o_specs(specs: dict, config: H2OConfig | None, whole: frozenset[str] = frozenset()) -> dict:
    """The runner's KV-cache specs with each full-attention spec carrying the H2O config
    (unchanged when H2O is off). The layers in ``whole`` (a speculative drafter's own) keep
    vLLM's spec: H2O leaves their KV cache whole, in KV-cache groups of their own."""
    if config is None:
        return specs
    return {name: H2OAttentionSpec.from_full(spec, config)
            if type(spec) is FullAttentionSpec and name not in whole else spec
            for name, spec in specs.items()}


def is_h2o_spec(spec) -> bool:
    """Whether a KV-cache group's (or layer's) spec is H2O's; vLLM gives a group of layers of
    one type but different shapes a ``UniformTypeKVCacheSpecs``."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict):
        return bool(inner) and all(isinstance(s, H2OAttentionSpec) for s in inner.values())
    return isinstance(spec, H2OAttentionSpec)
