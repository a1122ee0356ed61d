"""Which KV-cache groups H2O's connectors move, read from vLLM's ``KVCacheConfig`` when a
connector is built (the engine has loaded the model and formed its groups; no request has
run): the H2O groups, whose kept state travels, and a speculative drafter's groups, which
H2O leaves whole and which travel as the blocks that hold the prompt. Anything else is
refused there, naming the way out.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from h2o_vllm.spec import H2OAttentionSpec


def _groups(kv_cache_config) -> list[tuple[int, Any]]:
    return list(enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else ()))


def h2o_groups(kv_cache_config) -> list[tuple[int, Any]]:
    """(index, group) of each H2O KV-cache group: vLLM splits a target into several beside a
    drafter with fewer layers (it groups layers in equal numbers: an EAGLE head's one layer
    beside a 30-layer target makes 30). Every group runs the same plan; each has its own
    blocks (``KVMove.block_ids``, in this order)."""
    return [(g, group) for g, group in _groups(kv_cache_config) if isinstance(group.kv_cache_spec, H2OAttentionSpec)]


def whole_groups(kv_cache_config) -> list[tuple[int, Any]]:
    """(index, group) of each KV-cache group H2O leaves whole: a speculative drafter's own
    layers (a hybrid model's window groups are refused beside a connector before load,
    ``kv_transfer.transfer_config.check_model``). Their prompt travels as whole blocks."""
    h2o = {g for g, _ in h2o_groups(kv_cache_config)}
    whole = [(g, group) for g, group in _groups(kv_cache_config) if g not in h2o]
    for _, group in whole:
        if not isinstance(group.kv_cache_spec, FullAttentionSpec):
            raise ValueError(f"H2O's KV connector moves H2O's state and full-attention layers kept whole; "
                             f"{type(group.kv_cache_spec).__name__} layers ({', '.join(group.layer_names[:3])}) "
                             "would need a transfer of their own: drop --kv-transfer-config, or turn H2O KV "
                             "eviction off (drop --kv-eviction h2o / additional_config['h2o'])")
    return whole


def by_pool_block(cache: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """A whole layer's view, as vLLM hands ``register_kv_caches`` (block-major ``[B, H, N, C]``),
    with one row per block of the pool. Where the layer's backend takes smaller blocks than the
    pool's, vLLM's view counts its kernel blocks, each pool block's in a run (vLLM splits only
    dense pages): those rows are folded into one."""
    if cache.shape[0] % num_blocks:
        raise RuntimeError(f"H2O's KV connector: vLLM's KV cache view of {name} has {cache.shape[0]} blocks in "
                           f"its first dimension, for a pool of {num_blocks}: this vLLM lays out a connector's "
                           "views otherwise than 0.32 did")
    return cache if cache.shape[0] == num_blocks else cache.unflatten(0, (num_blocks, -1))
