"""worker.cpu.deferred: decode queries that wait and are scored together give the scores (and
so the keep-sets and the cache) of scoring each in its own step.

Two copies of one CPU layer run the same steps through the impl's sequence (``CPUOps.attend``,
then ``update_scores_and_compact``): one defers (``PendingBook`` + ``PendingQueries``), one
scores every decode query at once. Rows prefill, decode past several compactions, skip steps,
get preempted and come back; paper H2O and weighted modes (decay, observation window).
"""
import dataclasses

import pytest
import torch

from h2o_vllm.config import Budget
from h2o_vllm.worker import step as worker_step
from h2o_vllm.worker.cpu import deferred
from h2o_vllm.worker.cpu.ops import CPUOps
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan
from h2o_vllm.score_modes import Decay, ObsWindow

BLOCK, NUM_KV_HEADS, HEAD, GROUP = 16, 2, 16, 3
MAX_BLOCKS = 8


class World:
    """One layer's cache and scores (the same random start in every world)."""

    def __init__(self, num_rows: int, defer: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.kv_cache = torch.randn(num_rows * MAX_BLOCKS + 1, NUM_KV_HEADS, BLOCK, 2 * HEAD, generator=gen)
        self.views = CPUOps().cache_views(self.kv_cache)
        self.scores = torch.rand(self.kv_cache.shape[0], NUM_KV_HEADS, BLOCK, generator=gen)
        self.table = torch.arange(1, num_rows * MAX_BLOCKS + 1, dtype=torch.int32).view(num_rows, MAX_BLOCKS)
        self.book = deferred.PendingBook(BLOCK) if defer else None
        self.pending = deferred.PendingQueries()
        self.ops = CPUOps()

    def step(self, plan, rows, query, new_k, new_v):
        """One step of the requests ``rows`` (each keeps its own block-table row)."""
        table = self.table[torch.tensor(rows)]
        num_tokens = int(plan.query_lens.sum())
        slots = kv_slot_mapping(plan, table, num_tokens, BLOCK)
        self.views.keys[slots // BLOCK, slots % BLOCK] = new_k
        self.views.values[slots // BLOCK, slots % BLOCK] = new_v
        step = worker_step.make_step(plan, table, slots, BLOCK)
        step = dataclasses.replace(step, device_index=self.ops.step_index(step, BLOCK))
        decision = None if self.book is None else self.book.decide(step)
        out = torch.empty_like(query)
        self.ops.attend(step, query, self.views, out, self.scores, HEAD ** -0.5, deferred=decision,
                        pending=self.pending)
        worker_step.update_scores_and_compact(step, self.ops, query, self.views, self.scores,
                                              HEAD ** -0.5, accumulated=True)
        return decision


def _run(budget: Budget, schedule, prompt_lens, check):
    """schedule: per step, {request index: query length} (absent: not scheduled) and the
    requests made void before it (preempted: they come back with their whole sequence)."""
    gen = torch.Generator().manual_seed(1)
    worlds = [World(len(prompt_lens), defer=False), World(len(prompt_lens), defer=True)]
    computed = [0] * len(prompt_lens)
    decisions = []
    for scheduled, void in schedule:
        for i in void:
            computed[i] = 0
        rows = sorted(scheduled)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        plan = make_step_plan(t([computed[i] for i in rows]), t([scheduled[i] for i in rows]),
                              t([prompt_lens[i] for i in rows]), [budget] * len(rows))
        plan = dataclasses.replace(plan, req_ids=tuple(f"r{i}" for i in rows),
                                   void_ids=frozenset(f"r{i}" for i in void))
        num_tokens = int(plan.query_lens.sum())
        query = torch.randn(num_tokens, NUM_KV_HEADS * GROUP, HEAD, generator=gen)
        new_k, new_v = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD, generator=gen)
        decisions.append(worlds[1].step(plan, rows, query, new_k, new_v))
        worlds[0].step(plan, rows, query, new_k, new_v)
        for i in rows:
            computed[i] += scheduled[i]
        check(worlds, plan, rows, decisions[-1])
    return worlds, decisions


def _settled_rows_agree(worlds, plan, rows, decision):
    """The cache always; the scores of every row with nothing waiting."""
    immediate, deferring = worlds
    assert torch.equal(immediate.kv_cache, deferring.kv_cache)
    waiting = {req for req, w in deferring.book._waiting.items() if w.kv_lens}
    for row, req in enumerate(plan.req_ids):
        if req in waiting:
            continue
        blocks = immediate.table[int(req[1:])].long()
        torch.testing.assert_close(deferring.scores[blocks], immediate.scores[blocks], rtol=1e-5, atol=1e-6)


PROMPTS = [20, 9, 33]
# Prefill, then decode; row 1 misses two steps, row 2 is preempted at step 25 and recomputes.
SCHEDULE = ([({0: 20, 1: 9, 2: 33}, ())] + [({0: 1, 1: 1, 2: 1}, ())] * 10
            + [({0: 1, 2: 1}, ())] * 2 + [({0: 1, 1: 1, 2: 1}, ())] * 11
            + [({0: 1, 1: 1}, (2,)), ({0: 1, 1: 1, 2: 33 + 23}, ())] + [({0: 1, 1: 1, 2: 1}, ())] * 20)


@pytest.mark.parametrize("budget", [
    Budget(heavy=4, recent=4, interval=4), Budget(heavy=4, recent=4, interval=40),
    Budget(heavy=3, recent=5, interval=6, sink_tokens=1, scoring=(Decay(0.9), ObsWindow(4))),
    Budget(heavy=3, recent=5, interval=1, scoring=(Decay(0.95),))],
    ids=["paper", "paper-rare-compactions", "weighted", "every-step"])
def test_deferred_scores_equal_scoring_every_step(budget):
    _, decisions = _run(budget, SCHEDULE, PROMPTS, _settled_rows_agree)
    flushed = [d.flush.num_queries for d in decisions if d is not None and d.flush is not None]
    stored = sum(0 if d.store_tokens is None else len(d.store_tokens) for d in decisions)
    assert stored > 0 and flushed
    if budget.interval > 1:  # queries really waited, and no more than MAX_PENDING
        assert max(flushed) > 1 and max(flushed) <= deferred.MAX_PENDING


def test_waiting_rows_flush_at_the_cap_and_void_requests_free_their_slot():
    budget = Budget(heavy=100, recent=100, interval=16)  # never compacts: only the cap flushes
    worlds, decisions = _run(budget, SCHEDULE, PROMPTS, _settled_rows_agree)
    assert all(d.flush is None or d.flush.num_queries <= deferred.MAX_PENDING for d in decisions)
    assert any(d.flush is not None and d.flush.num_queries == deferred.MAX_PENDING for d in decisions)
    book = worlds[1].book
    assert book._capacity == 3  # request 2's slot, freed when it was preempted, was reused
    assert sorted(book._waiting) == ["r0", "r1", "r2"]


def test_a_prefix_caching_step_scores_at_once():
    """A step with prefix-cache work snapshots scores: waiting queries flush first, the step's
    own decode queries are scored the usual way."""
    budget = Budget(heavy=100, recent=100, interval=16)
    plan = make_step_plan(torch.tensor([20]), torch.tensor([1]), torch.tensor([20]), [budget])
    plan = dataclasses.replace(plan, req_ids=("r0",))
    step = worker_step.make_step(plan, torch.arange(1, 3, dtype=torch.int32)[None], torch.tensor([20]), BLOCK)
    book = deferred.PendingBook(BLOCK)
    assert book.decide(step).store_tokens is not None
    later = dataclasses.replace(plan, kv_lens_before=plan.kv_lens_before + 1, kv_seq_lens=plan.kv_seq_lens + 1)
    with_prefix = dataclasses.replace(step, plan=later, prefix=object())
    decision = book.decide(with_prefix)
    assert decision.immediate and decision.store_tokens is None
    assert decision.flush is not None and decision.flush.num_queries == 1
    assert book.decide(with_prefix) is decision  # built twice for one step: decided once


@pytest.mark.parametrize("shaping", [{}, {"softcap": 1.5}, {"sinks": torch.linspace(-1, 3, NUM_KV_HEADS * GROUP)}],
                         ids=["plain", "softcap", "sinks"])
def test_a_rows_waiting_queries_score_as_one_query_a_step(shaping):
    """``accumulate_row_queries`` with T queries per row (its per-row GEMM) equals T
    one-query passes (the broadcast tiles), each query over the keys it saw, decay folded."""
    from h2o_vllm.worker.cpu.scores import accumulate_row_queries, decode_index, scale_blocks
    gen = torch.Generator().manual_seed(3)
    world = World(2, defer=True)
    kv_lens = torch.tensor([[30, 31, 32, 1], [40, 41, 42, 43]])  # row 0: 3 waiting, padded
    weights = torch.tensor([[0.5, 0.7, 1.0, 0.0], [0.2, 0.3, 0.4, 1.0]])
    factor = torch.tensor([0.9, 0.8])
    query = torch.randn(2, 4, NUM_KV_HEADS * GROUP, HEAD, generator=gen)
    together = world.scores.clone()
    accumulate_row_queries(query, world.views.key_blocks, together,
                           decode_index(world.table, kv_lens, BLOCK, weighted=True), HEAD ** -0.5,
                           weights, factor, **shaping)
    one_by_one = world.scores.clone()
    live = decode_index(world.table, kv_lens, BLOCK, weighted=True)
    scale_blocks(one_by_one, live.live_blocks, factor[live.live_rows])
    for t in range(4):
        accumulate_row_queries(query[:, t:t + 1], world.views.key_blocks, one_by_one,
                               decode_index(world.table, kv_lens[:, t], BLOCK), HEAD ** -0.5,
                               weights[:, t:t + 1], **shaping)
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=1e-6)


def test_a_step_whose_decode_queries_all_wait_builds_no_immediate_index(monkeypatch):
    from h2o_vllm.worker.cpu import ops as cpu_ops
    built = []
    real = cpu_ops.decode_index
    monkeypatch.setattr(cpu_ops, "decode_index", lambda *a, **k: built.append(1) or real(*a, **k))
    _run(Budget(heavy=4, recent=4, interval=4), SCHEDULE, PROMPTS, _settled_rows_agree)
    # only the immediate world's steps with decode rows, once each (every layer would reuse it)
    steps_with_decode_rows = sum(1 for scheduled, _ in SCHEDULE if 1 in scheduled.values())
    assert len(built) == steps_with_decode_rows


# --------------------------------------------------------------------------- speculative decoding

def _token(req: int, pos: int, accepted: bool = True, salt: int = 0):
    """Query, key and value of request ``req``'s token at logical ``pos``: a function of the
    token alone, so an accepted draft is the token plain decoding writes there; a rejected
    one is something else."""
    gen = torch.Generator().manual_seed(req * 100_003 + pos * 7 + (0 if accepted else 1_000_000 + salt))
    return (torch.randn(NUM_KV_HEADS * GROUP, HEAD, generator=gen),
            *torch.randn(2, NUM_KV_HEADS, HEAD, generator=gen))


def _batch_step(world, plan, rows, tokens):
    query = torch.stack([t[0] for t in tokens])
    new_k, new_v = torch.stack([t[1] for t in tokens]), torch.stack([t[2] for t in tokens])
    return world.step(plan, rows, query, new_k, new_v)


def _plan(computed, rows, q, prompt_lens, budget, drafts=None):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    plan = make_step_plan(t([computed[i] for i in rows]), t([q[i] for i in rows]),
                          t([prompt_lens[i] for i in rows]), [budget] * len(rows),
                          None if drafts is None else t([drafts[i] for i in rows]))
    return dataclasses.replace(plan, req_ids=tuple(f"r{i}" for i in rows))


@pytest.mark.parametrize("budget", [
    Budget(heavy=4, recent=4, interval=6), Budget(heavy=3, recent=5, interval=7, scoring=(Decay(0.9),)),
    Budget(heavy=3, recent=5, interval=5, sink_tokens=1, scoring=(Decay(0.9), ObsWindow(4))),
    Budget(heavy=4, recent=4, interval=40, scoring=(Decay(0.9),))],
    ids=["paper", "decay", "weighted", "rare-compactions"])
def test_verification_steps_leave_the_scores_of_plain_decoding(budget):
    """Requests decode with drafts (cut by ``policy.draft_step_limit``, accepted at random);
    a twin decodes the accepted tokens one a step. Whenever a row has nothing waiting, its live
    keys, values and scores are the twin's: rejected drafts left no score and no slot."""
    from h2o_vllm.policy import draft_step_limit
    prompt_lens, rng = [20, 9], torch.Generator().manual_seed(5)
    spec, plain = World(2, defer=True), World(2, defer=True)
    rows = [0, 1]
    _batch_step(spec, _plan([0, 0], rows, prompt_lens, prompt_lens, budget), rows,
                [_token(i, p) for i in rows for p in range(prompt_lens[i])])
    _batch_step(plain, _plan([0, 0], rows, prompt_lens, prompt_lens, budget), rows,
                [_token(i, p) for i in rows for p in range(prompt_lens[i])])
    computed, plain_at, drafted, compared, made_room = list(prompt_lens), list(prompt_lens), 0, 0, 0
    for step in range(40):
        q = {i: min(4, draft_step_limit(computed[i], prompt_lens[i], budget)) for i in rows}
        drafts = {i: q[i] - 1 for i in rows}
        # Half the steps accept every draft: a row's waiting queries then fill up.
        accepted = {i: q[i] - 1 if bool(torch.rand(1, generator=rng) < 0.5)
                    else int(torch.randint(0, q[i], (1,), generator=rng)) for i in rows}
        tokens = [_token(i, computed[i] + j, accepted=j <= accepted[i], salt=step)
                  for i in rows for j in range(q[i])]
        plan = _plan(computed, rows, q, prompt_lens, budget, drafts)
        assert plan.draft_lens is None or not bool((plan.due & (plan.draft_lens > 0)).any())
        made_room += _batch_step(spec, plan, rows, tokens).before is not None
        drafted += sum(drafts.values())
        for i in rows:
            computed[i] += 1 + accepted[i]
        while plain_at != computed:  # the twin catches up one token a step
            behind = [i for i in rows if plain_at[i] < computed[i]]
            _batch_step(plain, _plan(plain_at, behind, {i: 1 for i in behind}, prompt_lens, budget),
                        behind, [_token(i, plain_at[i]) for i in behind])
            for i in behind:
                plain_at[i] += 1
        # The spec world learns of its rejections at its next step: check where none wait.
        for i in rows:
            waiting = spec.book._waiting.get(f"r{i}")
            plain_waiting = plain.book._waiting.get(f"r{i}")
            if (waiting and waiting.kv_lens) or (plain_waiting and plain_waiting.kv_lens):
                continue
            from h2o_vllm.policy import kv_len_after
            kv_len = kv_len_after(computed[i], prompt_lens[i], budget)
            blocks = spec.table[i].long()
            pos = torch.arange(kv_len)
            for name in ("keys", "values"):
                a = getattr(spec.views, name)[blocks[pos // BLOCK], pos % BLOCK]
                b = getattr(plain.views, name)[blocks[pos // BLOCK], pos % BLOCK]
                assert torch.equal(a, b), f"row {i} step {step}: {name}"
            torch.testing.assert_close(spec.scores[blocks[pos // BLOCK], :, pos % BLOCK],
                                       plain.scores[blocks[pos // BLOCK], :, pos % BLOCK],
                                       rtol=1e-5, atol=1e-6)
            compared += 1
    assert drafted > 20 and compared >= 3
    if budget.interval > deferred.MAX_PENDING:  # waiting queries made room for a step's drafts
        assert made_room


def test_a_row_full_of_accepted_drafts_makes_room_for_a_plain_decode_step():
    """Four verification steps, every draft accepted, fill a row's waiting queries; a step
    without drafts (the n-gram lookup found none) then scores them before it stores its own."""
    budget, prompt_lens = Budget(heavy=4, recent=4, interval=40), [20]
    spec, plain = World(1, defer=True), World(1, defer=True)
    for world in (spec, plain):
        _batch_step(world, _plan([0], [0], {0: 20}, prompt_lens, budget), [0], [_token(0, p) for p in range(20)])
    computed = 20
    for _ in range(deferred.MAX_PENDING // 4):
        _batch_step(spec, _plan([computed], [0], {0: 4}, prompt_lens, budget, {0: 3}), [0],
                    [_token(0, computed + j) for j in range(4)])
        computed += 4
    decision = _batch_step(spec, _plan([computed], [0], {0: 1}, prompt_lens, budget), [0], [_token(0, computed)])
    assert decision.before is not None and decision.before.num_queries == deferred.MAX_PENDING
    for n in range(20, computed + 1):
        _batch_step(plain, _plan([n], [0], {0: 1}, prompt_lens, budget), [0], [_token(0, n)])
    # A step of two queries scores what waits in both worlds, before its own.
    flush_spec = _batch_step(spec, _plan([computed + 1], [0], {0: 2}, prompt_lens, budget), [0],
                             [_token(0, computed + 1 + j) for j in range(2)])
    flush_plain = _batch_step(plain, _plan([computed + 1], [0], {0: 2}, prompt_lens, budget), [0],
                              [_token(0, computed + 1 + j) for j in range(2)])
    assert flush_spec.flush is not None and flush_plain.flush is not None
    kv = computed + 3
    blocks = spec.table[0].long()
    pos = torch.arange(kv)
    torch.testing.assert_close(spec.scores[blocks[pos // BLOCK], :, pos % BLOCK],
                               plain.scores[blocks[pos // BLOCK], :, pos % BLOCK], rtol=1e-5, atol=1e-6)
