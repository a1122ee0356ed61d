"""The split-KV decode (h2o_vllm.kernels.split_decode.h2o_split_decode): the output and the
scores of ``h2o_attention`` on the same decode-only batch, whatever the number of splits
(one, several with keys each, more than the shortest row has tiles), weighted, soft-capped,
with sink logits and over an fp8 cache; a padded row of no keys writes zeros and touches no
score. Interpreted on the CPU (TRITON_INTERPRET=1) in fp32 and fp16.
"""
from kernel_cases import (DEVICE, INTERPRETED, NUM_KV_HEADS, int32, make_cache,  # isort: skip
                          make_query, make_sinks, make_weights, shape_ids)

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.kernels import attention, split_decode  # noqa: E402

if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels were compiled (TRITON_INTERPRET unset when first imported) and "
                "there is no GPU", allow_module_level=True)

SHAPES = [(64, 1, 16, torch.float32), (128, 3, 32, torch.float16), (64, 8, 16, torch.float32)]
# Against the 2D kernel: the splits' sums combine in another order (fp32: measured <= 1e-6);
# fp16 also rounds P before P.V against each split's own max (one ulp of the output).
OUT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
SCORE_TOL = dict(rtol=1e-5, atol=1e-5)
KV_LENS = [1, 20, 37, 100, 230]  # one key, inside a block, several blocks, several tiles


def decode_batch(head_size, group, block_size, dtype, kv_lens=KV_LENS):
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(len(kv_lens), NUM_KV_HEADS * group, head_size, dtype)
    return key_cache, value_cache, scores, block_table, query


def run_2d(query, key_cache, value_cache, block_table, kv_lens, scores, scale, **kw):
    out = torch.empty_like(query)
    offsets, num_keys = attention.decode_logit_offsets(torch.ones(len(kv_lens), dtype=torch.int64),
                                                       torch.tensor(kv_lens))
    attention.h2o_attention(query, key_cache, value_cache, out, block_table,
                            int32(list(range(len(kv_lens) + 1))), int32(kv_lens), scale,
                            scores=scores, decode_offsets=offsets.to(DEVICE),
                            num_decode_keys=num_keys, tile_n=16, **kw)
    return out


def run_split(query, key_cache, value_cache, block_table, kv_lens, scores, scale, splits, **kw):
    out = torch.empty_like(query)
    offsets, num_keys = attention.decode_logit_offsets(torch.ones(len(kv_lens), dtype=torch.int64),
                                                       torch.tensor(kv_lens))
    split_decode.h2o_split_decode(query, key_cache, value_cache, out, block_table, int32(kv_lens),
                                  scale, scores, offsets.to(DEVICE), num_keys, num_splits=splits,
                                  tile_n=16, score_tile=32, **kw)
    return out


@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES, ids=shape_ids(SHAPES))
def test_split_decode_is_the_2d_fused_attention(head_size, group, block_size, dtype, splits):
    key_cache, value_cache, scores, block_table, query = decode_batch(head_size, group, block_size, dtype)
    scale = head_size ** -0.5
    want_scores, got_scores = scores.clone(), scores.clone()
    want = run_2d(query, key_cache, value_cache, block_table, KV_LENS, want_scores, scale)
    got = run_split(query, key_cache, value_cache, block_table, KV_LENS, got_scores, scale, splits)
    torch.testing.assert_close(got, want, **OUT_TOL[dtype])
    torch.testing.assert_close(got_scores, want_scores, **SCORE_TOL)
    assert not torch.equal(got_scores, scores)


@pytest.mark.parametrize("case", ["weighted", "softcap", "sinks", "fp8"])
def test_split_decode_keeps_every_variant_of_the_2d_kernel(case):
    head_size, group, block_size, dtype = 64, 3, 16, torch.float32
    key_cache, value_cache, scores, block_table, query = decode_batch(head_size, group, block_size, dtype)
    kw = {}
    if case == "weighted":
        weight, factor = make_weights([1] * len(KV_LENS))
        kw = dict(query_weight=weight, score_scale=factor)
    elif case == "softcap":
        kw = dict(softcap=1.5)
    elif case == "sinks":
        kw = dict(sinks=make_sinks(query.shape[1]))
    else:
        key_cache = (key_cache / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
        value_cache = (value_cache / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn)
        kw = dict(k_scale=0.5, v_scale=0.25)
    want_scores, got_scores = scores.clone(), scores.clone()
    want = run_2d(query, key_cache, value_cache, block_table, KV_LENS, want_scores, 0.125, **kw)
    got = run_split(query, key_cache, value_cache, block_table, KV_LENS, got_scores, 0.125, 8, **kw)
    torch.testing.assert_close(got, want, **OUT_TOL[dtype])
    torch.testing.assert_close(got_scores, want_scores, **SCORE_TOL)
    plain_scores = scores.clone()
    if case != "fp8":  # the variant bites: without it, other scores
        plain = run_split(query, key_cache, value_cache, block_table, KV_LENS, plain_scores, 0.125, 8)
        assert not torch.allclose(plain_scores, got_scores, **SCORE_TOL) or not torch.allclose(plain, got)


def test_a_padded_row_of_no_keys_writes_zeros_and_no_score():
    """A captured batch is padded with rows of 0 keys (vLLM pads seq_lens with 0)."""
    key_cache, value_cache, scores, block_table, query = decode_batch(64, 3, 16, torch.float32,
                                                                      [20, 37])
    kv_lens = [20, 0]
    got_scores = scores.clone()
    out = run_split(query, key_cache, value_cache, block_table, kv_lens, got_scores, 0.125, 4)
    want_scores = scores.clone()
    want = run_2d(query[:1], key_cache, value_cache, block_table, kv_lens[:1], want_scores, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:1], want, **OUT_TOL[torch.float32])
    torch.testing.assert_close(got_scores, want_scores, **SCORE_TOL)


def test_split_decode_rejects_bad_inputs():
    key_cache, value_cache, scores, block_table, query = decode_batch(64, 1, 16, torch.float32, [5])
    args = (key_cache, value_cache, torch.empty_like(query), block_table, int32([5]), 1.0, scores)
    with pytest.raises(ValueError, match="decode_offsets"):
        split_decode.h2o_split_decode(query, *args, torch.zeros(1, dtype=torch.int32, device=DEVICE), 5)
    with pytest.raises(ValueError, match="num_splits"):
        split_decode.h2o_split_decode(query, *args, torch.zeros(1, dtype=torch.int64, device=DEVICE), 5,
                                      num_splits=0)


def test_rows_split_as_vllms_3d_kernel_splits_them_when_they_are_long_enough():
    assert split_decode.num_splits(64, 2, 4096) == 16      # 128 programs: vLLM would split
    assert split_decode.num_splits(65, 2, 4096) == 1       # 130 programs fill the GPU
    assert split_decode.num_splits(4, 8, 32768) == 16
    assert split_decode.num_splits(4, 8, 300) == 2         # at least MIN_SPLIT_KEYS per split
    assert split_decode.num_splits(4, 8, 200) == 1
