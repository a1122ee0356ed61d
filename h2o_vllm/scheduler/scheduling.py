"""What the scheduler hooks do, as named functions: budgets in, tails out, admission room, metrics.

Runs in the engine-core process. ``managers`` are the H2O managers of one scheduler's KV-cache
manager (one per H2O KV-cache group); the hooks in ``vllm_hooks.engine_core`` find them and call
these at vLLM's step boundaries. Never touches a tensor.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from h2o_vllm import metrics
from h2o_vllm.policy import (draft_step_limit, prefill_step_limit, replay_step_limit, step_compacts,
                             window_step_limit)

if TYPE_CHECKING:  # manager imports vllm_hooks, whose engine-core hooks import this module
    from h2o_vllm.scheduler.manager import H2OManager


def add_request(managers: Sequence[H2OManager], request, prompt_len: int | None = None) -> None:
    """Resolve the request's budget once (engine config + its sampling parameters' overrides) for
    its H2O prompt length: vLLM's, or a KV-transfer consumer's shorter one
    (``kv_transfer.transfer_scheduler.TransferScheduler.prompt_len``)."""
    prompt_len = request.num_prompt_tokens if prompt_len is None else prompt_len
    for manager in managers:
        manager.budgets.resolve(request.request_id, prompt_len, request.sampling_params)
        manager.prompt_lens[request.request_id] = prompt_len


def finish_request(managers: Sequence[H2OManager], request_id: str) -> None:
    """A finished or aborted request: its budget goes (a preempted one keeps it)."""
    for manager in managers:
        manager.budgets.forget(request_id)
        manager.prompt_lens.pop(request_id, None)


def limit_step(managers: Sequence[H2OManager], request, num_computed_tokens: int,
               num_new_tokens: int) -> int:
    """The tokens vLLM may schedule for ``request`` this step: never past the end of its next
    prefill chunk (``prefill_chunk``), whatever else is in the batch, so the cadence checks the
    same token counts in every batch and after a preemption; and a speculative step's drafts
    cut where they would reach the request's next compaction (``policy.draft_step_limit``:
    docs/semantics.md, "Speculative decoding"); and a step that would stop inside the last
    queries of a chunk that a key scorer reads (``policy.window_step_limit``), whose recompute
    after a preemption also stops where the uninterrupted steps stopped
    (``policy.replay_step_limit``). Otherwise the tokens already known are never cut, with one
    exception: under async scheduling, a step that would compact while an earlier step's
    drafts are still unverified is not scheduled yet (0), because ``num_computed_tokens``
    counts those drafts as accepted, and after a rejection the compaction is not there."""
    known = request.num_tokens + request.num_output_placeholders - num_computed_tokens
    if _padded(request, known, num_new_tokens):
        return num_new_tokens  # vLLM asserts the padding whole: ``drop_padding`` may take it off
    # Each step in flight holds one placeholder for its sampled token and one per draft.
    drafts_in_flight = request.num_output_placeholders > 1
    for manager in managers:
        prompt_len, budget = _prompt_and_budget(manager, request)
        limit = prefill_step_limit(num_computed_tokens, prompt_len, budget.prefill_chunk)
        if limit is None and num_computed_tokens < prompt_len < request.num_prompt_tokens:
            # A transfer consumer computing its prompt itself: H2O's prompt ends before vLLM's,
            # and its check (a compaction) comes at that end, as on the producer.
            limit = prompt_len - num_computed_tokens
        if limit is not None:
            num_new_tokens = min(num_new_tokens, limit)
        if budget.key_scorer is not None and budget.key_scorer.query_window:
            # A compaction that reads its step's queries is exact only if a recompute's steps
            # stop where the uninterrupted ones did (docs/semantics.md, "Expected Attention").
            num_new_tokens = min(num_new_tokens, replay_step_limit(num_computed_tokens, prompt_len, budget))
            num_new_tokens = window_step_limit(num_computed_tokens, num_new_tokens, prompt_len,
                                               budget.prefill_chunk, budget.key_scorer.query_window)
        if num_new_tokens > known:
            limit = draft_step_limit(num_computed_tokens, prompt_len, budget)
            num_new_tokens = min(num_new_tokens, max(known, limit))
        if drafts_in_flight and step_compacts(num_computed_tokens, num_new_tokens, prompt_len, budget):
            return 0
    return num_new_tokens


def _prompt_and_budget(manager: H2OManager, request):
    """The request's H2O prompt length in ``manager`` and the budget resolved for it."""
    prompt_len = manager.prompt_len_of(request)
    return prompt_len, manager.budgets.resolve(request.request_id, prompt_len)


def _padded(request, known: int, num_tokens: int) -> bool:
    """Whether vLLM padded this step with dummy drafts: a request being admitted (waiting or
    preempted) with one token left (a prefix-cache hit or a KV-connector load that covers all
    but the last token) runs ``1 + k`` rows under speculative decoding, the last ``k`` drafts
    of -1 that are always rejected (so that a decode batch keeps one shape for CUDA graphs).
    A request being admitted has no drafts of its own."""
    return num_tokens > known and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def drop_padding(managers: Sequence[H2OManager], scheduler_output, requests) -> None:
    """Take vLLM's dummy drafts off a padded row (``_padded``: the drafts of a row admitted
    this step) whose step H2O would cut before them (``limit_step``): vLLM's scheduler cannot
    shorten a padded row, and with its drafts the step would hold a compaction whose place is
    known only after it (docs/semantics.md, "Speculative decoding"). The row then runs its one
    token alone, as vLLM runs a row it does not pad. Called before vLLM counts the step's
    tokens as computed."""
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    admitted = {new.req_id for new in scheduler_output.scheduled_new_reqs}
    admitted |= scheduler_output.scheduled_cached_reqs.resumed_req_ids
    for rid in admitted & spec_tokens.keys():
        request, num_tokens, pad = requests[rid], scheduler_output.num_scheduled_tokens[rid], spec_tokens[rid]
        limit = min((draft_step_limit(request.num_computed_tokens, *_prompt_and_budget(manager, request))
                     for manager in managers), default=num_tokens)
        if limit < num_tokens:
            del spec_tokens[rid]
            scheduler_output.num_scheduled_tokens[rid] = num_tokens - len(pad)
            scheduler_output.total_num_scheduled_tokens -= len(pad)
            for manager in managers:
                manager.step_shortened(rid, request.num_computed_tokens + num_tokens - len(pad))


def cut_scheduled(managers: Sequence[H2OManager], scheduler_output, requests) -> None:
    """At the end of ``schedule``: each scheduled request's blocks become what its step's
    compaction leaves (``H2OManager.cut_scheduled``), before the next step is scheduled,
    whether or not this one's output has been processed (async scheduling).

    Freeing at once also keeps admissions honest: vLLM frees skipped blocks lazily, in
    ``allocate_slots``, one request at a time while it walks the running queue; a request
    earlier in the queue that needs a block then preempts the newest one, the very prompt
    whose compaction was about to free most of the pool.
    """
    for req_id in scheduler_output.num_scheduled_tokens:
        request = requests[req_id]
        for manager in managers:
            manager.cut_scheduled(req_id, request.num_computed_tokens, manager.prompt_len_of(request))


def admission_watermark(managers: Sequence[H2OManager], whole_groups: Sequence, base: int, request,
                        num_new_tokens: int, step_end: int, max_model_len: int, lookahead: int = 0) -> int:
    """vLLM's admission watermark (``base``: the user's ``--watermark`` in blocks) for one
    allocation: raised when ``request`` is being admitted (waiting or preempted) so admissions
    leave room for the running sequences' growth, in H2O's groups
    (``H2OManager.admission_headroom``) and in the full-attention groups it leaves whole, a
    drafter's (``H2OManager.whole_group_headroom``). ``step_end``: the tokens the request
    will hold once this allocation's step has run; ``lookahead``: the slots vLLM allocates
    past every step for drafts."""
    if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or not managers:
        return base
    headroom = sum(m.admission_headroom(request, num_new_tokens, max_model_len, lookahead) for m in managers)
    # Every H2O group resolved the same budget for the request: one horizon serves them all.
    return base + headroom + sum(managers[0].whole_group_headroom(group, request, step_end + lookahead)
                                 for group in whole_groups)


def record_metrics(managers: Sequence[H2OManager], running: Iterable) -> None:
    """Freed blocks and live KV tokens per (layer, KV head) of the running requests."""
    if not managers:
        return
    evicted = managers[0].num_evicted
    live = sum(r.num_computed_tokens - evicted.get(r.request_id, 0) for r in running)
    records = sum(m.records.slots_in_use * m.block_size for m in managers if m.records is not None)
    metrics.recorder().set(freed_blocks=sum(m.num_freed_blocks for m in managers),
                           live_kv_tokens=live, score_record_tokens=records)
