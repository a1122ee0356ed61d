"""Triton kernels (h2o_vllm.kernels) against their torch twins, and the twins against dense math.

Without a GPU the kernels run under Triton's interpreter (``kernel_cases`` sets
TRITON_INTERPRET=1 before the kernel modules are imported); export TRITON_INTERPRET=0 on a
CUDA machine to run the same tests compiled on the GPU. Each score op is checked unweighted
(paper H2O) and weighted (score decay and query weights: ``query_weight``, ``score_scale``).
"""
from kernel_cases import (DEVICE, INTERPRETED, NUM_KV_HEADS, SHAPE_IDS, SHAPES, TOL,  # isort: skip
                          dense_row_keys, dense_scores, int32, make_cache, make_query,
                          make_sinks, make_weights)

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.kernels import torch_ops  # noqa: E402
from h2o_vllm.kernels import compact as compact_kernels  # noqa: E402
from h2o_vllm.kernels import decode_scores, prefill_scores  # noqa: E402

if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels were compiled (TRITON_INTERPRET unset when first imported) and "
                "there is no GPU", allow_module_level=True)


# ---- kernels vs torch twins -------------------------------------------------------------------

def weights_of(weighted, q_lens):
    """The launchers' weight keywords: none (paper H2O) or make_weights'."""
    if not weighted:
        return {}
    query_weight, score_scale = make_weights(q_lens)
    return dict(query_weight=query_weight, score_scale=score_scale)


WEIGHTED = pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])


@WEIGHTED
@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES, ids=SHAPE_IDS)
def test_accumulate_decode_scores_matches_torch(head_size, group, block_size, dtype, weighted):
    kv_lens = [5, 100, 37, 1]  # shorter than a block, several blocks, ragged, a single key
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(len(kv_lens), NUM_KV_HEADS * group, head_size, dtype)
    weights = weights_of(weighted, [1] * len(kv_lens))
    expected = scores.clone()
    torch_ops.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens), expected,
                                   head_size ** -0.5, **weights)
    assert not torch.equal(expected, scores)
    decode_scores.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens), scores,
                                           head_size ** -0.5, block_n=32, **weights)
    torch.testing.assert_close(scores, expected, **TOL[dtype])


# (q_len, kv_len) per row: fresh prompt shorter than a block; chunk 2 of a chunked prefill (70
# earlier keys); a whole prompt over several blocks; a decode row mixed into the batch.
PREFILL_ROWS = [(5, 5), (30, 100), (37, 37), (1, 20)]


@WEIGHTED
@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES, ids=SHAPE_IDS)
def test_accumulate_prefill_scores_matches_torch(head_size, group, block_size, dtype, weighted):
    q_lens, kv_lens = zip(*PREFILL_ROWS)
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, dtype)
    query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    args = (query, key_cache, block_table, query_start_loc, int32(kv_lens))
    scale = head_size ** -0.5
    # Small tiles so every loop runs several times and ends ragged.
    lse = prefill_scores.prefill_lse(*args, scale, block_m=16, block_n=16)
    torch.testing.assert_close(lse, torch_ops.prefill_lse(*args, scale), rtol=1e-5, atol=1e-4)
    weights = weights_of(weighted, q_lens)
    expected = scores.clone()
    torch_ops.accumulate_prefill_scores(*args, expected, scale, **weights)
    prefill_scores.accumulate_prefill_scores(*args, scores, scale, block_m=16, block_n=16,
                                             **weights)
    torch.testing.assert_close(scores, expected, **TOL[dtype])


def _shaped_case(decode: bool, dtype):
    """A decode or prefill score case of the shaped-logit tests (head size 64, 3 query heads
    per KV head, block 16): (q_lens, kernel args, zero scores, kernel, torch twin)."""
    q_lens, kv_lens = ([1] * 3, [5, 100, 37]) if decode else zip(*PREFILL_ROWS)
    key_cache, _, scores, block_table = make_cache(kv_lens, 64, 16, dtype)
    query = make_query(sum(q_lens), NUM_KV_HEADS * 3, 64, dtype)
    if decode:
        return (q_lens, (query, key_cache, block_table, int32(kv_lens)), scores,
                decode_scores.accumulate_decode_scores, torch_ops.accumulate_decode_scores)
    starts = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    return (q_lens, (query, key_cache, block_table, starts, int32(kv_lens)), scores,
            prefill_scores.accumulate_prefill_scores, torch_ops.accumulate_prefill_scores)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_soft_capped_scores_match_torch(decode):
    """Gemma 2's soft-cap: the kernels' scores are the capped softmax (a cap of 1.5 bites on
    these logits: the uncapped scores differ)."""
    cap, dtype, scale = 1.5, torch.float32, 64 ** -0.5
    q_lens, args, scores, kernel, twin = _shaped_case(decode, dtype)
    if not decode:
        torch.testing.assert_close(prefill_scores.prefill_lse(*args, scale, softcap=cap, block_m=16, block_n=16),
                                   torch_ops.prefill_lse(*args, scale, softcap=cap), rtol=1e-5, atol=1e-4)
    expected, uncapped = scores.clone(), scores.clone()
    twin(*args, expected, scale, softcap=cap)
    twin(*args, uncapped, scale)
    assert not torch.allclose(expected, uncapped, **TOL[dtype])
    kernel(*args, scores, scale, softcap=cap, block_n=16)
    torch.testing.assert_close(scores, expected, **TOL[dtype])


@WEIGHTED
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_scores_with_sink_logits_match_torch(decode, weighted):
    """gpt-oss's sink logits: each query head's sink joins its softmax's denominator (the
    sinks take a sizeable share here: the scores without them differ). bf16 sinks, as a bf16
    model stores them, are upcast on load."""
    dtype, scale = torch.float32, 64 ** -0.5
    q_lens, args, scores, kernel, twin = _shaped_case(decode, dtype)
    sinks, weights = make_sinks(NUM_KV_HEADS * 3).bfloat16(), weights_of(weighted, q_lens)
    if not decode:
        torch.testing.assert_close(prefill_scores.prefill_lse(*args, scale, sinks=sinks, block_m=16, block_n=16),
                                   torch_ops.prefill_lse(*args, scale, sinks=sinks), rtol=1e-5, atol=1e-4)
    expected, sinkless = scores.clone(), scores.clone()
    twin(*args, expected, scale, sinks=sinks, **weights)
    twin(*args, sinkless, scale, **weights)
    assert not torch.allclose(expected, sinkless, **TOL[dtype])
    kernel(*args, scores, scale, sinks=sinks, block_n=16, **weights)
    torch.testing.assert_close(scores, expected, **TOL[dtype])


def test_prefill_scores_start_at_each_rows_first_scored_query():
    """first_scored (an observation window's start): the queries before it are left out of
    pass 2, even where their weights are not 0, and a row with none left keeps its old scores
    but still decays them."""
    head_size, group, block_size, dtype = 64, 3, 16, torch.float32
    q_lens, kv_lens = zip(*PREFILL_ROWS)
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, dtype)
    query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    args = (query, key_cache, block_table, query_start_loc, int32(kv_lens))
    weights = dict(query_weight=torch.rand(sum(q_lens), device=DEVICE) + 0.5,
                   score_scale=torch.rand(len(q_lens), device=DEVICE) + 0.5,
                   first_scored=int32([2, 20, 37, 1]))
    expected = scores.clone()
    torch_ops.accumulate_prefill_scores(*args, expected, 0.125, **weights)
    prefill_scores.accumulate_prefill_scores(*args, scores, 0.125, block_m=16, block_n=16, **weights)
    torch.testing.assert_close(scores, expected, **TOL[dtype])
    all_queries = scores.clone()
    prefill_scores.accumulate_prefill_scores(*args, all_queries, 0.125, block_m=16, block_n=16,
                                             query_weight=weights["query_weight"],
                                             score_scale=weights["score_scale"])
    assert not torch.allclose(all_queries, scores)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_unit_weights_are_the_plain_kernels_bit_for_bit(decode):
    """Weights 1 and factors 1 (paper rows in a weighted batch) change no bit: the weighted
    variant multiplies by exactly 1.0 where the plain one does not multiply."""
    head_size, group, block_size, dtype = 64, 3, 16, torch.float32
    q_lens, kv_lens = ([1] * 4, [5, 100, 37, 1]) if decode else zip(*PREFILL_ROWS)
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, dtype)
    ones = dict(query_weight=torch.ones(sum(q_lens), device=DEVICE),
                score_scale=torch.ones(len(q_lens), device=DEVICE))
    results = []
    for weights in ({}, ones):
        out = scores.clone()
        if decode:
            decode_scores.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens),
                                                   out, 0.125, block_n=32, **weights)
        else:
            query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
            prefill_scores.accumulate_prefill_scores(
                query, key_cache, block_table, query_start_loc, int32(kv_lens), out, 0.125,
                block_m=16, block_n=16, **weights)
        results.append(out)
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], scores)


def keep_patterns(kv_len, target, gen):
    """[NUM_KV_HEADS, target] ascending keep sets: a prefix in place (not moved) then random,
    the most recent (maximal overlap)."""
    fixed = target // 4
    rand = torch.cat([torch.arange(fixed),
                      fixed + torch.randperm(kv_len - fixed, generator=gen)[:target - fixed].sort().values])
    recent = torch.arange(kv_len - target, kv_len)
    return torch.stack([rand, recent][:NUM_KV_HEADS])


def triton_layout(key_cache, value_cache):
    """The same K and V as views of one Triton-attention kv_cache [num_blocks, num_kv_heads,
    block_size, 2 * head_size] (TritonOps.cache_views), where compact_rows moves both at once."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    kv_cache = torch.empty(num_blocks, num_kv_heads, block_size, 2 * head_size,
                           dtype=key_cache.dtype, device=key_cache.device)
    keys, values = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    keys.copy_(key_cache)
    values.copy_(value_cache)
    return keys, values


@pytest.mark.parametrize("layout", ["separate", "triton"])
@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_compact_rows_matches_torch(head_size, group, block_size, dtype, layout):
    kv_lens = [100, 9, 70, 45]
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size,
                                                             dtype)
    key_cache = torch.nan_to_num(key_cache)  # so that torch.equal can compare whole caches
    if layout == "triton":
        key_cache, value_cache = triton_layout(key_cache, value_cache)
        assert compact_kernels._k_and_v_in_one_row(key_cache, value_cache)
    gen = torch.Generator().manual_seed(2)
    rows, target = [0, 2, 3], 40  # row 1 is not selected and must stay untouched
    keep_idx = torch.stack([keep_patterns(kv_lens[r], target, gen) for r in rows]).to(DEVICE)
    # Each row its own target (worker.due_pass): row 2 keeps none (not due) and moves nothing.
    targets = torch.tensor([40, 0, 25], device=DEVICE)
    before = [dense_row_keys(key_cache, block_table, r, kv_lens[r]) for r in rows]
    expected = [t.clone() for t in (key_cache, value_cache, scores)]
    torch_ops.compact_rows(*expected, block_table, torch.tensor(rows, device=DEVICE), keep_idx, targets)
    # Small tiles and column chunks: several of each, and ragged in the head's columns.
    compact_kernels.compact_rows(key_cache, value_cache, scores, block_table,
                                 int32(rows), keep_idx, targets, block_t=16, d_chunk_max=16)
    for got, want in zip((key_cache, value_cache, scores), expected):
        assert torch.equal(got, want)
    for i, r in enumerate(rows):  # the kept keys really are where they should be
        n = int(targets[i])
        after = dense_row_keys(key_cache, block_table, r, kv_lens[r])
        for h in range(NUM_KV_HEADS):
            assert torch.equal(after[:n, h], before[i][keep_idx[i, h, :n].cpu(), h])
            assert torch.equal(after[n:, h], before[i][n:, h])  # past the target: as it was


# ---- torch twins vs dense math ----------------------------------------------------------------

@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@WEIGHTED
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_reference_scores_match_dense_softmax(decode, weighted, with_sinks):
    """Twins vs the dense formula: s(t) <- score_scale[row] * s(t) + sum_q query_weight[q] * p_q(t)
    over the live t of each row (unweighted: factor 1, weights 1); every other slot unchanged.
    With sinks, p_q is the softmax with each head's sink logit as one more entry, dropped."""
    head_size, group, block_size = 16, 2, 4
    q_lens, kv_lens = ([1, 1, 1], [3, 9, 6]) if decode else ([3, 4, 6], [3, 9, 6])
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, torch.float32)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, torch.float32)
    weights = weights_of(weighted, q_lens)
    sinks = make_sinks(NUM_KV_HEADS * group) if with_sinks else None
    before = scores.clone()
    if decode:
        torch_ops.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens), scores,
                                       0.3, sinks=sinks, **weights)
    else:
        query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
        torch_ops.accumulate_prefill_scores(query, key_cache, block_table, query_start_loc,
                                        int32(kv_lens), scores, 0.3, sinks=sinks, **weights)
    keys = [dense_row_keys(key_cache, block_table, r, n) for r, n in enumerate(kv_lens)]
    weight = weights["query_weight"].cpu() if weighted else torch.ones(sum(q_lens))
    factor = weights["score_scale"].cpu() if weighted else torch.ones(len(q_lens))
    dense = dense_scores(query.cpu(), [k.cpu() for k in keys], q_lens, kv_lens, group, 0.3, weight,
                         None if sinks is None else sinks.cpu())
    touched = torch.zeros_like(scores, dtype=torch.bool)
    starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    for row, (col, n) in enumerate(zip(dense, kv_lens)):
        for t in range(n):
            blk, off = int(block_table[row, t // block_size]), t % block_size
            want = factor[row].double() * before[blk, :, off].cpu().double() + col[t]
            torch.testing.assert_close(scores[blk, :, off], want.float().to(DEVICE),
                                       rtol=1e-5, atol=1e-6)
            touched[blk, :, off] = True
        # Each query's probabilities sum to 1: the column sums add up to sum_q w_q * num_q_heads
        # (less, with sinks: their share is nobody's).
        total = float(weight[starts[row]:starts[row + 1]].double().sum()) * NUM_KV_HEADS * group
        if with_sinks:
            assert col.sum().item() < total or total == 0
        else:
            assert col.sum().item() == pytest.approx(total)
    assert torch.equal(scores[~touched], before[~touched])


def test_reference_compact_rows_matches_dense_gather():
    head_size, block_size, kv_lens = 8, 4, [11, 7]
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size,
                                                             torch.float32)
    keep_idx = torch.tensor([[[0, 4, 9, 10], [6, 7, 8, 10]]], device=DEVICE)
    dense = [dense_row_keys(c, block_table, 0, 11) for c in (key_cache, value_cache)]
    dense_s = torch.stack([scores[int(block_table[0, t // block_size]), :, t % block_size]
                           for t in range(11)])
    torch_ops.compact_rows(key_cache, value_cache, scores, block_table,
                           torch.tensor([0], device=DEVICE), keep_idx)
    for h in range(NUM_KV_HEADS):
        idx = keep_idx[0, h].cpu()
        for t in range(4):
            blk, off = int(block_table[0, t // block_size]), t % block_size
            assert torch.equal(key_cache[blk, off, h].float(), dense[0][idx[t], h])
            assert torch.equal(value_cache[blk, off, h].float(), dense[1][idx[t], h])
            assert scores[blk, h, off] == dense_s[idx[t], h]


# ---- launcher checks --------------------------------------------------------------------------

def test_launchers_reject_bad_inputs():
    key_cache, value_cache, scores, block_table = make_cache([5], 64, 16, torch.float32)
    query = make_query(1, 2, 64, torch.float32)
    lens = int32([5])
    decode = decode_scores.accumulate_decode_scores
    with pytest.raises(TypeError, match="scores must be float32"):
        decode(query, key_cache, block_table, lens, scores.bfloat16(), 1.0)
    with pytest.raises(ValueError, match="block_table must be"):
        decode(query, key_cache, block_table.long(), lens, scores, 1.0)
    with pytest.raises(TypeError, match="query dtype"):
        decode(query.bfloat16(), key_cache, block_table, lens, scores, 1.0)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        decode(make_query(1, 3, 64, torch.float32), key_cache, block_table, lens, scores, 1.0)
    with pytest.raises(ValueError, match="head_size"):
        decode(query, key_cache.transpose(2, 3), block_table, lens, scores, 1.0)
    with pytest.raises(ValueError, match="keep_idx must be"):
        compact_kernels.compact_rows(key_cache, value_cache, scores, block_table, int32([0]),
                                     torch.zeros(1, 1, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="sinks must be \\[2\\]"):  # one per query head, not per KV head
        decode(query, key_cache, block_table, lens, scores, 1.0, sinks=torch.ones(1, device=DEVICE))
    ones = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="give both or neither"):
        decode(query, key_cache, block_table, lens, scores, 1.0, query_weight=ones)
    with pytest.raises(ValueError, match="score_scale must be"):
        prefill_scores.accumulate_prefill_scores(query, key_cache, block_table, int32([0, 1]), lens,
                                                 scores, 1.0, query_weight=ones,
                                                 score_scale=ones.double())


def test_compact_rows_moves_an_fp8_cache_byte_for_byte():
    """An fp8 cache is moved as bytes (no float conversion on the way): the same moves as the
    torch twin's on the raw bytes."""
    head_size, block_size, kv_lens = 64, 16, [100, 9, 70, 45]
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size,
                                                             torch.float32)
    key_cache, value_cache = triton_layout(*(c.clamp(-448, 448).to(torch.float8_e4m3fn)
                                             for c in (key_cache, value_cache)))
    gen = torch.Generator().manual_seed(2)
    rows, target = [0, 2, 3], 40
    keep_idx = torch.stack([keep_patterns(kv_lens[r], target, gen) for r in rows]).to(DEVICE)
    expected = [key_cache.view(torch.uint8).clone(), value_cache.view(torch.uint8).clone(), scores.clone()]
    torch_ops.compact_rows(*expected, block_table, torch.tensor(rows, device=DEVICE), keep_idx)
    compact_kernels.compact_rows(key_cache, value_cache, scores, block_table,
                                 int32(rows), keep_idx, block_t=16, d_chunk_max=16)
    assert torch.equal(key_cache.view(torch.uint8), expected[0])
    assert torch.equal(value_cache.view(torch.uint8), expected[1])
    assert torch.equal(scores, expected[2])
