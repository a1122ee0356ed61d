"""Verification steps on the CUDA path: a row's queries are held one step, until vLLM has said
which drafts it accepted (docs/semantics.md, "Speculative decoding").

Runs in the worker process. The fused attention scores every query of a step at once, so a
verification row runs in it with query weights 0 (``StepPlan.draft_lens``: attention output
only) and each layer keeps the row's queries (``HeldQueries``). At the row's next step, before
that step's attention, the queries whose token is still in the cache (the known token's and
the accepted drafts') are scored one after another, each over the keys it saw, with the
decode score kernel; the rest are dropped. ``DraftBook`` (one per KV-cache group, in the
metadata builder) decides this once per step for every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_vllm import kernels  # launchers load lazily, with Triton (kernels.__init__)
from h2o_vllm.worker.query_book import QueryBook, grown
from h2o_vllm.worker.step import H2OStep


@dataclass(frozen=True)
class HeldScoring:
    """Held queries scored before this step's attention: ``num_queries`` passes, pass ``t``
    scoring each row's ``t``-th held query over ``kv_lens[t]`` keys (0: nothing to score)."""
    rows: torch.Tensor          # int64 [F], device: batch rows
    slots: torch.Tensor         # int64 [F], device
    kv_lens: torch.Tensor       # int32 [T, F], device
    query_scale: torch.Tensor | None  # fp32 [F], device: each query's score scale; None: paper H2O


@dataclass(frozen=True)
class DraftStep:
    """One step's decision, the same for every layer of the group."""
    capacity: int                       # slots the layers' buffers must hold
    width: int                          # queries a slot must hold
    score: HeldScoring | None
    store_tokens: torch.Tensor | None   # int64 [S], device: queries of this step's verification rows
    store_slots: torch.Tensor | None
    store_pos: torch.Tensor | None


class DraftBook(QueryBook[DraftStep]):
    """Which request's queries are held where, from one step to the next."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[str, tuple[int, list[int]]] = {}  # request -> (slot, keys each query saw)
        self._width = 1

    def _has_work(self, plan) -> bool:
        return bool(plan.req_ids) and (plan.draft_lens is not None or bool(self._held))

    def _decide(self, step: H2OStep) -> DraftStep | None:
        plan = step.plan
        for req_id in plan.void_ids:  # finished, preempted or resumed: its cache is gone or new
            self._release(req_id)
        kv_before = plan.kv_lens_before.tolist()
        drafts = [0] * len(kv_before) if plan.draft_lens is None else plan.draft_lens.tolist()
        q_lens, starts = plan.query_lens.tolist(), plan.query_starts.tolist()
        scored: list[tuple[int, int, list[int]]] = []
        stored: list[tuple[int, int, int]] = []
        for row, req_id in enumerate(plan.req_ids):
            held = self._held.pop(req_id, None)
            if held is not None:
                slot, kv_lens = held
                kept = [n for n in kv_lens if n <= kv_before[row]]  # a rejected draft saw itself
                if kept:
                    scored.append((row, slot, kept))
                self._give_back(slot)
            if drafts[row]:
                slot = self._take_slot()
                self._held[req_id] = (slot, [kv_before[row] + j + 1 for j in range(q_lens[row])])
                self._width = max(self._width, q_lens[row])
                stored.extend((starts[row] + j, slot, j) for j in range(q_lens[row]))
        if not scored and not stored:
            return None
        device = step.block_table.device
        to = lambda xs, dtype=torch.int64: torch.tensor(xs, dtype=dtype).to(device)  # noqa: E731
        score = None
        if scored:
            width = max(len(k) for _, _, k in scored)
            kv_lens = [[k[t] if t < len(k) else 0 for _, _, k in scored] for t in range(width)]
            query_scale = None
            if plan.query_scale is not None and bool((plan.query_scale[[r for r, _, _ in scored]] != 1).any()):
                query_scale = plan.query_scale[[r for r, _, _ in scored]].to(device)
            score = HeldScoring(rows=to([r for r, _, _ in scored]), slots=to([s for _, s, _ in scored]),
                                kv_lens=to(kv_lens, torch.int32), query_scale=query_scale)
        tokens = slots = pos = None
        if stored:
            tokens, slots, pos = (to(list(xs)) for xs in zip(*stored))
        return DraftStep(capacity=self._capacity, width=self._width, score=score,
                         store_tokens=tokens, store_slots=slots, store_pos=pos)

    def _release(self, req_id: str) -> None:
        held = self._held.pop(req_id, None)
        if held is not None:
            self._give_back(held[0])


class HeldQueries:
    """One layer's held queries: [slots, width, num_heads, head_size]."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def apply(self, decision: DraftStep, step: H2OStep, query: torch.Tensor, keys: torch.Tensor,
              scores: torch.Tensor, scale: float, softcap: float = 0.0,
              sink_logits: torch.Tensor | None = None, k_scale: float = 1.0) -> None:
        """Score the held queries that survived, in order; then hold this step's (``k_scale``:
        an fp8 cache's)."""
        score = decision.score
        if score is not None:
            table = step.block_table[score.rows]
            ones = None if score.query_scale is None else torch.ones_like(score.query_scale)
            for t in range(score.kv_lens.shape[0]):  # one pass per query: s <- query_scale * s + p
                kernels.accumulate_decode_scores(self.buffer[score.slots, t], keys, table, score.kv_lens[t],
                                         scores, scale, query_weight=ones, score_scale=score.query_scale,
                                         softcap=softcap, sinks=sink_logits, k_scale=k_scale)
        if decision.store_tokens is not None:
            buffer = self._buffer(decision, query)
            buffer[decision.store_slots, decision.store_pos] = query[decision.store_tokens]

    def _buffer(self, decision: DraftStep, query: torch.Tensor) -> torch.Tensor:
        self.buffer = grown(self.buffer, (decision.capacity, decision.width, *query.shape[1:]), query)
        return self.buffer
