"""H2O with vLLM's prefix cache, scheduler side: exact hits, the records they need, the orders.

Runs in the engine-core process, called from the hooks in ``vllm_hooks.engine_core`` at vLLM's
step boundaries; the state lives on each ``H2OManager`` (``records``, ``hit_records``, ...).
docs/prefix-caching.md has the design; ``scheduler/records.py`` why records exist.

- ``cut_hit``: a hit is cut back to the longest boundary H2O can resume from exactly (one
  with a written record; for a request whose score modes turn records off, any boundary its
  scored queries do not reach, whose scores are all zero: ``ScoreMode.unrecorded_hit``).
- ``prefix_orders``: at the end of ``schedule``, plan the records each admitted request will
  write and collect this step's orders for the workers (``h2o_vllm.prefix_orders.PrefixOrders``).
- ``commit_records``: once the step has run, the records it wrote may serve hits.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from h2o_vllm.config import Budget
from h2o_vllm.policy import chunk_end, first_compaction
from h2o_vllm.prefix_orders import PrefixOrders

if TYPE_CHECKING:  # manager imports vllm_hooks, whose engine-core hooks import this module
    from h2o_vllm.scheduler.manager import H2OManager


def record_key(request, num_blocks: int, budget: Budget, block_size: int, hash_block_size: int):
    """What a record of the first ``num_blocks`` blocks of ``request`` depends on: the chained
    hash of its last block names the whole prefix; the score modes that shape every score of a
    prefix (``ScoreMode.record_key``) name how it was scored."""
    shaped = tuple((m.key(), k) for m in budget.scoring if (k := m.record_key()) is not None)
    return request.block_hashes[num_blocks * (block_size // hash_block_size) - 1], shaped


def unrecorded_hit(prompt_len: int, budget: Budget) -> int | None:
    """None when the request's scores of a prefix may be recorded and reused; else the tokens a
    hit may reach without a record (records are off for it: ``ScoreMode.unrecorded_hit``)."""
    first_end = chunk_end(0, prompt_len, budget.prefill_chunk)
    limits = [n for m in budget.scoring if (n := m.unrecorded_hit(first_end)) is not None]
    return min(limits) if limits else None


def cut_hit(manager: H2OManager, request, num_hit_tokens: int, hit_blocks=()) -> int:
    """The tokens of vLLM's hit (``num_hit_tokens``, whole blocks ``hit_blocks``) that H2O can
    use exactly; remembers the record the hit resumes from and how long the match was.

    A hit stops before the first block another request is computing in this very step (vLLM
    lets a request hit those; H2O copies a hit before the step, so they would be copied before
    they hold anything)."""
    rid, block_size = request.request_id, manager.block_size
    manager.longest_match[rid] = num_hit_tokens // block_size
    manager.hit_records[rid] = None
    budget = manager.budgets.resolve(rid, manager.prompt_len_of(request))
    # A request recomputed after preemption may match past its own first compaction (another
    # prompt ran into its outputs); the block counts assume no hit reaches that far.
    # A chunked prompt (prefill_chunk) evicts before its end: no hit reaches past that either.
    reachable = min(num_hit_tokens // block_size, _blocks_before_first_compaction(manager, request, budget))
    matched = next((j for j, block in enumerate(hit_blocks) if block.block_id in manager.step_cached),
                   reachable)
    matched = min(matched, reachable)
    limit = unrecorded_hit(manager.prompt_len_of(request), budget)
    if limit is not None:
        return min(matched, limit // block_size) * block_size
    cut = 0
    for num_blocks in range(matched, 0, -1):
        record = manager.records.ready(_key(manager, request, num_blocks, budget))
        if record is not None:
            manager.hit_records[rid] = record
            cut = num_blocks * block_size
            break
    _await_longer_record(manager, request, budget, cut // block_size, reachable)
    return cut


def _await_longer_record(manager: H2OManager, request, budget, cut_blocks: int,
                         matched_blocks: int) -> None:
    """Mark a request to wait a step when a record longer than its cut hit is being written by
    a running request (its step has not run yet): admitted now it would recompute what it
    can hit once that step has run. ``awaits_record`` tells the allocation hook. One step per
    request at most: a writer far from its boundary (a long prompt in small chunks) must not
    hold the waiting queue up."""
    rid = request.request_id
    manager.awaiting.discard(rid)
    if rid in manager.waited:
        return
    for num_blocks in range(matched_blocks, cut_blocks, -1):
        key = _key(manager, request, num_blocks, budget)
        if manager.records.pending(key):
            manager.awaiting.add(rid)
            manager.waited.add(rid)
            return


def _blocks_before_first_compaction(manager: H2OManager, request, budget) -> int:
    """Whole blocks that end before the request's first compaction: what its hits and the
    records it writes may cover (the K/V and scores any request computes alike)."""
    first = first_compaction(manager.prompt_len_of(request), budget.tokens, budget.interval,
                             budget.prefill_chunk)
    return (first - 1) // manager.block_size


def awaits_record(managers, request) -> bool:
    """A waiting request whose longer hit is one step away (``_await_longer_record``)."""
    return any(request.request_id in m.awaiting for m in managers)


def _key(manager: H2OManager, request, num_blocks: int, budget: Budget):
    return record_key(request, num_blocks, budget, manager.block_size,
                      manager.block_pool.hash_block_size)


def plan_records(manager: H2OManager, request, start: int) -> None:
    """Reserve the records an admitted request (resuming at ``start`` tokens, its hit) writes:
    its longest match, if the hit was cut back from it, so the next request with this prefix
    hits it exactly; and its prompt's last block boundary before the final token, which a
    repeat of the prompt or a next chat turn hits."""
    rid, block_size = request.request_id, manager.block_size
    budget = manager.budgets.resolve(rid, manager.prompt_len_of(request))
    planned = manager.pending_records.setdefault(rid, [])
    if unrecorded_hit(manager.prompt_len_of(request), budget) is not None:
        return  # its scores of a prefix would serve no one
    last = (manager.prompt_len_of(request) - 1) // block_size
    reachable = _blocks_before_first_compaction(manager, request, budget)
    for num_blocks in sorted({manager.longest_match.get(rid, 0), last}):
        if num_blocks * block_size <= start or num_blocks > reachable:
            continue
        key = _key(manager, request, num_blocks, budget)
        if manager.records.has(key):
            continue
        record = manager.records.reserve(key, num_blocks, rid)
        if record is not None:
            planned.append(record)


def step_orders(managers: Sequence[H2OManager], scheduler_output,
                requests: Mapping[str, object]) -> dict[int, PrefixOrders]:
    """This step's orders for the workers: {KV-cache group id: its manager's orders}. Each H2O
    group (a hybrid model or a drafter can give several) has its own blocks, records and fresh
    blocks; a worker's layers follow their own group's."""
    orders = {manager.kv_cache_group_id: prefix_orders(manager, scheduler_output, requests)
              for manager in managers}
    return {group: o for group, o in orders.items() if o}


def prefix_orders(manager: H2OManager, scheduler_output,
                  requests: Mapping[str, object]) -> PrefixOrders:
    """This step's orders of one H2O group, drained from its manager."""
    orders = PrefixOrders()
    if manager.records is None:
        return orders
    scheduled = scheduler_output.num_scheduled_tokens
    admitted = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    admitted |= set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    orders.score_inits.extend(manager.step_score_inits)
    manager.step_score_inits = []
    for rid, num_tokens in scheduled.items():
        request = requests[rid]
        end = request.num_computed_tokens  # vLLM has already counted this step's tokens
        start = end - num_tokens
        if rid in admitted:
            plan_records(manager, request, start)
        for record in manager.pending_records.get(rid, ()):
            boundary = record.num_blocks * manager.block_size
            if start < boundary <= end:
                orders.record_writes.append((rid, boundary, list(record.slots)))
                manager.step_written.append(record)
        fresh = manager.fresh.get(rid)
        if fresh is not None and rid in manager.step_fresh:
            orders.fresh_blocks[rid] = [b.block_id for b in fresh]
    manager.step_fresh.clear()
    manager.step_cached.clear()
    return orders


def commit_records(managers: Sequence[H2OManager]) -> None:
    """The step has run: the records it wrote serve hits from now on."""
    for manager in managers:
        if manager.records is None or not manager.step_written:
            continue
        for record in manager.step_written:
            manager.records.commit(record)
        for records in manager.pending_records.values():
            records[:] = [r for r in records if not r.ready]
        manager.step_written = []
