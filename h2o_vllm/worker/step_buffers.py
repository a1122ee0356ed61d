"""Persistent device buffers for a step's per-step tensors: each named tensor is written into a
buffer allocated once per metadata builder, and handed out as a view at the same address at
every step (what a CUDA graph replays; docs/cuda.md, "What full CUDA graphs would need").

Runs in the worker process, in a metadata builder (``worker.step.kv_space_metadata``). A view
of a batch of n elements is the first n elements of its flat buffer, so its address is the
same for any batch size. Buffers are sized from the engine when first used (``reserve``:
max_num_seqs rows, max_num_batched_tokens tokens, the due pass's width) and reallocated only
if a step ever needs more, which moves that buffer once.

A name is written once per build: the views of one build stay valid until the next build of
the same builder. The step runs on the stream that wrote them (the H2D copies are ordered before
its kernels, and after the previous step's), as vLLM's own persistent metadata buffers.
"""
from __future__ import annotations

import math

import torch


class StepBuffers:
    """One builder's buffers, by name."""

    def __init__(self, device, *, rows: int, tokens: int) -> None:
        self.device = torch.device(device)
        self.rows, self.tokens = rows, tokens  # what an engine step holds at most
        self._flat: dict[str, torch.Tensor] = {}

    def put(self, name: str, t: torch.Tensor, dtype: torch.dtype = torch.int64,
            reserve: int = 0) -> torch.Tensor:
        """``t`` (host or device) as ``dtype`` in ``name``'s buffer: a contiguous view of t's shape."""
        view = self._view(name, t.shape, dtype, reserve)
        view.copy_(t, non_blocking=True)
        return view

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
              reserve: int = 0) -> torch.Tensor:
        return self._view(name, shape, dtype, reserve).zero_()

    def _view(self, name: str, shape, dtype: torch.dtype, reserve: int) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.numel() < numel:
            grown = 2 * flat.numel() if flat is not None and flat.dtype == dtype else 0
            flat = torch.empty(max(numel, reserve, grown, 1), dtype=dtype, device=self.device)
            self._flat[name] = flat
        return flat[:numel].view(shape)

    def flats(self) -> dict[str, torch.Tensor]:
        """The buffers by name (tests: what a step's tensors must live in)."""
        return dict(self._flat)


class FreshTensors:
    """``StepBuffers``' interface allocating anew at each call: steps built outside a builder
    (unit tests, benchmarks, the prefix-cache record phases, which no graph holds)."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.rows = self.tokens = 0

    def put(self, name: str, t: torch.Tensor, dtype: torch.dtype = torch.int64,
            reserve: int = 0) -> torch.Tensor:
        # A copy even where t already is on the device: the caller may write into it.
        return t.to(device=self.device, dtype=dtype, non_blocking=True, copy=True)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
              reserve: int = 0) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)
