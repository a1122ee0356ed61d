"""RunnerState: what H2O keeps for one model runner from step to step.

Runs in the worker process. The runner hooks (``vllm_hooks.runner``) own one per model runner,
made on its first real step, and hand it every step's inputs explicitly; nothing about a step
lives anywhere else. A step goes: ``begin_step`` (the scheduler's orders for this step; the rows
that compacted into fresh blocks last step, to rewrite now), ``plan`` (the batch's ``StepPlan``),
``compacted_rows`` (what to truncate once the metadata is built). Pure: no vLLM import.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.prefix_orders import PrefixOrders
from h2o_vllm.worker.plan import StepPlan, plan_batch, rows_to_truncate


@dataclass(frozen=True)
class BatchRows:
    """A batch as both runners read it: row i is request ``req_ids[i]``. All int64 [num_reqs]."""
    req_ids: Sequence[str]
    num_computed: torch.Tensor
    prompt_lens: torch.Tensor
    query_lens: torch.Tensor
    live_request_ids: Iterable[str]


@dataclass
class RunnerState:
    budgets: RequestBudgets
    #: (KV-cache group id, block size) of each H2O KV-cache group of the runner.
    groups: tuple[tuple[int, int], ...]
    #: Layer name -> KV-cache group id, for the H2O groups' layers (``worker.building``).
    layer_groups: Mapping[str, int] = field(default_factory=dict)
    #: This step's prefix-cache orders (the scheduler's), by KV-cache group; None without any.
    orders: Mapping[int, PrefixOrders] | None = None
    #: Requests whose KV cache is gone or rebuilt as of this step (``StepPlan.void_ids``).
    void_ids: frozenset[str] = frozenset()
    #: (request, group id) -> fresh blocks: rows that compacted into fresh blocks this step and
    #: become them at the next (not earlier: on the CPU the block table is the tensor this
    #: step's kernels still read).
    rewrites: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    #: request -> its speculative draft tokens this step (the scheduler's; empty without any).
    drafts: Mapping[str, int] = field(default_factory=dict)
    #: request -> its H2O prompt length where it is shorter than vLLM's (a KV-transfer
    #: consumer's request, ``TransferOrders.prompt_lens``); the scheduler's, this step.
    prompt_lens: Mapping[str, int] = field(default_factory=dict)

    def begin_step(self, orders: Mapping[int, PrefixOrders] | None, void_ids: Iterable[str],
                   drafts: Mapping[str, int] | None = None, prompt_lens: Mapping[str, int] | None = None,
                   new_requests: Iterable[tuple[str, int, Any]] = ()) -> dict[tuple[str, int], list[int]]:
        """Take this step's scheduler inputs; returns the rewrites due before vLLM appends the
        step's new blocks (last step's, once). ``new_requests``: (request, vLLM's prompt length,
        sampling params) of each request the scheduler sends for the first time, whose budget
        is resolved here, the worker's one point of resolution."""
        due, self.rewrites = self.rewrites, {}
        self.orders, self.void_ids, self.drafts = orders, frozenset(void_ids), drafts or {}
        self.prompt_lens = prompt_lens or {}
        for req_id, prompt_len, params in new_requests:
            self.budgets.resolve(req_id, self.prompt_lens.get(req_id, prompt_len), params)
        return due

    def plan(self, rows: BatchRows) -> StepPlan:
        draft_lens = None
        if self.drafts:
            draft_lens = torch.tensor([self.drafts.get(r, 0) for r in rows.req_ids], dtype=torch.int64)
        prompt_lens = rows.prompt_lens
        if self.prompt_lens:
            prompt_lens = torch.tensor([self.prompt_lens.get(r, int(n)) for r, n in zip(rows.req_ids, prompt_lens)],
                                       dtype=torch.int64)
        return plan_batch(self.budgets, rows.req_ids, rows.num_computed, prompt_lens,
                          rows.query_lens, rows.live_request_ids,
                          orders=self.orders, void_ids=self.void_ids, draft_lens=draft_lens)

    def compacted_rows(self, plan: StepPlan) -> Iterator[tuple[int, int, int, list[int] | None]]:
        """(group id, row, blocks kept, fresh blocks or None) of each row ``plan`` compacts, in
        every H2O group; a row that compacts into fresh blocks is kept for the next step's
        ``begin_step``."""
        for group_id, block_size in self.groups:
            for row, keep, fresh in rows_to_truncate(plan.for_group(group_id), block_size):
                if fresh is not None:
                    self.rewrites[plan.req_ids[row], group_id] = fresh
                yield group_id, row, keep, fresh
