"""The CPU backend's ops over an fp8 cache (``CPUOps(float8_e4m3fn)``): attention output, scores
and compaction equal the same ops over an fp32 cache holding the dequantised K/V, bit for bit.

The scales are powers of two, so folding the key scale into the query's softmax scale and the
value scale into the output (``worker/cpu/ops.py``) rounds exactly as dequantising each element
would; a scale left out or applied twice shows at once. Two rows: one prompt at once, one in
chunks, then decode steps, compactions at the prompts' ends and on the cadence.
"""
import dataclasses
from types import SimpleNamespace

import torch

from h2o_vllm.oracle.stored_kv import stored, through
from h2o_vllm.worker import step as worker_step
from h2o_vllm.worker.cpu.ops import CPUOps
from h2o_vllm.worker.plan import kv_slot_mapping

from one_layer import BLOCK, batch_plan, block_table  # isort: skip

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.25, 4.0


def _cache(table, num_kv_heads, head_size, dtype):
    return torch.zeros(int(table.max()) + 1, num_kv_heads, BLOCK, 2 * head_size, dtype=dtype)


def test_cpu_ops_read_an_fp8_cache_as_fp8_times_scale():
    torch.manual_seed(0)
    num_kv_heads, group, head_size, prompts = 2, 3, 32, [20, 13]
    table = block_table(2, 2, seed=1, device="cpu")
    fp8_ops, ref_ops = CPUOps(FP8), CPUOps()
    fp8_ops.read_scales(SimpleNamespace(_k_scale_float=K_SCALE, _v_scale_float=V_SCALE))
    fp8 = fp8_ops.cache_views(_cache(table, num_kv_heads, head_size, torch.uint8))
    ref = ref_ops.cache_views(_cache(table, num_kv_heads, head_size, torch.float32))
    assert fp8.key_cache.dtype == torch.uint8 and fp8.keys.dtype == FP8  # vLLM's kernel: bytes
    fp8_scores = torch.zeros(ref.keys.shape[0], num_kv_heads, BLOCK)
    ref_scores = fp8_scores.clone()
    scale = head_size ** -0.5
    schedule = [[(0, 20), (0, 8)], [(20, 1), (8, 5)]] + [[(21 + i, 1), (13 + i, 1)] for i in range(7)]
    compacted = 0
    for step_rows in schedule:
        plan = batch_plan([c for c, _ in step_rows], [q for _, q in step_rows], prompts)
        num_tokens = int(plan.query_lens.sum())
        query = torch.randn(num_tokens, num_kv_heads * group, head_size)
        new_k, new_v = (torch.randn(num_tokens, num_kv_heads, head_size) * 3 for _ in range(2))
        slots = kv_slot_mapping(plan, table, num_tokens, BLOCK)
        blk, off = slots // BLOCK, slots % BLOCK
        fp8.keys[blk, off] = stored(new_k, FP8, K_SCALE, toward_zero=True)
        fp8.values[blk, off] = stored(new_v, FP8, V_SCALE, toward_zero=True)
        ref.keys[blk, off] = through(new_k, FP8, K_SCALE, toward_zero=True)
        ref.values[blk, off] = through(new_v, FP8, V_SCALE, toward_zero=True)
        outs = []
        for ops, views, scores in ((fp8_ops, fp8, fp8_scores), (ref_ops, ref, ref_scores)):
            step = worker_step.make_step(plan, table, slots, BLOCK)
            step = dataclasses.replace(step, device_index=ops.step_index(step, BLOCK))
            out = torch.full_like(query, float("nan"))
            ops.attend(step, query, views, out, scores, scale)
            worker_step.update_scores_and_compact(step, ops, query, views, scores, scale, accumulated=True)
            outs.append(out)
        prefill = torch.cat([torch.arange(int(s), int(s + q)) for s, q in zip(plan.query_starts, plan.query_lens)
                             if q > 1] or [torch.arange(0)])
        assert torch.equal(outs[0][prefill], outs[1][prefill])  # H2O attends the prompt rows
        compacted += int(plan.due.sum())
        for row in range(2):
            pos = torch.arange(int(plan.kv_lens_after[row]))
            b, o = table[row].long()[pos // BLOCK], pos % BLOCK
            assert torch.equal(fp8.keys[b, o].float() * K_SCALE, ref.keys[b, o])  # moved as stored
            assert torch.equal(fp8.values[b, o].float() * V_SCALE, ref.values[b, o])
            assert torch.equal(fp8_scores[b, :, o], ref_scores[b, :, o])
    assert compacted >= 4
