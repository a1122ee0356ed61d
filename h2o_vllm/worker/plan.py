"""The per-step H2O plan of one batch: every row's KV-space lengths before and after the step.

Runs in the worker process. The runner hook builds it once per step from the input batch
(request identity, prompt lengths, each request's ``Budget``); the metadata builders and every
attention layer read it, so everything per-step is computed here, once. Every tensor-parallel
rank builds the same plan: it depends on the batch, never on heads.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tp_group

from h2o_vllm import metrics, score_modes
from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.config import Budget
from h2o_vllm.policy import chunk_end, first_compaction, live_kv_len, prompt_chunk
from h2o_vllm.score_modes import ScoreMode, Scorer, StepQueries
from h2o_vllm.worker.prefix_records import prefix_plan


@dataclass(frozen=True)
class StepPlan:
    # All [num_reqs] int64 on CPU, one entry per row of the batch.
    query_lens: torch.Tensor
    kv_lens_before: torch.Tensor   # live KV tokens before this step's K/V are written
    kv_seq_lens: torch.Tensor      # keys each row attends over in this step
    kv_lens_after: torch.Tensor    # live KV tokens once this step's compaction is done
    heavy: torch.Tensor
    sink_tokens: torch.Tensor
    # The score modes that rank each row's heavy candidates at this step's compaction
    # (``ScoreMode.rank``): the budget's where the compaction is the row's first, else none.
    rank: tuple[tuple[ScoreMode, ...], ...]
    due: torch.Tensor              # bool: rows compacted at the end of this step
    query_starts: torch.Tensor     # first token of each row in the batch
    # What ranks each row's heavy candidates from its live keys at every compaction
    # (``Budget.key_scorer``; None: the accumulated scores); () when no row has one.
    key_scorers: tuple[Scorer | None, ...] = ()
    # Each row's budget's ranking modes, whether this step ranks with them or not (``rank``):
    # the due pass runs every one of them and keeps a row's result only where ``rank`` has it,
    # so a row's first compaction launches nothing its other steps do not (worker.due_pass).
    ranking: tuple[tuple[ScoreMode, ...], ...] = ()
    # [num_reqs] int64: the most keys a row attends over in a decode step (budget + interval),
    # a bound that holds for the request's life: the due pass pads its rows to it, so a decode
    # batch keeps one width from step to step (worker.due_pass). None: the step's lengths.
    kv_peak_lens: torch.Tensor | None = None
    # The score modes' terms (h2o_vllm.score_modes; docs/score-modes.md). A row whose queries
    # sit at logical positions a..b updates each live token t as
    #   s(t) <- score_scale[row] * s(t) + sum_i query_weights[i] * p_i(t),
    # one fused update per step, equal to the modes' rule applied query by query (with decay:
    # score_scale = decay^(b - a + 1), query_weights[i] = decay^(b - i) * w_i). None (both) when
    # every weight and factor is 1 (paper H2O): the devices then run exactly the unweighted
    # arithmetic, at no extra cost. query_scale: the score_scale of a step of one query of the
    # row, for the queries the devices score one by one (CPU deferred decode rows, CUDA drafts).
    query_scale: torch.Tensor | None = None    # [num_reqs] fp32
    query_weights: torch.Tensor | None = None  # [num_tokens] fp32, one per scheduled token
    score_scale: torch.Tensor | None = None    # [num_reqs] fp32
    # Prefix caching: this step's orders by row (worker.prefix_records.PrefixPlan), None without
    # any: those of the KV-cache group whose layers run this plan (``for_group``).
    prefix: Any = None
    # Every H2O group's orders, {KV-cache group id: PrefixPlan}: each group has blocks of its own.
    group_prefixes: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    # The request of each row, and the requests whose KV cache is gone or rebuilt since the
    # last step (finished, preempted, resumed): what state kept across steps is keyed by
    # (worker.cpu.deferred). Empty when the plan is built without them (unit tests).
    req_ids: tuple[str, ...] = ()
    void_ids: frozenset[str] = frozenset()
    # Speculative decoding: each row's draft tokens in this step (None: no row has any). A
    # row with drafts scores nothing in its step (its query weights 0, its score_scale 1):
    # which of its queries exist is known only at the row's next step, and the device keeps
    # them until then (docs/semantics.md, "Speculative decoding").
    draft_lens: torch.Tensor | None = None

    def for_group(self, group_id: int) -> "StepPlan":
        """This plan as the layers of KV-cache group ``group_id`` run it: with that group's
        prefix-cache orders."""
        if not self.group_prefixes:  # no orders this step (or a plan given its prefix directly)
            return self
        prefix = self.group_prefixes.get(group_id)
        return self if prefix is self.prefix else dataclasses.replace(self, prefix=prefix)

    @property
    def weighted(self) -> bool:
        return self.query_weights is not None

    @functools.cached_property
    def first_scored(self) -> torch.Tensor | None:
        """[num_reqs] int64: each row's first query of nonzero weight (its query_len if none);
        the queries before it add nothing, so score passes start there. None when unweighted.
        Read off the weights, so it holds for the plans derived from this one too."""
        if self.query_weights is None:
            return None
        lens = self.query_lens
        rows = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
        j = torch.arange(rows.shape[0]) - (torch.cumsum(lens, 0) - lens)[rows]  # index in its row
        weights = self.query_weights[self.query_starts[rows] + j]  # a segment's rows may have gaps
        scored = torch.where(weights != 0, j, lens[rows])
        return self.query_lens.clone().scatter_reduce_(0, rows, scored, reduce="amin")


def make_step_plan(num_computed: torch.Tensor, query_lens: torch.Tensor, prompt_lens: torch.Tensor,
                   budgets: Sequence[Budget], draft_lens: torch.Tensor | None = None) -> StepPlan:
    """num_computed: logical tokens already in the cache per row (vLLM's num_computed_tokens);
    draft_lens: each row's speculative draft tokens among its query_lens (None: none)."""
    table = torch.tensor([(b.heavy, b.tokens, b.interval, b.sink_tokens, b.prefill_chunk or 0)
                          for b in budgets], dtype=torch.int64).view(-1, 5)
    heavy, budget_tokens, interval, sink_tokens, chunk = table.unbind(1)
    chunk = prompt_chunk(prompt_lens, chunk)
    first = (num_computed < first_compaction(prompt_lens, budget_tokens, interval, chunk)).tolist()
    ranking = tuple(tuple(m for m in b.scoring if m.ranks) for b in budgets)
    rank = tuple(modes if f else () for modes, f in zip(ranking, first))
    key_scorers = tuple(b.key_scorer for b in budgets)
    before = live_kv_len(num_computed, prompt_lens, budget_tokens, interval, chunk)
    after = live_kv_len(num_computed + query_lens, prompt_lens, budget_tokens, interval, chunk)
    seq_lens = before + query_lens
    starts = torch.cumsum(query_lens, 0) - query_lens
    weights = scale = None
    if any(b.scoring for b in budgets):
        weights, scale = _query_weights(num_computed, query_lens, prompt_lens, chunk, budgets, starts)
    query_scale = _score_scales(budgets, torch.ones_like(query_lens))
    query_scale = torch.ones(len(budgets)) if query_scale is None else query_scale.to(torch.float32)
    due = after < seq_lens
    if draft_lens is not None and bool((draft_lens > 0).any()):
        weights, scale = _unverified(draft_lens, due, query_lens, starts, weights, scale)
    else:
        draft_lens = None
    return StepPlan(query_lens=query_lens, kv_lens_before=before, kv_seq_lens=seq_lens,
                    kv_lens_after=after, heavy=heavy, sink_tokens=sink_tokens, rank=rank, due=due,
                    query_starts=starts, key_scorers=key_scorers if any(s is not None for s in key_scorers) else (),
                    ranking=ranking if any(ranking) else (), kv_peak_lens=budget_tokens + interval,
                    query_scale=query_scale, query_weights=weights,
                    score_scale=scale, draft_lens=draft_lens)


def _unverified(draft_lens: torch.Tensor, due: torch.Tensor, query_lens: torch.Tensor,
                starts: torch.Tensor, weights: torch.Tensor | None, scale: torch.Tensor | None):
    """(query_weights, score_scale) with the rows that carry drafts scoring nothing this step."""
    speculative = draft_lens > 0
    if bool((speculative & due).any()):
        # The scheduler cuts drafts before a compaction (policy.draft_step_limit); a plan that
        # disagrees would compact on tokens that may be rejected.
        raise RuntimeError("h2o: a speculative step reaches a compaction; the scheduler's draft "
                           f"limit and the worker's plan disagree (draft_lens={draft_lens.tolist()}, "
                           f"due={due.tolist()})")
    if weights is None:
        weights = torch.ones(int(query_lens.sum()), dtype=torch.float32)
        scale = torch.ones(query_lens.shape[0], dtype=torch.float32)
    rows = torch.repeat_interleave(torch.arange(query_lens.shape[0]), query_lens)
    weights = torch.where(speculative[rows], 0.0, weights)
    scale = torch.where(speculative, 1.0, scale)
    return weights, scale


def _mode_values(budgets: Sequence[Budget]):
    """(mode, [num_reqs] each row's value, ``neutral`` where unset) of each registered score
    mode some row runs with."""
    for mode in score_modes.modes():
        if mode.choices() is not None:  # a name, not a number: it has no terms (ScoreMode.key_scorer)
            continue
        mine = [b.mode(mode) for b in budgets]
        if any(m is not None for m in mine):
            dtype = torch.float64 if mode.number is float else torch.int64
            yield mode, torch.tensor([mode.neutral if m is None else m.value for m in mine], dtype=dtype)


def _score_scales(budgets: Sequence[Budget], query_lens: torch.Tensor) -> torch.Tensor | None:
    """fp64 [num_reqs] the product of the modes' ``score_scales``, None when none has any."""
    scale = None
    for mode, values in _mode_values(budgets):
        term = mode.score_scales(values, query_lens)
        if term is not None:
            scale = term if scale is None else scale * term
    return scale


def _query_weights(num_computed: torch.Tensor, query_lens: torch.Tensor, prompt_lens: torch.Tensor,
                   chunk: torch.Tensor, budgets: Sequence[Budget], starts: torch.Tensor):
    """(query_weights [num_tokens], score_scale [num_reqs]) fp32, or (None, None) when every
    weight and factor is 1. ``chunk``: each row's prefill chunk.

    Every query of the step at once (a prompt chunk can hold thousands): the product of the
    score modes' factors, in fp64, rounded to fp32 once.
    """
    rows = torch.repeat_interleave(torch.arange(query_lens.shape[0]), query_lens)
    j = torch.arange(rows.shape[0]) - starts[rows]          # index of the token in its row
    position = num_computed[rows] + j
    queries = StepQueries(row=rows, index=j, row_len=query_lens[rows], position=position,
                          prompt_len=prompt_lens[rows], chunk_start=position // chunk[rows] * chunk[rows],
                          chunk_end=chunk_end(position, prompt_lens[rows], chunk[rows]))
    weights = torch.ones(rows.shape[0], dtype=torch.float64)
    for mode, values in _mode_values(budgets):
        factor = mode.query_factors(values, queries)
        if factor is not None:
            weights = weights * factor
    scale = _score_scales(budgets, query_lens)
    weights = weights.to(torch.float32)
    scale = torch.ones(query_lens.shape[0]) if scale is None else scale.to(torch.float32)
    if bool((weights == 1).all()) and bool((scale == 1).all()):
        return None, None  # e.g. a row whose modes weigh prompt queries only, past its prompt
    return weights, scale


def plan_batch(budgets: RequestBudgets, req_ids: Sequence[str], num_computed: torch.Tensor,
               prompt_lens: torch.Tensor, query_lens: torch.Tensor,
               live_request_ids: Iterable[str], orders: Mapping[int, Any] | None = None,
               void_ids: Iterable[str] = (), draft_lens: torch.Tensor | None = None) -> StepPlan:
    """The plan of a batch whose row i is request ``req_ids[i]``, each request's budget read
    as resolved when it arrived (``RunnerState.begin_step``). ``orders``: the step's
    ``PrefixOrders`` from the scheduler by KV-cache group (prefix caching), or None.
    ``void_ids``, ``draft_lens``: ``StepPlan``'s."""
    rows = [budgets[r] for r in req_ids]
    live = list(live_request_ids)
    if len(budgets) > 4 * max(len(live), 64):  # the runner has no finish event for us
        budgets.retain(live)
    plan = make_step_plan(num_computed, query_lens, prompt_lens, rows, draft_lens)
    prefixes = {group: prefix_plan(o, req_ids) for group, o in (orders or {}).items()}
    return dataclasses.replace(plan, group_prefixes={g: p for g, p in prefixes.items() if p is not None},
                               req_ids=tuple(req_ids), void_ids=frozenset(void_ids))


def kv_slot_mapping(plan: StepPlan, block_table: torch.Tensor, num_tokens: int,
                    block_size: int) -> torch.Tensor:
    """Cache slot of each scheduled token (int64 [num_tokens], on block_table's device): row
    r's j-th new token goes to KV position kv_lens_before[r] + j. Padding tokens get -1
    (vLLM's PAD_SLOT_ID)."""
    device = block_table.device
    rows = torch.repeat_interleave(torch.arange(plan.query_lens.shape[0]), plan.query_lens)
    kv_pos = plan.kv_lens_before[rows] + torch.arange(rows.shape[0]) - plan.query_starts[rows]
    rows, kv_pos = rows.to(device, non_blocking=True), kv_pos.to(device, non_blocking=True)
    blocks = block_table[rows, kv_pos // block_size].to(torch.int64)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    slots[: rows.shape[0]] = blocks * block_size + kv_pos % block_size
    return slots


def rows_to_truncate(plan: StepPlan, block_size: int) -> list[tuple[int, int, list[int] | None]]:
    """(row, blocks kept, its fresh blocks or None) of each compacted row: the block-table
    entries past its new KV length go, as the scheduler's ``H2OManager.remove_skipped_blocks``
    frees them at the next schedule; a row that compacted into fresh blocks becomes them
    (``plan``: one group's, ``StepPlan.for_group``)."""
    fresh = plan.prefix.fresh if plan.prefix is not None else {}
    return [(row, -(-int(plan.kv_lens_after[row]) // block_size), fresh.get(row))
            for row in plan.due.nonzero().flatten().tolist()]


def _counts_once() -> bool:
    """Whether this worker counts per-request events (the first TP and PP rank)."""
    try:
        return get_tp_group().rank_in_group == 0 and get_pp_group().is_first_rank
    except (AssertionError, RuntimeError):  # no distributed state (unit tests)
        return True


def record_compactions(plan: StepPlan) -> None:
    """Tokens evicted and compactions of this step, from the plan every layer executes."""
    due = plan.due
    if not bool(due.any()) or not _counts_once():
        return
    evicted = int((plan.kv_seq_lens[due] - plan.kv_lens_after[due]).sum())
    metrics.recorder().add(evicted_tokens=evicted, compactions=int(due.sum()))
