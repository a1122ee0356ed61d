"""Tensor parallel, the logic: a rank holding a slice of the KV heads (and their query heads)
scores and compacts exactly what the whole model would for those heads, and the step plan,
hence every block count, does not depend on how many heads a rank holds.
The engine-level check is tests/engine/test_tensor_parallel.py (TP=2 on the CPU)."""
import pytest
import torch

from h2o_vllm.worker.compact import compact_row
from h2o_vllm.worker.plan import make_step_plan
from h2o_vllm.worker.scores import accumulate_decode_scores, accumulate_prefill_scores

NUM_HEADS, NUM_KV_HEADS, HEAD, BLOCK, NUM_BLOCKS = 8, 4, 16, 16, 12


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD, generator=g)
    values = torch.randn(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD, generator=g)
    scores = torch.zeros(NUM_BLOCKS, BLOCK, NUM_KV_HEADS)
    table = torch.randperm(NUM_BLOCKS, generator=g)[:8].to(torch.int32)
    return g, keys, values, scores, table


def _run(query_prefill, query_decode, keys, values, scores, table, kv_len, target, heavy):
    # The score functions take the cache's own layouts: K [blocks, heads, dim, block], scores [blocks, heads, block].
    key_blocks, scores_by_head = keys.permute(0, 2, 3, 1), scores.permute(0, 2, 1)
    accumulate_prefill_scores(query_prefill, key_blocks, scores_by_head, table, kv_len - 1, 0.25)
    accumulate_decode_scores(query_decode, key_blocks, scores_by_head, table[None], torch.tensor([kv_len]), 0.25)
    return compact_row(keys, values, scores, table, kv_len, target, heavy)


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
    kwargs = dict(num_computed=torch.tensor([0, 40, 47, 200]), query_lens=torch.tensor([33, 1, 1, 1]),
                  prompt_lens=torch.tensor([33, 40, 40, 150]), heavy=torch.tensor([3, 8, 8, 15]),
                  recent=torch.tensor([3, 8, 8, 15]), interval=torch.tensor([16, 32, 32, 1]))
    a, b = make_step_plan(**kwargs), make_step_plan(**kwargs)
    for field in ("kv_lens_before", "kv_lens_after", "query_lens", "heavy", "recent"):
        assert getattr(a, field).shape == (4,)
        assert torch.equal(getattr(a, field), getattr(b, field))
