"""An attention layer's per-tensor fp8 KV-cache scales, read where vLLM keeps them.

Runs in the worker process. vLLM's attention layer holds them on the host as
``_k_scale_float`` / ``_v_scale_float`` (the ``AttentionLayer`` protocol's names): 1.0 unless a
checkpoint's calibrated scales replace them once the weights have loaded. H2O's CUDA path reads
an fp8 cache as ``fp8 * scale`` with them (``worker.cuda.ops``); vLLM's Triton attention reads
the same values from their device twins. ``tests/unit/vllm_hooks/test_vllm_hooks_contract.py``
fails when vLLM renames them.
"""
from __future__ import annotations


def kv_scales(layer) -> tuple[float, float]:
    """(k_scale, v_scale) of ``layer`` (vLLM's attention layer) as floats."""
    return float(layer._k_scale_float), float(layer._v_scale_float)
