"""How the engine's KV cache stores K and V, so the oracle attends over what the engine reads.

Runs in the caller's process; torch only. An unquantised cache stores K/V as computed (the
oracle's fp32 equals the engine's for fp32 models). An fp8 cache (vLLM's ``kv_cache_dtype``
``fp8`` / ``fp8_e4m3``, per-tensor scales) stores ``x / scale`` cast to float8_e4m3fn and reads
back ``fp8 * scale``: vLLM's Triton writer divides in fp32 and converts round-to-nearest-even,
saturating at the largest finite value (the GPU's ``cvt.rn.satfinite``), and its attention
multiplies by the scale after the load. The oracle rounds each K/V once, as it is appended:
every later query, its own step's included, sees the rounded values, as in the engine, where a
step writes its K/V before it attends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoredKV:
    """``dtype`` None: stored as computed; else the cache's element type with the per-tensor
    ``k_scale`` / ``v_scale`` (vLLM's ``_k_scale`` / ``_v_scale``, 1.0 unless calibrated)."""
    dtype: torch.dtype | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def round(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 keys and values as the cache would give them back."""
        if self.dtype is None:
            return keys, values
        return through(keys, self.dtype, self.k_scale), through(values, self.dtype, self.v_scale)


def through(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """fp32 ``x`` stored as ``dtype`` with ``scale`` and read back: saturated to the type's
    finite range, rounded to nearest even."""
    largest = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-largest, largest).to(dtype).float() * scale


#: vLLM's fp8 ``kv_cache_dtype`` names stored with per-tensor scales: the e4m3 format.
FP8_E4M3 = StoredKV(torch.float8_e4m3fn)
