"""How a layer's paged cache stores K/V, for H2O's own reads of it: as computed, or as fp8 (e4m3)
with the layer's per-tensor scales.

Runs in the worker process. vLLM allocates an fp8 cache as bytes; each device's ``DeviceOps``
views it as ``fp8_dtype`` and reads an element back as ``fp8 * scale``, as vLLM's attention of
that device does. The scales are vLLM's (``vllm_shims.kv_scales``): 1.0 unless a checkpoint
calibrated them, set once the weights have loaded, so they are read at every forward (two
floats), never trusted from before.
"""
from __future__ import annotations

import torch

from h2o_vllm.vllm_shims.kv_scales import kv_scales


class StoredKVReads:
    """The part of a device's ``DeviceOps`` that knows the cache's element type and scales."""

    def __init__(self, fp8_dtype: torch.dtype | None = None) -> None:
        self.fp8_dtype = fp8_dtype  # an fp8 cache's element type; None: unquantised
        self.k_scale = self.v_scale = 1.0

    def read_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """fp32 keys gathered from the cache (any shape), as the attention reads them: an fp8
        cache's as ``fp8 * k_scale`` (exact for the tests' scale 1.0: e4m3 converts to fp32
        exactly), an unquantised cache's as stored."""
        keys = keys.to(torch.float32)
        return keys if self.fp8_dtype is None else keys * self.k_scale

    def read_values(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 values gathered from the cache, as ``read_keys`` reads keys (``v_scale``)."""
        values = values.to(torch.float32)
        return values if self.fp8_dtype is None else values * self.v_scale

    def read_scales(self, layer) -> None:
        """The layer's fp8 scales, at each forward (``layer``: vLLM's attention layer)."""
        if self.fp8_dtype is not None:
            self.k_scale, self.v_scale = kv_scales(layer)
