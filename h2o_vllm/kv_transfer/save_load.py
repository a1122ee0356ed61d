"""A prompt's H2O state in and out of the paged cache: the worker's side of KV transfer.

Runs in the worker process; imports no vLLM. ``save`` runs after a step's forward, when every
layer has written, scored and compacted the prompt (``worker.step``), so what it reads is
exactly what the producer's engine keeps; ``load`` runs before the consumer's forward, into
the blocks the scheduler allocated. Both go through the device's ``cache_views`` (the CPU's
transposed K pages, Triton's layout, fp8 bytes alike) and the layer's score buffer, in the
device-neutral layout ``[kv_len, kv_heads, head_size]`` (scores ``[kv_len, kv_heads]``).
The medium is the caller's: ``write`` / ``read`` take a move's tensors to or from a file
(``KVStore``) or NIXL staging (``kv_transfer.nixl_transport``), named ``<layer>.<k|v|scores>``.

A speculative drafter's own layers (a draft model's, EAGLE's, MTP's) keep vLLM's attention and
their KV cache whole, so their prompt is whole blocks by position: they travel as the blocks
that hold it, ``<layer>.blocks`` ``[n, ...]`` in vLLM's per-block layout (block-major views,
the ones vLLM hands a connector's ``register_kv_caches``), read and written whatever the
backend's layout within a block. The save runs after the drafter has written the prompt:
with a speculator vLLM calls ``wait_for_save`` once the draft pass is done, on both runners.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from h2o_vllm.kv_transfer.orders import KVMove, TransferOrders


class StatefulLayer(Protocol):
    """An H2O attention layer as transfer sees it (``H2OImplMixin.cache_state``)."""

    def cache_state(self, kv_cache: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """(the device's views of ``kv_cache``, the layer's score buffer)."""


#: An H2O layer to move: (name, the layer, its KV cache, its H2O group's index in
#: ``KVMove.block_ids``).
H2OLayer = tuple[str, StatefulLayer, torch.Tensor, int]


def _slots(block_ids: tuple[int, ...], kv_len: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(kv_len)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return blocks.to(device), (pos % block_size).to(device)


def read_state(views, scores: torch.Tensor, block_ids: tuple[int, ...], kv_len: int) -> dict[str, torch.Tensor]:
    """K, V and scores of live positions ``[0, kv_len)`` in ``block_ids``, on the CPU."""
    blocks, offsets = _slots(block_ids, kv_len, views.keys.shape[1], views.keys.device)
    return {"k": views.keys[blocks, offsets].cpu(), "v": views.values[blocks, offsets].cpu(),
            "scores": scores[blocks, :, offsets].cpu()}


def write_state(views, scores: torch.Tensor, block_ids: tuple[int, ...], kv_len: int,
                state: dict[str, torch.Tensor]) -> None:
    """``read_state``'s inverse: the positions' K, V and scores into ``block_ids``."""
    device = views.keys.device
    blocks, offsets = _slots(block_ids, kv_len, views.keys.shape[1], device)
    views.keys[blocks, offsets] = state["k"].to(device, views.keys.dtype)
    views.values[blocks, offsets] = state["v"].to(device, views.values.dtype)
    scores[blocks, :, offsets] = state["scores"].to(device, torch.float32)


#: A whole layer as transfer sees it: (name, its group's index in ``KVMove.whole``, its
#: block-major KV cache view).
WholeLayer = tuple[str, int, torch.Tensor]


def read_blocks(cache: torch.Tensor, block_ids: tuple[int, ...]) -> torch.Tensor:
    """The blocks ``block_ids`` of a block-major cache view, on the CPU."""
    return cache[torch.tensor(block_ids, dtype=torch.int64, device=cache.device)].cpu()


def write_blocks(cache: torch.Tensor, block_ids: tuple[int, ...], blocks: torch.Tensor) -> None:
    cache[torch.tensor(block_ids, dtype=torch.int64, device=cache.device)] = blocks.to(cache.device, cache.dtype)


def save(orders: TransferOrders, layers: Iterable[H2OLayer],
         write: Callable[[KVMove, dict[str, torch.Tensor]], int], whole: Iterable[WholeLayer] = ()) -> int:
    """Each ordered save's tensors of this rank's heads to ``write``; returns the bytes written."""
    if not orders.saves:
        return 0
    states = [(name, *layer.cache_state(kv_cache), group) for name, layer, kv_cache, group in layers]
    whole = list(whole)
    written = 0
    for move in orders.saves:
        tensors = {}
        for name, views, scores, group in states:
            state = read_state(views, scores, move.block_ids[group], move.kv_len)
            tensors.update({f"{name}.{part}": t for part, t in state.items()})
        for name, group, cache in whole:
            tensors[f"{name}.blocks"] = read_blocks(cache, move.whole[group])
        written += write(move, tensors)
    return written


def load(orders: TransferOrders, layers: Iterable[H2OLayer],
         read: Callable[[KVMove], dict[str, torch.Tensor]], whole: Iterable[WholeLayer] = ()) -> None:
    """Each ordered load from ``read`` (the scheduler checked the state is whole)."""
    if not orders.loads:
        return
    states = [(name, *layer.cache_state(kv_cache), group) for name, layer, kv_cache, group in layers]
    whole = list(whole)
    for move in orders.loads:
        stored = read(move)
        for name, views, scores, group in states:
            write_state(views, scores, move.block_ids[group], move.kv_len,
                        {part: stored[f"{name}.{part}"] for part in ("k", "v", "scores")})
        for name, group, cache in whole:
            write_blocks(cache, move.whole[group], stored[f"{name}.blocks"])
