"""Deferred decode scores on the CPU: a row's decode queries wait, and are scored together.

Runs in the worker process. vLLM's CPU kernel attends a decode row without returning its
probabilities, so H2O recomputes them (``scores.py``); done every step, that pass costs a
dozen small torch ops per layer and multiplies 3-query tiles, more than the kernel itself.
Nothing reads a row's scores between its compactions, so each layer keeps the row's queries
(``PendingQueries``) and scores them all at once (``accumulate_row_queries``) when they are
needed: at the row's compaction (``StepPlan.due``), when ``MAX_PENDING`` have waited, on a
prefix-caching step (its records snapshot the scores), or before the row's next multi-query
step. The scores are the same sums: each query still sees exactly the keys it saw (its kv
length; a row's KV positions only move when it compacts, after a flush), and a weighted row's
per-step score scale is folded into the waiting queries' weights.

Speculative decoding (docs/semantics.md, "Speculative decoding"): every query of a
verification step waits, each as a decode query of its own; at the row's next step those past
its new KV length (rejected drafts) are dropped, the rest wait on. A verification step never
compacts, so no flush ever scores a query before its fate is known.

``PendingBook`` (one per KV-cache group, in the metadata builder) decides per step, once for
every layer, where each query waits and which rows flush; each layer's ``PendingQueries``
holds its queries and applies the decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h2o_vllm.config import MAX_PENDING
from h2o_vllm.worker.cpu.scores import DecodeIndex, accumulate_row_queries, decode_index
from h2o_vllm.worker.query_book import QueryBook, grown
from h2o_vllm.worker.step import H2OStep



@dataclass
class _Waiting:
    slot: int
    kv_lens: list[int] = field(default_factory=list)   # keys each waiting query saw
    weights: list[float] = field(default_factory=list)  # its query weight (1: paper H2O)
    scales: list[float] = field(default_factory=list)   # its step's score_scale (1: paper H2O)

    def drop_rejected(self, kv_len: int) -> None:
        """Keep the queries whose token is still in the cache, which holds ``kv_len`` tokens:
        a rejected draft's query saw more (it saw itself)."""
        keep = sum(1 for n in self.kv_lens if n <= kv_len)  # the kept ones come first
        del self.kv_lens[keep:], self.weights[keep:], self.scales[keep:]


@dataclass(frozen=True)
class Flush:
    """Rows whose waiting queries are scored in this step, padded to the most waiting."""
    rows: torch.Tensor          # int64 [F]: batch rows
    slots: torch.Tensor         # int64 [F]
    num_queries: int            # T: the most any of them has waiting
    index: DecodeIndex          # keys per row, padding per waiting query
    weights: torch.Tensor       # fp32 [F, T]: each query's weight with the later steps' score scales; 0: padding
    factor: torch.Tensor | None  # fp32 [F]: the product of the waiting steps' score_scale; None: all 1


@dataclass(frozen=True)
class DeferredDecode:
    """One step's decision, the same for every layer of the group."""
    capacity: int                      # slots the layers' buffers must hold
    store_tokens: torch.Tensor | None  # int64 [S]: decode tokens whose query waits
    store_slots: torch.Tensor | None   # int64 [S]
    store_pos: torch.Tensor | None     # int64 [S]
    flush: Flush | None
    # Rows whose waiting queries are scored before this step's are stored (a verification
    # step's row that needs the room).
    before: Flush | None
    # A prefix-caching step: waiting queries are scored first, and this step's decode
    # queries the usual way (their scores feed the records this step snapshots).
    immediate: bool


class PendingBook(QueryBook[DeferredDecode]):
    """Which request's queries wait where, across steps (one per KV-cache group)."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self._waiting: dict[str, _Waiting] = {}

    def _decide(self, step: H2OStep) -> DeferredDecode:
        plan = step.plan
        for req_id in plan.void_ids:  # finished, preempted or resumed: its cache is gone or new
            self._release(req_id)
        immediate = step.prefix is not None
        q_lens, due = plan.query_lens.tolist(), plan.due.tolist()
        kv_lens, starts = plan.kv_seq_lens.tolist(), plan.query_starts.tolist()
        weights = None if plan.query_weights is None else plan.query_weights.tolist()
        scales = None if plan.score_scale is None else plan.score_scale.tolist()
        drafts = [0] * len(q_lens) if plan.draft_lens is None else plan.draft_lens.tolist()
        kv_before = plan.kv_lens_before.tolist()
        query_scale = [1.0] * len(q_lens) if plan.query_scale is None else plan.query_scale.tolist()
        stored: list[tuple[int, int, int]] = []
        flushing: list[tuple[int, _Waiting]] = []
        before: list[tuple[int, _Waiting]] = []
        for row, req_id in enumerate(plan.req_ids):
            waiting = self._waiting.get(req_id)
            if waiting is not None:
                waiting.drop_rejected(kv_before[row])
            stores = drafts[row] > 0 or (q_lens[row] == 1 and not immediate)
            if stores:
                if waiting is None:
                    waiting = self._waiting[req_id] = _Waiting(self._take_slot())
                if len(waiting.kv_lens) + q_lens[row] > MAX_PENDING:  # accepted drafts filled it
                    before.append((row, waiting))  # scored first, then the slot is refilled
                    waiting = self._waiting[req_id] = _Waiting(waiting.slot)
            if drafts[row]:
                for j in range(q_lens[row]):  # each its own decode step: weight 1, scaled once
                    stored.append((starts[row] + j, waiting.slot, len(waiting.kv_lens)))
                    waiting.kv_lens.append(kv_before[row] + j + 1)
                    waiting.weights.append(1.0)
                    waiting.scales.append(query_scale[row])
            elif stores:
                stored.append((starts[row], waiting.slot, len(waiting.kv_lens)))
                waiting.kv_lens.append(kv_lens[row])
                waiting.weights.append(1.0 if weights is None else weights[starts[row]])
                waiting.scales.append(1.0 if scales is None else scales[row])
                if due[row] or len(waiting.kv_lens) == MAX_PENDING:
                    flushing.append((row, waiting))
            elif q_lens[row] > 0 and waiting is not None and waiting.kv_lens:
                flushing.append((row, waiting))  # before this step's own scores of the row
        first = self._flush(step, before) if before else None
        flush = self._flush(step, flushing) if flushing else None
        to_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        tokens, slots, pos = (map(to_tensor, zip(*stored))) if stored else (None, None, None)
        return DeferredDecode(capacity=self._capacity, store_tokens=tokens, store_slots=slots,
                              store_pos=pos, flush=flush, before=first, immediate=immediate)

    def _flush(self, step: H2OStep, flushing: list[tuple[int, _Waiting]]) -> Flush:
        num_queries = max(len(w.kv_lens) for _, w in flushing)
        kv_lens = torch.ones(len(flushing), num_queries, dtype=torch.int64)  # padding: 1 key, weight 0
        weights = torch.zeros(len(flushing), num_queries, dtype=torch.float64)
        factors, weighted = [], False
        for i, (_, waiting) in enumerate(flushing):
            n = len(waiting.kv_lens)
            kv_lens[i, :n] = torch.tensor(waiting.kv_lens)
            # s <- scale_t * s + w_t * p_t, step by step, equals
            # s <- prod(scale) * s + sum_t w_t * prod(scale after t) * p_t
            later = 1.0
            for t in range(n - 1, -1, -1):
                weights[i, t] = waiting.weights[t] * later
                later *= waiting.scales[t]
            factors.append(later)
            weighted = weighted or any(s != 1.0 for s in waiting.scales)
            waiting.kv_lens, waiting.weights, waiting.scales = [], [], []
        rows = torch.tensor([row for row, _ in flushing], dtype=torch.int64)
        device = step.block_table.device
        return Flush(rows=rows, slots=torch.tensor([w.slot for _, w in flushing], dtype=torch.int64),
                     num_queries=num_queries,
                     index=decode_index(step.block_table[rows.to(device)], kv_lens, self.block_size,
                                        weighted=weighted),
                     weights=weights.to(torch.float32),
                     factor=torch.tensor(factors, dtype=torch.float32) if weighted else None)

    def _release(self, req_id: str) -> None:
        waiting = self._waiting.pop(req_id, None)
        if waiting is not None:
            self._give_back(waiting.slot)


class PendingQueries:
    """One layer's waiting queries: [slots, MAX_PENDING, num_heads, head_size]."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def apply(self, decision: DeferredDecode, query: torch.Tensor, key_blocks: torch.Tensor,
              scores: torch.Tensor, scale: float, softcap: float = 0.0,
              sink_logits: torch.Tensor | None = None) -> None:
        """Keep this step's waiting queries, then score the flushing rows' (query: the batch's)."""
        if decision.before is not None:  # read before this step's queries overwrite them
            self._score(decision.before, key_blocks, scores, scale, softcap, sink_logits)
        if decision.store_tokens is not None:
            buffer = self._buffer(decision.capacity, query)
            buffer[decision.store_slots, decision.store_pos] = query[decision.store_tokens]
        if decision.flush is not None:
            self._score(decision.flush, key_blocks, scores, scale, softcap, sink_logits)

    def _score(self, flush: Flush, key_blocks, scores, scale, softcap, sink_logits) -> None:
        waiting = self.buffer[flush.slots, :flush.num_queries]
        accumulate_row_queries(waiting, key_blocks, scores, flush.index, scale, flush.weights,
                               flush.factor, softcap, sink_logits)

    def _buffer(self, capacity: int, query: torch.Tensor) -> torch.Tensor:
        self.buffer = grown(self.buffer, (capacity, MAX_PENDING, *query.shape[1:]), query)
        return self.buffer
