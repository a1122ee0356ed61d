"""How the engine's KV cache stores K and V, so the oracle attends over what the engine reads.

Runs in the caller's process; torch only. An unquantised cache stores K/V as computed (the
oracle's fp32 equals the engine's for fp32 models). An fp8 cache (vLLM's ``kv_cache_dtype``
``fp8`` / ``fp8_e4m3``, per-tensor scales) stores ``x / scale`` cast to float8_e4m3fn and reads
back ``fp8 * scale``: vLLM's Triton writer divides in fp32 and converts round-to-nearest-even,
saturating at the largest finite value (the GPU's ``cvt.rn.satfinite``), and its attention
multiplies by the scale after the load. vLLM's CPU writer (``cpu_attn_reshape_and_cache``, the
``vec`` ISA) stores the same e4m3 format but truncates: it rounds toward zero, also saturating
(``FP8_E4M3_CPU``; ``tests/unit/vllm_hooks`` fails when vLLM's writer changes its rule). The
oracle rounds each K/V once, as it is appended:
every later query, its own step's included, sees the rounded values, as in the engine, where a
step writes its K/V before it attends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoredKV:
    """``dtype`` None: stored as computed; else the cache's element type with the per-tensor
    ``k_scale`` / ``v_scale`` (vLLM's ``_k_scale`` / ``_v_scale``, 1.0 unless calibrated),
    rounded to nearest even or, with ``toward_zero``, truncated."""
    dtype: torch.dtype | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    toward_zero: bool = False

    def round(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 keys and values as the cache would give them back."""
        if self.dtype is None:
            return keys, values
        return (through(keys, self.dtype, self.k_scale, self.toward_zero),
                through(values, self.dtype, self.v_scale, self.toward_zero))


def through(x: torch.Tensor, dtype: torch.dtype, scale: float, toward_zero: bool = False) -> torch.Tensor:
    """fp32 ``x`` stored as ``dtype`` with ``scale`` and read back: saturated to the type's
    finite range, rounded to nearest even or (``toward_zero``) truncated."""
    return stored(x, dtype, scale, toward_zero).float() * scale


def stored(x: torch.Tensor, dtype: torch.dtype, scale: float, toward_zero: bool = False) -> torch.Tensor:
    """``x / scale`` (fp32) as the cache's ``dtype`` element: saturated, then rounded to nearest
    even or (``toward_zero``) truncated."""
    largest = torch.finfo(dtype).max
    x = (x.float() / scale).clamp(-largest, largest)
    nearest = x.to(dtype)
    if not toward_zero:
        return nearest
    # Where nearest rounded away from zero, the next code toward zero is the truncation: an fp8
    # code's magnitude grows with its low seven bits, and the sign is the top bit.
    codes = nearest.view(torch.uint8).clone()
    codes[nearest.float().abs() > x.abs()] -= 1
    return codes.view(dtype)


#: vLLM's fp8 ``kv_cache_dtype`` names stored with per-tensor scales: the e4m3 format, as the
#: GPU's writer (and H2O's interpreted CUDA path) rounds it.
FP8_E4M3 = StoredKV(torch.float8_e4m3fn)
#: The same format as vLLM's CPU writer stores it: truncated.
FP8_E4M3_CPU = StoredKV(torch.float8_e4m3fn, toward_zero=True)
