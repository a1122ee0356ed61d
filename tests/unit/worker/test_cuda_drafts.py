"""worker.cuda.drafts: on the CUDA path a verification step's queries are held one step and the
accepted ones scored then, so the scores are those of plain decoding (docs/semantics.md,
"Speculative decoding"). Runs the fused attention and the score kernels (interpreted without
a GPU) on one layer, against a twin that decodes the accepted tokens one a step."""
import dataclasses

import pytest
import torch

from h2o_vllm.config import Budget
from h2o_vllm.policy import draft_step_limit, kv_len_after
from h2o_vllm.worker import step as worker_step
from h2o_vllm.worker.cuda.drafts import DraftBook, HeldQueries
from h2o_vllm.worker.cuda.ops import TritonOps
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan
from h2o_vllm.score_modes import Decay

BLOCK, NUM_KV_HEADS, HEAD, GROUP, MAX_BLOCKS = 16, 2, 16, 2, 6
SCALE = HEAD ** -0.5


class World:
    """One CUDA-path layer: Triton attention's cache layout, scores, the draft book."""

    def __init__(self, num_rows: int) -> None:
        self.kv_cache = torch.zeros(num_rows * MAX_BLOCKS + 1, NUM_KV_HEADS, BLOCK, 2 * HEAD)
        self.ops = TritonOps(HEAD)
        self.views = self.ops.cache_views(self.kv_cache)
        self.scores = torch.zeros(self.kv_cache.shape[0], NUM_KV_HEADS, BLOCK)
        self.table = torch.arange(1, num_rows * MAX_BLOCKS + 1, dtype=torch.int32).view(num_rows, MAX_BLOCKS)
        self.book, self.held = DraftBook(), HeldQueries()

    def step(self, plan, rows, tokens):
        query = torch.stack([t[0] for t in tokens])
        table = self.table[torch.tensor(rows)]
        slots = kv_slot_mapping(plan, table, len(tokens), BLOCK)
        self.views.keys[slots // BLOCK, slots % BLOCK] = torch.stack([t[1] for t in tokens])
        self.views.values[slots // BLOCK, slots % BLOCK] = torch.stack([t[2] for t in tokens])
        step = worker_step.make_step(plan, table, slots, BLOCK)
        step = dataclasses.replace(step, device_index=self.ops.step_index(step, BLOCK))
        decision = self.book.decide(step)
        if decision is not None:
            self.held.apply(decision, step, query, self.views.keys, self.scores, SCALE)
        out = torch.empty_like(query)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(plan.query_lens, 0).to(torch.int32)])
        self.ops.attend(step, query, self.views, out, self.scores, SCALE, qsl)
        worker_step.update_scores_and_compact(step, self.ops, query, self.views, self.scores, SCALE,
                                              accumulated=True)
        return decision


def _token(req: int, pos: int, accepted: bool = True, salt: int = 0):
    gen = torch.Generator().manual_seed(req * 100_003 + pos * 7 + (0 if accepted else 1_000_000 + salt))
    return (torch.randn(NUM_KV_HEADS * GROUP, HEAD, generator=gen),
            *torch.randn(2, NUM_KV_HEADS, HEAD, generator=gen))


def _plan(computed, rows, q, prompt_lens, budget, drafts=None):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    plan = make_step_plan(t([computed[i] for i in rows]), t([q[i] for i in rows]),
                          t([prompt_lens[i] for i in rows]), [budget] * len(rows),
                          None if drafts is None else t([drafts[i] for i in rows]))
    return dataclasses.replace(plan, req_ids=tuple(f"r{i}" for i in rows))


@pytest.mark.parametrize("budget", [Budget(heavy=4, recent=4, interval=6),
                                    Budget(heavy=3, recent=5, interval=7, scoring=(Decay(0.9),))],
                         ids=["paper", "decay"])
def test_held_queries_leave_the_scores_of_plain_decoding(budget):
    prompt_lens, rng = [20, 9], torch.Generator().manual_seed(5)
    spec, plain = World(2), World(2)
    rows = [0, 1]
    for world in (spec, plain):
        world.step(_plan([0, 0], rows, prompt_lens, prompt_lens, budget), rows,
                   [_token(i, p) for i in rows for p in range(prompt_lens[i])])
    computed, plain_at, scored, compared = list(prompt_lens), list(prompt_lens), 0, 0
    for step in range(24):
        q = {i: min(4, draft_step_limit(computed[i], prompt_lens[i], budget)) for i in rows}
        accepted = {i: q[i] - 1 if bool(torch.rand(1, generator=rng) < 0.5)
                    else int(torch.randint(0, q[i], (1,), generator=rng)) for i in rows}
        tokens = [_token(i, computed[i] + j, accepted=j <= accepted[i], salt=step)
                  for i in rows for j in range(q[i])]
        decision = spec.step(_plan(computed, rows, q, prompt_lens, budget, {i: q[i] - 1 for i in rows}),
                             rows, tokens)
        scored += decision is not None and decision.score is not None
        for i in rows:
            computed[i] += 1 + accepted[i]
        while plain_at != computed:
            behind = [i for i in rows if plain_at[i] < computed[i]]
            plain.step(_plan(plain_at, behind, {i: 1 for i in behind}, prompt_lens, budget), behind,
                       [_token(i, plain_at[i]) for i in behind])
            for i in behind:
                plain_at[i] += 1
        for i in rows:  # a row that held nothing this step has every query scored
            if q[i] > 1:
                continue
            kv_len = kv_len_after(computed[i], prompt_lens[i], budget)
            pos = torch.arange(kv_len)
            blocks = spec.table[i].long()[pos // BLOCK]
            assert torch.equal(spec.views.keys[blocks, pos % BLOCK], plain.views.keys[blocks, pos % BLOCK])
            torch.testing.assert_close(spec.scores[blocks, :, pos % BLOCK], plain.scores[blocks, :, pos % BLOCK],
                                       rtol=1e-5, atol=1e-6)
            compared += 1
    assert scored > 5 and compared >= 3
