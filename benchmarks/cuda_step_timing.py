"""GPU cost of H2O's per-layer work on the CUDA path (h2o_vllm.worker.step with the Triton
ops, h2o_vllm.worker.cuda.ops.TritonOps), without vLLM.

Times, per layer and step, with CUDA events: decode score accumulation over a batch of rows,
the same with every row compacted, and prefill score accumulation of one long prompt; beside a
torch SDPA over the same keys as the yardstick of "one attention". Writes JSON.

    python benchmarks/cuda_step_timing.py --out benchmarks/results/<dir>/cuda_step_timing.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0")
from h2o_vllm.config import Budget  # noqa: E402
from h2o_vllm.worker.cuda.ops import TritonCacheViews, TritonOps  # noqa: E402
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan  # noqa: E402
from h2o_vllm.worker.step import make_step, update_scores_and_compact  # noqa: E402


def _time_ms(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def case(rows, kv_len, q_len, num_kv_heads, group, head_size, block, due, dtype=torch.bfloat16):
    t = lambda v: torch.full((rows,), v, dtype=torch.int64)  # noqa: E731
    if q_len > 1:  # a whole prompt, budget above it: no compaction
        computed, prompt, budget = 0, q_len, kv_len
    else:  # decoding well past the prompt; due: the cadence fires at this step
        prompt = 64
        budget = kv_len - (block if due else block // 2)
        start = max(prompt, budget + block)
        computed = start + (block - 1 if due else block // 2 - 1)
    budgets = [Budget(heavy=budget // 2, recent=budget - budget // 2, interval=block)] * rows
    plan = make_step_plan(t(computed), t(q_len), t(prompt), budgets)
    assert plan.kv_seq_lens.tolist() == [kv_len] * rows and bool(plan.due.all()) == due
    blocks_per_row = -(-int(plan.kv_seq_lens.max()) // block)
    num_blocks = rows * blocks_per_row + 1
    table = (torch.randperm(num_blocks - 1)[: rows * blocks_per_row] + 1).view(rows, -1)
    table = table.to(torch.int32).cuda()
    shape = (num_blocks, block, num_kv_heads, head_size)
    keys, values = torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(shape, dtype=dtype, device="cuda")
    scores = torch.zeros(num_blocks, num_kv_heads, block, device="cuda")
    num_tokens = int(plan.query_lens.sum())
    query = torch.randn(num_tokens, num_kv_heads * group, head_size, dtype=dtype, device="cuda")
    slots = kv_slot_mapping(plan, table, num_tokens, block)
    step = make_step(plan, table, slots, block)
    ops, views = TritonOps(head_size), TritonCacheViews(keys, values)
    scale = head_size ** -0.5
    h2o_ms = _time_ms(lambda: update_scores_and_compact(step, ops, query, views, scores, scale))
    # Yardstick: dense SDPA of the same queries over contiguous keys of the same length.
    kv = int(plan.kv_seq_lens[0])
    q = torch.randn(rows, num_kv_heads * group, q_len, head_size, dtype=dtype, device="cuda")
    k = torch.randn(rows, num_kv_heads * group, kv, head_size, dtype=dtype, device="cuda")
    sdpa_ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, k, is_causal=q_len > 1))
    return {"rows": rows, "kv_len": kv, "q_len": q_len, "num_kv_heads": num_kv_heads,
            "group": group, "head_size": head_size, "block_size": block, "compacted": due,
            "h2o_step_ms": round(h2o_ms, 4), "sdpa_same_shape_ms": round(sdpa_ms, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    shape = dict(num_kv_heads=8, group=4, head_size=128, block=16)  # Llama-3-8B-like layer
    results = [case(64, 1024, 1, due=False, **shape), case(64, 1024, 1, due=True, **shape),
               case(256, 512, 1, due=False, **shape), case(1, 2048, 2048, due=False, **shape)]
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "cases": results}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
