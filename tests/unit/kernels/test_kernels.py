"""Triton kernels (h2o_vllm.kernels) against their torch twins, and the twins against dense math.

Without a GPU the kernels run under Triton's interpreter: TRITON_INTERPRET must be set before
``@triton.jit`` runs (at import of the kernel modules), hence the setdefault above the imports.
Export TRITON_INTERPRET=0 on a CUDA machine to run the same tests compiled on the GPU.
Sizes are small because the interpreter is slow (numpy per program).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.kernels import twins  # noqa: E402
from h2o_vllm.kernels import compact as compact_kernels  # noqa: E402
from h2o_vllm.kernels import decode_scores, prefill_scores  # noqa: E402

_INTERPRETED = type(decode_scores.accumulate_decode_scores_kernel).__name__ == "InterpretedFunction"
if not _INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels were compiled (TRITON_INTERPRET unset when first imported) and "
                "there is no GPU", allow_module_level=True)
DEVICE = "cpu" if _INTERPRETED else "cuda"
NUM_KV_HEADS = 2
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-3, atol=2e-3)}

# (head_size, group, block_size, dtype): every value of each axis appears at least once.
SHAPES = [
    (64, 1, 16, torch.float32),
    (128, 3, 32, torch.bfloat16),
    (64, 8, 16, torch.bfloat16),
    (128, 8, 32, torch.float32),
    (64, 3, 16, torch.float32),
]
SHAPE_IDS = [f"d{d}-g{g}-bs{bs}-{str(t)[6:]}" for d, g, bs, t in SHAPES]


def make_cache(kv_lens, head_size, block_size, dtype, seed=0):
    """Random paged caches; each row gets a shuffled (non-contiguous) set of blocks.

    Returns key_cache, value_cache [num_blocks, block_size, NUM_KV_HEADS, head_size],
    scores [num_blocks, NUM_KV_HEADS, block_size] fp32 (random, so "+=" is checked),
    block_table [num_rows, max_blocks] int32 (unused entries point at a poisoned block).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    scores = torch.rand(num_blocks, NUM_KV_HEADS, block_size, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    poison = 0  # block 0 is never allocated: NaN keys catch reads outside a row's live range
    key_cache[poison] = float("nan")
    block_table = torch.full((len(kv_lens), max(need) + 1), poison, dtype=torch.int32)
    start = 0
    for row, n in enumerate(need):
        block_table[row, :n] = perm[start:start + n].to(torch.int32)
        start += n
    for row, n in enumerate(kv_lens):  # stale slots past kv_len in a row's last block
        pos = torch.arange(n, need[row] * block_size)
        key_cache[block_table[row, pos // block_size].long(), pos % block_size] = float("nan")
    to = dict(device=DEVICE)
    return (key_cache.to(**to), value_cache.to(**to), scores.to(**to), block_table.to(**to))


def make_query(num_tokens, num_q_heads, head_size, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    # x2: peakier softmax than unit-variance logits, closer to trained models.
    return (2 * torch.randn(num_tokens, num_q_heads, head_size, generator=gen)).to(dtype).to(DEVICE)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def dense_row_keys(key_cache, block_table, row, kv_len):
    block_size = key_cache.shape[1]
    return torch.stack([key_cache[int(block_table[row, t // block_size]), t % block_size]
                        for t in range(kv_len)]).float()  # [kv_len, heads, head_size]


# ---- kernels vs torch twins -------------------------------------------------------------------

@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES, ids=SHAPE_IDS)
def test_accumulate_decode_scores_matches_torch(head_size, group, block_size, dtype):
    kv_lens = [5, 100, 37, 1]  # shorter than a block, several blocks, ragged, a single key
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(len(kv_lens), NUM_KV_HEADS * group, head_size, dtype)
    expected = scores.clone()
    twins.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens), expected,
                                       head_size ** -0.5)
    assert not torch.equal(expected, scores)
    decode_scores.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens), scores,
                                           head_size ** -0.5, block_n=32)
    torch.testing.assert_close(scores, expected, **TOL[dtype])


# (q_len, kv_len) per row: fresh prompt shorter than a block; chunk 2 of a chunked prefill (70
# earlier keys); a whole prompt over several blocks; a decode row mixed into the batch.
PREFILL_ROWS = [(5, 5), (30, 100), (37, 37), (1, 20)]


@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES, ids=SHAPE_IDS)
def test_accumulate_prefill_scores_matches_torch(head_size, group, block_size, dtype):
    q_lens, kv_lens = zip(*PREFILL_ROWS)
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, dtype)
    query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    args = (query, key_cache, block_table, query_start_loc, int32(kv_lens))
    scale = head_size ** -0.5
    # Small tiles so every loop runs several times and ends ragged.
    lse = prefill_scores.prefill_lse(*args, scale, block_m=16, block_n=16)
    torch.testing.assert_close(lse, twins.prefill_lse(*args, scale), rtol=1e-5, atol=1e-4)
    expected = scores.clone()
    twins.accumulate_prefill_scores(*args, expected, scale)
    prefill_scores.accumulate_prefill_scores(*args, scores, scale, block_m=16, block_n=16)
    torch.testing.assert_close(scores, expected, **TOL[dtype])


def keep_patterns(kv_len, target, gen):
    """[NUM_KV_HEADS, target] ascending keep sets: random, the most recent (maximal overlap)."""
    rand = torch.randperm(kv_len, generator=gen)[:target].sort().values
    recent = torch.arange(kv_len - target, kv_len)
    return torch.stack([rand, recent][:NUM_KV_HEADS])


@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_compact_rows_matches_torch(head_size, group, block_size, dtype):
    kv_lens = [100, 9, 70, 45]
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size,
                                                             dtype)
    key_cache = torch.nan_to_num(key_cache)  # so that torch.equal can compare whole caches
    gen = torch.Generator().manual_seed(2)
    rows, target = [0, 2, 3], 40  # row 1 is not selected and must stay untouched
    keep_idx = torch.stack([keep_patterns(kv_lens[r], target, gen) for r in rows]).to(DEVICE)
    before = [dense_row_keys(key_cache, block_table, r, kv_lens[r]) for r in rows]
    expected = [t.clone() for t in (key_cache, value_cache, scores)]
    twins.compact_rows(*expected, block_table, torch.tensor(rows, device=DEVICE), keep_idx)
    compact_kernels.compact_rows(key_cache, value_cache, scores, block_table,
                                 int32(rows), keep_idx, block_t=16)
    for got, want in zip((key_cache, value_cache, scores), expected):
        assert torch.equal(got, want)
    for i, r in enumerate(rows):  # the kept keys really are where they should be
        after = dense_row_keys(key_cache, block_table, r, target)
        for h in range(NUM_KV_HEADS):
            assert torch.equal(after[:, h], before[i][keep_idx[i, h].cpu(), h])


# ---- torch twins vs dense math ----------------------------------------------------------------

def dense_scores(query, keys, q_lens, kv_lens, group, scale):
    """Per row, [kv_len, kv_heads] column sums of the causal softmax, one query head at a time."""
    out, start = [], 0
    for k, q_len, kv_len in zip(keys, q_lens, kv_lens):
        col = torch.zeros(kv_len, k.shape[1], dtype=torch.float64)
        for j in range(q_len):
            pos = kv_len - q_len + j
            for h in range(query.shape[1]):
                logits = (k[:pos + 1, h // group].double() @ query[start + j, h].double()) * scale
                col[:pos + 1, h // group] += torch.softmax(logits, dim=0)
        out.append(col)
        start += q_len
    return out


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_reference_scores_match_dense_softmax(decode):
    head_size, group, block_size = 16, 2, 4
    q_lens, kv_lens = ([1, 1, 1], [3, 9, 6]) if decode else ([3, 4, 6], [3, 9, 6])
    key_cache, _, scores, block_table = make_cache(kv_lens, head_size, block_size, torch.float32)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, torch.float32)
    before = scores.clone()
    if decode:
        twins.accumulate_decode_scores(query, key_cache, block_table, int32(kv_lens), scores,
                                           0.3)
    else:
        query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
        twins.accumulate_prefill_scores(query, key_cache, block_table, query_start_loc,
                                            int32(kv_lens), scores, 0.3)
    keys = [dense_row_keys(key_cache, block_table, r, n) for r, n in enumerate(kv_lens)]
    dense = dense_scores(query.cpu(), [k.cpu() for k in keys], q_lens, kv_lens, group, 0.3)
    touched = torch.zeros_like(scores, dtype=torch.bool)
    for row, (col, n) in enumerate(zip(dense, kv_lens)):
        for t in range(n):
            blk, off = int(block_table[row, t // block_size]), t % block_size
            torch.testing.assert_close(scores[blk, :, off] - before[blk, :, off],
                                       col[t].float().to(DEVICE), rtol=1e-5, atol=1e-6)
            touched[blk, :, off] = True
        # Each query's probabilities sum to 1: the column sums add up to q_len * num_q_heads.
        assert col.sum().item() == pytest.approx(q_lens[row] * NUM_KV_HEADS * group)
    assert torch.equal(scores[~touched], before[~touched])


def test_reference_compact_rows_matches_dense_gather():
    head_size, block_size, kv_lens = 8, 4, [11, 7]
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size,
                                                             torch.float32)
    keep_idx = torch.tensor([[[0, 4, 9, 10], [6, 7, 8, 10]]], device=DEVICE)
    dense = [dense_row_keys(c, block_table, 0, 11) for c in (key_cache, value_cache)]
    dense_s = torch.stack([scores[int(block_table[0, t // block_size]), :, t % block_size]
                           for t in range(11)])
    twins.compact_rows(key_cache, value_cache, scores, block_table,
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
