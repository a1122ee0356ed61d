"""Tensor parallel, the logic: a rank holding a slice of the KV heads (and their query heads)
scores and compacts exactly what the whole model would for those heads, and the step plan,
hence every block count, does not depend on how many heads a rank holds.
The engine-level check is tests/engine/test_tensor_parallel.py (TP=2 on the CPU)."""
import dataclasses

import pytest
import torch

from h2o_vllm.config import Budget
from h2o_vllm.worker.cpu.layout import CacheViews
from h2o_vllm.worker.cpu.ops import CPUOps
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan
from h2o_vllm.worker.step import make_step, update_scores_and_compact

NUM_HEADS, NUM_KV_HEADS, HEAD, BLOCK, NUM_BLOCKS = 8, 4, 16, 16, 12


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD, generator=g)
    values = torch.randn(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD, generator=g)
    scores = torch.zeros(NUM_BLOCKS, BLOCK, NUM_KV_HEADS)
    table = torch.randperm(NUM_BLOCKS, generator=g)[:8].to(torch.int32)
    return g, keys, values, scores, table


class _RecordingOps(CPUOps):
    """The CPU's ops, recording each compaction's keep-set."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def compact(self, views, scores, block_table, rows, keep, targets):
        self.kept.extend(k[:, :t].clone() for k, t in zip(keep, targets.tolist()))
        super().compact(views, scores, block_table, rows, keep, targets)


def _run(query_prefill, query_decode, keys, values, scores, table, kv_len, target, heavy):
    """Two worker steps of one row through worker.step with the CPU's ops: a (kv_len - 1)-token
    prompt (no compaction), then one decode step compacted to ``target``. Returns its keep-set
    [num_kv_heads, target]."""
    # The CPU ops read K as stored [blocks, heads, dim, block]; scores are [blocks, heads, block].
    views = CacheViews(None, None, keys.permute(0, 2, 3, 1), keys, values)
    scores_by_head = scores.permute(0, 2, 1)
    prompt_len = kv_len - 1
    # first_compaction = max(prompt_len, target + interval) = kv_len: the decode step compacts.
    budget = Budget(heavy=heavy, recent=target - heavy, interval=kv_len - target)
    block_table = table[None]
    ops = _RecordingOps()
    for num_computed, query in ((0, query_prefill), (prompt_len, query_decode)):
        plan = make_step_plan(torch.tensor([num_computed]), torch.tensor([query.shape[0]]),
                              torch.tensor([prompt_len]), [budget])
        slots = kv_slot_mapping(plan, block_table, query.shape[0], BLOCK)
        step = make_step(plan, block_table, slots, BLOCK)
        step = dataclasses.replace(step, device_index=ops.step_index(step, BLOCK))
        update_scores_and_compact(step, ops, query, views, scores_by_head, 0.25)
    assert plan.kv_lens_after.tolist() == [target] and len(ops.kept) == 1
    return ops.kept[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_with_a_slice_of_the_heads_keeps_what_the_whole_model_keeps(tp):
    g, keys, values, scores, table = _state(tp)
    kv_len, target, heavy = 100, 30, 14
    query_prefill = torch.randn(kv_len - 1, NUM_HEADS, HEAD, generator=g)
    query_decode = torch.randn(1, NUM_HEADS, HEAD, generator=g)
    whole = [t.clone() for t in (keys, values, scores)]
    keep_whole = _run(query_prefill, query_decode, *whole, table, kv_len, target, heavy)
    q_per_rank, kv_per_rank = NUM_HEADS // tp, NUM_KV_HEADS // tp
    for rank in range(tp):
        q = slice(rank * q_per_rank, (rank + 1) * q_per_rank)
        kv = slice(rank * kv_per_rank, (rank + 1) * kv_per_rank)
        part = [t[:, :, kv].clone() for t in (keys, values, scores)]
        keep = _run(query_prefill[:, q], query_decode[:, q], *part, table, kv_len, target, heavy)
        assert torch.equal(keep, keep_whole[kv]), f"rank {rank} keeps other tokens"
        assert keep.shape == (kv_per_rank, target), "every rank keeps the same count"
        for mine, ref in zip(part, whole):
            torch.testing.assert_close(mine, ref[:, :, kv], rtol=0, atol=0)


def test_the_step_plan_has_no_head_dimension():
    """Every rank builds its plan from the same batch, so all ranks compact the same rows to
    the same lengths, and the scheduler's one count fits all of them."""
    budgets = [Budget(heavy=3, recent=3, interval=16), Budget(heavy=8, recent=8, interval=32),
               Budget(heavy=8, recent=8, interval=32), Budget(heavy=15, recent=15, interval=1)]
    kwargs = dict(num_computed=torch.tensor([0, 40, 47, 200]), query_lens=torch.tensor([33, 1, 1, 1]),
                  prompt_lens=torch.tensor([33, 40, 40, 150]), budgets=budgets)
    a, b = make_step_plan(**kwargs), make_step_plan(**kwargs)
    for field in ("kv_lens_before", "kv_seq_lens", "kv_lens_after", "query_lens", "heavy", "due"):
        assert getattr(a, field).shape == (4,)
        assert torch.equal(getattr(a, field), getattr(b, field))
