"""PackedState: one rank's H2O state of a prompt as one run of bytes, as NIXL moves it.

Pure (torch and the stdlib). The producer's worker packs what ``kv_transfer.save_load.read_state``
reads (per H2O layer, in name order: K and V ``[kv_len, kv_heads, head_size]`` in the cache's
dtype, scores ``[kv_len, kv_heads]`` fp32), then a speculative drafter's layers' blocks
(``kv_transfer.save_load.read_blocks``, in name order), between two seals; the consumer's worker checks
both seals and unpacks. The scheduler sizes the run before any worker has packed it
(``packed_nbytes``), from the KV-cache spec, so the producer can reserve staging space and
name it in the request's ``kv_transfer_params`` when it finishes.

A seal is the digest of the state's key and its staging ticket: a region that was released
and written again by another state fails the check on either end, and the consumer computes
the prompt itself instead of decoding from someone else's KV.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

SEAL = 32  # bytes: a sha256 digest at each end
PARTS = ("k", "v", "scores")


def seal(key: str, ticket: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(f"{key}:{ticket}".encode()).digest()), dtype=torch.uint8)


def packed_nbytes(num_layers: int, kv_len: int, kv_heads: int, head_size: int, itemsize: int) -> int:
    return 2 * SEAL + num_layers * kv_len * kv_heads * (2 * head_size * itemsize + 4)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def pack(out: torch.Tensor, key: str, ticket: int, layers: Sequence[dict[str, torch.Tensor]],
         blocks: Sequence[torch.Tensor] = ()) -> int:
    """Write ``layers`` (each {"k", "v", "scores"}, in name order) and the whole layers'
    ``blocks`` into the uint8 tensor ``out`` between two seals; returns the bytes written."""
    mark = seal(key, ticket)
    out[:SEAL] = mark
    at = SEAL
    for t in [state[part] for state in layers for part in PARTS] + list(blocks):
        data = _bytes(t.cpu())
        out[at:at + data.numel()] = data
        at += data.numel()
    out[at:at + SEAL] = mark
    return at + SEAL


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def unpack(buf: torch.Tensor, key: str, ticket: int, names: Sequence[str], kv_len: int, kv_heads: int,
           head_size: int, dtype: torch.dtype,
           blocks: Sequence[tuple[str, tuple[int, ...], torch.dtype]] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """``pack``'s inverse: {layer name: {"k", "v", "scores"}}, and {"blocks"} for each whole
    layer of ``blocks`` (name, shape, dtype); ValueError if ``buf`` is not the state of
    ``(key, ticket)`` whole."""
    mark = seal(key, ticket)
    itemsize = torch.empty((), dtype=dtype).element_size()
    end = (packed_nbytes(len(names), kv_len, kv_heads, head_size, itemsize)
           + sum(_nbytes(shape, block_dtype) for _, shape, block_dtype in blocks))
    if buf.numel() < end or not (torch.equal(buf[:SEAL], mark) and torch.equal(buf[end - SEAL:end], mark)):
        raise ValueError(f"the bytes read are not state {key[:12]} (ticket {ticket}) whole: "
                         "the producer released or reused its staging space before they were read")
    shapes = {"k": ((kv_len, kv_heads, head_size), dtype), "v": ((kv_len, kv_heads, head_size), dtype),
              "scores": ((kv_len, kv_heads), torch.float32)}
    parts = [(name, part, *shapes[part]) for name in names for part in PARTS]
    parts += [(name, "blocks", shape, block_dtype) for name, shape, block_dtype in blocks]
    at, out = SEAL, {}
    for name, part, shape, part_dtype in parts:
        n = _nbytes(shape, part_dtype)
        out.setdefault(name, {})[part] = buf[at:at + n].clone().view(part_dtype).reshape(shape)
        at += n
    return out
