"""What the devices' query books share: the CPU's waiting decode queries (``cpu.deferred``) and
the CUDA path's held draft queries (``cuda.drafts``) both keep a request's queries from one step
to a later one, in a per-layer buffer with one slot per request.

Runs in the worker process.
"""
from __future__ import annotations

from typing import Generic, TypeVar

import torch

from h2o_vllm.worker.plan import StepPlan
from h2o_vllm.worker.step import H2OStep

Decision = TypeVar("Decision")


class QueryBook(Generic[Decision]):
    """Which request keeps queries in which slot. A slot given back is reused first, so the
    buffers grow only to the most requests holding queries at once (``_capacity``). One
    decision per step, however many times vLLM builds the step's metadata."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._capacity = 0
        self._last: tuple[StepPlan, Decision | None] | None = None

    def decide(self, step: H2OStep) -> Decision | None:
        """This step's decision; None when there is nothing to keep or score."""
        plan = step.plan
        if self._last is not None and self._last[0] is plan:  # built twice for one step
            return self._last[1]
        decision = self._decide(step) if self._has_work(plan) else None
        self._last = (plan, decision)
        return decision

    def _has_work(self, plan: StepPlan) -> bool:
        return bool(plan.req_ids)  # a plan naming no requests: a unit test's step

    def _decide(self, step: H2OStep) -> Decision | None:
        raise NotImplementedError

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        self._capacity += 1
        return self._capacity - 1

    def _give_back(self, slot: int) -> None:
        self._free.append(slot)


def grown(buffer: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``buffer``, or a zeroed one of ``like``'s dtype and device at least ``shape`` with
    ``buffer`` in its leading corner (slots double, so a growing batch reallocates rarely)."""
    if buffer is not None and all(a >= b for a, b in zip(buffer.shape, shape)):
        return buffer
    old = buffer.shape if buffer is not None else (0,) * len(shape)
    new = like.new_zeros(max(shape[0], 2 * old[0]), *(max(a, b) for a, b in zip(old[1:], shape[1:])))
    if buffer is not None:
        new[tuple(slice(0, n) for n in old)] = buffer
    return new
