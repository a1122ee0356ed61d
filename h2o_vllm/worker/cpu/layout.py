"""Views of the CPU paged KV cache as the stock kernels store it (the ``vec``/``vec16`` ISAs).

Per (block, KV head) the page is [K | V]; K is stored transposed [head_size, block_size],
V row-major [block_size, head_size] (csrc/cpu/cpu_attn_vec.hpp, verified by round trip).
An fp8 cache (bytes; the ``vec`` ISA only) has the same layout, one byte an element: H2O's views
of it are typed ``fp8_dtype``, the stock kernel's stay bytes, as vLLM's kernels require.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class CacheViews(NamedTuple):
    key_cache: torch.Tensor    # the stock kernel's view (an fp8 cache's bytes)
    value_cache: torch.Tensor  # the stock kernel's view
    key_blocks: torch.Tensor   # [num_blocks, num_kv_heads, head_size, block_size]: K as stored
    keys: torch.Tensor         # [num_blocks, block_size, num_kv_heads, head_size] view of K
    values: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_size] view of V


def cache_views(kv_cache: torch.Tensor, fp8_dtype: torch.dtype | None = None) -> CacheViews:
    """kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]; fp8_dtype: an fp8
    cache's element type (None: unquantised)."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    if fp8_dtype is not None:
        kv_cache = kv_cache.view(fp8_dtype)
    regions = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)
    key_blocks = regions[:, :, 0].view(num_blocks, num_kv_heads, head_size, block_size)
    keys = key_blocks.permute(0, 3, 1, 2)
    values = regions[:, :, 1].view(num_blocks, num_kv_heads, block_size, head_size).permute(0, 2, 1, 3)
    return CacheViews(key_cache, value_cache, key_blocks, keys, values)
