"""worker.cpu.scores and worker.cpu.prefill (the CPU path's torch score accumulation and prefill attention, on the CPU backend's cache
layout) against the kernels' torch twins, unweighted and weighted, decode and prefill.

The block table is as vLLM leaves it: a short row's entries past its length are stale and
name other rows' live blocks. Adding probability 0 through them is harmless; decaying through
them would decay another row's scores, which these tests would see.
"""
import pytest
import torch

from h2o_vllm.kernels import torch_ops
from h2o_vllm.worker.cpu import prefill as cpu_prefill
from h2o_vllm.worker.cpu import scores as cpu_scores
from h2o_vllm.worker.cpu.layout import cache_views

BLOCK, NUM_KV_HEADS, HEAD, GROUP, SCALE = 16, 2, 16, 2, 0.25
KV_LENS = [5, 40, 17]
# Each row's live blocks first, then stale entries: row 0's name rows 1 and 2's live blocks.
TABLE = torch.tensor([[3, 6, 1], [6, 2, 7], [1, 4, 2]], dtype=torch.int32)


# The model's own softmax: plain, Gemma 2's soft-cap (1.5 bites on these logits), gpt-oss's
# sink logits (bf16, as a bf16 model stores them; large enough to take a sizeable share).
SHAPING = pytest.mark.parametrize("shaping", [
    {}, {"softcap": 1.5}, {"sinks": (torch.linspace(-1, 3, NUM_KV_HEADS * GROUP)).bfloat16()},
    {"softcap": 1.5, "sinks": torch.full((NUM_KV_HEADS * GROUP,), 1.0)}],
    ids=["plain", "softcap", "sinks", "softcap-sinks"])


def _setup(q_lens, weighted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(8, NUM_KV_HEADS, BLOCK, 2 * HEAD, generator=gen)
    views = cache_views(kv_cache)
    scores = torch.rand(8, NUM_KV_HEADS, BLOCK, generator=gen)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * GROUP, HEAD, generator=gen)
    weights = {}
    if weighted:
        weight = torch.rand(sum(q_lens), generator=gen)
        weight[0] = 0.0
        weights = dict(query_weight=weight, score_scale=torch.rand(len(q_lens), generator=gen) + 0.1)
    return views, scores, query, weights


def _live(scores, row):
    pos = torch.arange(KV_LENS[row])
    return scores[TABLE[row].long()[pos // BLOCK], :, pos % BLOCK]


@SHAPING
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_decode_scores_match_the_twin(weighted, shaping):
    views, scores, query, weights = _setup([1] * 3, weighted)
    expected = scores.clone()
    torch_ops.accumulate_decode_scores(query, views.keys.contiguous(), TABLE,
                                   torch.tensor(KV_LENS, dtype=torch.int32), expected, SCALE,
                                   **weights, **shaping)
    cpu_scores.accumulate_decode_scores(query, views.key_blocks, scores, TABLE,
                                        torch.tensor(KV_LENS), SCALE, **weights, **shaping)
    for row in range(3):
        torch.testing.assert_close(_live(scores, row), _live(expected, row), rtol=1e-5, atol=1e-6)
    assert torch.equal(scores[[0, 5]], expected[[0, 5]])  # blocks no row holds: untouched


def _reference_attention(query, views, row, q_len, softcap=0.0, sinks=None):
    """Causal softmax attention of a row's last q_len positions, from the cache (logits
    soft-capped, each head's sink logit one more softmax entry without a value)."""
    pos = torch.arange(KV_LENS[row])
    blocks, offsets = TABLE[row].long()[pos // BLOCK], pos % BLOCK
    keys = views.keys[blocks, offsets].repeat_interleave(GROUP, dim=1)      # [L, Hq, D]
    values = views.values[blocks, offsets].repeat_interleave(GROUP, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query, keys) * SCALE
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    first = KV_LENS[row] - q_len
    logits.masked_fill_(pos[None, None, :] > (first + torch.arange(q_len))[None, :, None], float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.float()[:, None, None].expand(-1, q_len, 1)], dim=-1)
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :len(pos)], values)


@pytest.mark.parametrize("tile", [128, 4, 5], ids=lambda t: f"tile{t}")
@pytest.mark.parametrize("with_out", [False, True], ids=["scores", "attention"])
@SHAPING
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_prefill_rows_match_the_twin(weighted, with_out, tile, shaping, monkeypatch):
    """Scores (and the attention output) of rows with several queries, across tile borders:
    a tile of 4 or 5 queries splits every row, with diagonal tiles at every offset."""
    monkeypatch.setattr(cpu_prefill, "TILE", tile)
    q_lens = [5, 12, 17]  # a whole prompt, a later chunk (28 earlier keys), a whole prompt
    views, scores, query, weights = _setup(q_lens, weighted)
    if weighted:  # an observation window: the first queries weigh 0
        weights["query_weight"][:7] = 0.0
    expected = scores.clone()
    starts = torch.tensor([0] + q_lens).cumsum(0)
    torch_ops.accumulate_prefill_scores(query, views.keys.contiguous(), TABLE,
                                    starts.to(torch.int32), torch.tensor(KV_LENS, dtype=torch.int32),
                                    expected, SCALE, **weights, **shaping)
    out = torch.full_like(query, float("nan"))
    for row, (start, q_len) in enumerate(zip(starts.tolist(), q_lens)):
        row_weights = {} if not weighted else dict(
            query_weight=weights["query_weight"][start:start + q_len],
            score_scale=weights["score_scale"][row],
            first_scored=min(q_len, max(0, 7 - start)))
        cpu_prefill.prefill_attention(query[start:start + q_len], views.key_blocks, views.values,
                                      scores, TABLE[row], KV_LENS[row], SCALE,
                                      out=out[start:start + q_len] if with_out else None, **row_weights,
                                      **shaping)
    for row in range(3):
        torch.testing.assert_close(_live(scores, row), _live(expected, row), rtol=1e-5, atol=1e-6)
    assert torch.equal(scores[[0, 5]], expected[[0, 5]])
    if with_out:
        for row, (start, q_len) in enumerate(zip(starts.tolist(), q_lens)):
            torch.testing.assert_close(out[start:start + q_len],
                                       _reference_attention(query[start:start + q_len], views, row, q_len,
                                                            **shaping),
                                       rtol=1e-5, atol=1e-5)
