"""The fused attention (h2o_vllm.kernels.attention.h2o_attention): its output against vLLM's
``unified_attention``, its scores against the unfused score kernels' torch torch_ops.

Interpreted on the CPU (TRITON_INTERPRET=1, see kernel_cases) in fp32 and fp16; bf16 is
pending a GPU run (export TRITON_INTERPRET=0 there: the interpreter's bf16 arithmetic is wrong
in vLLM's kernel, so the reference itself cannot be trusted here). Each batch mixes what vLLM
schedules in one step: a prefill chunk over earlier keys, a fresh prompt, decode rows of
ragged lengths, a one-key row.
"""
from kernel_cases import (DEVICE, INTERPRETED, NUM_KV_HEADS, int32, make_cache,  # isort: skip
                          make_query, make_sinks, make_weights, shape_ids, vllm_unified_attention)

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.kernels import attention, prefill_scores, torch_ops  # noqa: E402

if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels were compiled (TRITON_INTERPRET unset when first imported) and "
                "there is no GPU", allow_module_level=True)

# (head_size, group, block_size, dtype): each value of each axis at least twice.
SHAPES = [
    (64, 1, 16, torch.float32),
    (128, 3, 32, torch.float16),
    (64, 8, 32, torch.float32),
    (128, 8, 16, torch.float16),
    (64, 3, 16, torch.float32),
    (128, 1, 32, torch.float16),
]
if not INTERPRETED:  # compiled on a GPU: bf16 too
    SHAPES += [(128, 8, 16, torch.bfloat16), (64, 3, 32, torch.bfloat16)]
SHAPE_IDS = shape_ids(SHAPES)
# Output vs vLLM: the same products, fp32 sums in another order (exp2 here, exp there). Measured
# under the interpreter: fp32 <= 8.4e-7; fp16 one ulp (<= 9.8e-4 at |out| < 2), since both
# round P to the cache dtype before P.V and a last bit of that rounding can differ.
OUT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
# Scores vs the twins (fp32 math from the cache's values): only the summation order differs
# (measured <= 2.9e-6, fp32 and fp16 alike).
SCORE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=1e-3, atol=1e-3)}
# (q_len, kv_len) per row: chunk 2 of a chunked prefill (70 earlier keys), a decode row, a
# fresh prompt shorter than a block, a decode row over several blocks, a one-key prompt.
ROWS = [(30, 100), (1, 20), (5, 5), (1, 37), (1, 1)]


def batch(head_size, group, block_size, dtype):
    q_lens, kv_lens = zip(*ROWS)
    key_cache, value_cache, scores, block_table = make_cache(kv_lens, head_size, block_size, dtype)
    query = make_query(sum(q_lens), NUM_KV_HEADS * group, head_size, dtype)
    query_start_loc = int32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    return q_lens, kv_lens, key_cache, value_cache, scores, block_table, query, query_start_loc


def fused_scores(query, key_cache, value_cache, block_table, query_start_loc, q_lens, kv_lens,
                 scores, scale, weights, softcap=0.0, sinks=None):
    """What TritonOps.attend does: the fused kernel, then the prefill rows' pass from its LSE.
    Returns the attention output."""
    out = torch.empty_like(query)
    offsets, num_keys = attention.decode_logit_offsets(torch.tensor(q_lens), torch.tensor(kv_lens))
    lse = attention.h2o_attention(query, key_cache, value_cache, out, block_table,
                                  query_start_loc, int32(kv_lens), scale, scores=scores,
                                  decode_offsets=offsets.to(DEVICE), num_decode_keys=num_keys,
                                  softcap=softcap, sinks=sinks, tile_n=16, score_tile=16, **weights)
    starts = query_start_loc.tolist()
    rows = [r for r, n in enumerate(q_lens) if n > 1]
    tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]).to(DEVICE)
    w = {}
    if weights:
        w = dict(query_weight=weights["query_weight"][tokens],
                 score_scale=weights["score_scale"][torch.tensor(rows, device=DEVICE)])
    prefill_scores.accumulate_prefill_scores_from_lse(
        query[tokens], key_cache, block_table[rows],
        int32([0] + torch.tensor([q_lens[r] for r in rows]).cumsum(0).tolist()),
        int32([kv_lens[r] for r in rows]), lse[tokens], scores, scale, fresh_new_slots=True,
        softcap=softcap, block_m=16, block_n=16, **w)
    return out


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("head_size,group,block_size,dtype", SHAPES, ids=SHAPE_IDS)
def test_fused_attention_is_vllm_attention_plus_unfused_scores(head_size, group, block_size,
                                                              dtype, weighted):
    q_lens, kv_lens, key_cache, value_cache, scores, block_table, query, qsl = batch(
        head_size, group, block_size, dtype)
    scale = head_size ** -0.5
    weights = {}
    if weighted:
        query_weight, score_scale = make_weights(q_lens)
        weights = dict(query_weight=query_weight, score_scale=score_scale)
    # Reference: vLLM's attention; the new slots' scores zeroed, then the twins' "+=".
    want_out = torch.empty_like(query)
    vllm_unified_attention()(
        q=query, k=torch.nan_to_num(key_cache), v=value_cache, out=want_out, cu_seqlens_q=qsl,
        max_seqlen_q=max(q_lens), seqused_k=int32(kv_lens), max_seqlen_k=max(kv_lens),
        softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=block_table,
        softcap=0, q_descale=None, k_descale=None, v_descale=None)
    want = scores.clone()
    for row, (q_len, kv_len) in enumerate(ROWS):
        pos = torch.arange(kv_len - q_len, kv_len)
        want[block_table[row, pos // block_size].long(), :, pos % block_size] = 0.0
    torch_ops.accumulate_prefill_scores(query, key_cache, block_table, qsl, int32(kv_lens), want,
                                    scale, **weights)
    # The fused path reads the stale scores of the new slots as 0 (they hold random values).
    got = scores.clone()
    out = fused_scores(query, key_cache, value_cache, block_table, qsl, q_lens, kv_lens, got,
                       scale, weights)
    torch.testing.assert_close(out, want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(got, want, **SCORE_TOL[dtype])
    assert not torch.equal(got, scores)


@pytest.mark.parametrize("cap,with_sinks", [(1.5, False), (0.0, True), (1.5, True)],
                         ids=["softcap", "sinks", "softcap-sinks"])
def test_shaped_fused_attention_is_vllm_attention_plus_the_models_scores(cap, with_sinks):
    """Gemma 2's soft-cap and gpt-oss's sink logits in the fused kernel: the output is vLLM's
    attention with the same cap and sinks, the scores the model's softmax (decode rows from the
    kernel's kept logits, prefill rows from its LSE); a cap of 1.5 and these sinks bite."""
    head_size, group, block_size, dtype = 64, 3, 16, torch.float32
    q_lens, kv_lens, key_cache, value_cache, scores, block_table, query, qsl = batch(
        head_size, group, block_size, dtype)
    scale = head_size ** -0.5
    sinks = make_sinks(query.shape[1]) if with_sinks else None
    want_out = torch.empty_like(query)
    vllm_unified_attention()(
        q=query, k=torch.nan_to_num(key_cache), v=value_cache, out=want_out, cu_seqlens_q=qsl,
        max_seqlen_q=max(q_lens), seqused_k=int32(kv_lens), max_seqlen_k=max(kv_lens),
        softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=block_table,
        softcap=cap, q_descale=None, k_descale=None, v_descale=None, sinks=sinks)
    want = scores.clone()
    for row, (q_len, kv_len) in enumerate(ROWS):
        pos = torch.arange(kv_len - q_len, kv_len)
        want[block_table[row, pos // block_size].long(), :, pos % block_size] = 0.0
    plain = want.clone()
    torch_ops.accumulate_prefill_scores(query, key_cache, block_table, qsl, int32(kv_lens), want, scale,
                                    softcap=cap, sinks=sinks)
    torch_ops.accumulate_prefill_scores(query, key_cache, block_table, qsl, int32(kv_lens), plain, scale)
    assert not torch.allclose(want, plain, **SCORE_TOL[dtype])
    got = scores.clone()
    out = fused_scores(query, key_cache, value_cache, block_table, qsl, q_lens, kv_lens, got,
                       scale, {}, softcap=cap, sinks=sinks)
    torch.testing.assert_close(out, want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(got, want, **SCORE_TOL[dtype])


def test_scoring_leaves_the_output_bit_for_bit_and_plain_attention_returns_no_lse():
    """Without scores the kernel compiles the same attention arithmetic minus the score work."""
    head_size, group, block_size, dtype = 64, 3, 16, torch.float32
    q_lens, kv_lens, key_cache, value_cache, scores, block_table, query, qsl = batch(
        head_size, group, block_size, dtype)
    plain = torch.empty_like(query)
    assert attention.h2o_attention(query, key_cache, value_cache, plain, block_table, qsl,
                                   int32(kv_lens), 0.125, tile_n=16) is None
    fused = fused_scores(query, key_cache, value_cache, block_table, qsl, q_lens, kv_lens,
                         scores, 0.125, {})
    assert torch.equal(plain, fused)


def test_decode_logit_offsets_pack_the_decode_rows():
    offsets, num_keys = attention.decode_logit_offsets(torch.tensor([30, 1, 5, 1, 1]),
                                                       torch.tensor([100, 20, 5, 37, 1]))
    assert offsets.tolist() == [-1, 0, -1, 20, 57] and num_keys == 58


def test_h2o_attention_rejects_bad_inputs():
    key_cache, value_cache, scores, block_table = make_cache([5], 64, 16, torch.float32)
    query = make_query(1, 2, 64, torch.float32)
    args = (block_table, int32([0, 1]), int32([5]), 1.0)
    with pytest.raises(ValueError, match="decode_offsets"):
        attention.h2o_attention(query, key_cache, value_cache, torch.empty_like(query), *args,
                                scores=scores)
    with pytest.raises(ValueError, match="out must be"):
        attention.h2o_attention(query, key_cache, value_cache, query[:, :1], *args)
    with pytest.raises(ValueError, match="value_cache must match"):
        attention.h2o_attention(query, key_cache, value_cache[:, :8], torch.empty_like(query),
                                *args)
    with pytest.raises(ValueError, match="lse must be"):
        prefill_scores.accumulate_prefill_scores_from_lse(
            query, key_cache, block_table, int32([0, 1]), int32([5]),
            torch.zeros(1, 1, device=DEVICE), scores, 1.0)


# --------------------------------------------------------------------------- fp8 caches

def fp8_caches(key_cache, value_cache, k_scale, v_scale, dtype):
    """An fp8 (e4m3) cache as vLLM stores ``x / scale`` (saturated, round to nearest even), and
    what it reads back (``fp8 * scale`` in the query's dtype). NaN poison stays NaN."""
    from h2o_vllm.oracle.stored_kv import through
    stored = [(c.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
              for c, s in ((key_cache, k_scale), (value_cache, v_scale))]
    read = [through(c, torch.float8_e4m3fn, s).to(dtype) for c, s in ((key_cache, k_scale), (value_cache, v_scale))]
    return stored, read


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_fp8_cache_is_attended_and_scored_as_its_dequantised_values(dtype):
    """The fused attention and both unfused score kernels over an fp8 cache with per-tensor
    scales equal the same kernels over the values it stands for, in the query's dtype, bit for
    bit: fp8 * scale is exact there, and nothing else changes."""
    from h2o_vllm.kernels import decode_scores
    head_size, group, block_size = 64, 3, 16
    q_lens, kv_lens, key_cache, value_cache, scores, block_table, query, qsl = batch(
        head_size, group, block_size, dtype)
    k_scale, v_scale = 0.25, 3.0
    (k8, v8), (kd, vd) = fp8_caches(key_cache, value_cache, k_scale, v_scale, dtype)
    scale = head_size ** -0.5
    want, got = scores.clone(), scores.clone()
    want_out = fused_scores(query, kd, vd, block_table, qsl, q_lens, kv_lens, want, scale, {})
    out = torch.empty_like(query)
    offsets, num_keys = attention.decode_logit_offsets(torch.tensor(q_lens), torch.tensor(kv_lens))
    lse = attention.h2o_attention(query, k8, v8, out, block_table, qsl, int32(kv_lens), scale,
                                  scores=got, decode_offsets=offsets.to(DEVICE),
                                  num_decode_keys=num_keys, k_scale=k_scale, v_scale=v_scale,
                                  tile_n=16, score_tile=16)
    rows = [r for r, n in enumerate(q_lens) if n > 1]
    starts = qsl.tolist()
    tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]).to(DEVICE)
    prefill_scores.accumulate_prefill_scores_from_lse(
        query[tokens], k8, block_table[rows],
        int32([0] + torch.tensor([q_lens[r] for r in rows]).cumsum(0).tolist()),
        int32([kv_lens[r] for r in rows]), lse[tokens], got, scale, fresh_new_slots=True,
        k_scale=k_scale, block_m=16, block_n=16)
    assert torch.equal(out, want_out) and torch.equal(got, want)
    # The unfused kernels (the held draft queries', prefix-cache phases'): the same.
    want, got = scores.clone(), scores.clone()
    prefill_scores.accumulate_prefill_scores(query, kd, block_table, qsl, int32(kv_lens), want, scale,
                                             block_m=16, block_n=16)
    prefill_scores.accumulate_prefill_scores(query, k8, block_table, qsl, int32(kv_lens), got, scale,
                                             k_scale=k_scale, block_m=16, block_n=16)
    assert torch.equal(got, want)
    decode = [r for r, n in enumerate(q_lens) if n == 1]
    q = query[torch.tensor([starts[r] for r in decode], device=DEVICE)]
    want, got = scores.clone(), scores.clone()
    decode_scores.accumulate_decode_scores(q, kd, block_table[decode], int32([kv_lens[r] for r in decode]),
                                           want, scale, block_n=16)
    decode_scores.accumulate_decode_scores(q, k8, block_table[decode], int32([kv_lens[r] for r in decode]),
                                           got, scale, k_scale=k_scale, block_n=16)
    assert torch.equal(got, want)
