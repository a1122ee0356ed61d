"""Load check: at least 100 concurrent requests through one H2O engine, mixed prompt and output
lengths and per-request budgets; every request must finish with its full output and the KV
block pool must be idle afterwards (peers saw vLLM V1 fail near 100 concurrent requests).

The engine core runs in-process (offline batch) so the scheduler can be read after every step:
peak running requests, preemptions and, at the end, free blocks. Writes JSON; exit 1 on failure.

    python -m gpu_bundle.load --model DIR --out load.json [--bundle-settings]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

# Per-request budgets (SamplingParams.extra_args), cycled over the requests; {} = engine default.
BUDGETS = [{}, {"h2o_heavy_ratio": 0.1, "h2o_recent_ratio": 0.1},
           {"h2o_heavy_tokens": 8, "h2o_recent_tokens": 8, "h2o_interval": 1},
           {"h2o_heavy_ratio": 0.0, "h2o_recent_ratio": 0.2},
           {"h2o_heavy_tokens": 4096, "h2o_recent_tokens": 4096}]


def workload(n: int, max_prompt: int, max_output: int, vocab: int, seed: int):
    rng = random.Random(seed)
    for i in range(n):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(1, max_prompt))]
        # At least 16 new tokens: requests that end at once would never overlap the others.
        yield str(i), prompt, rng.randint(min(16, max_output), max_output), BUDGETS[i % len(BUDGETS)]


def run(a: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler readable in this process
    from vllm import LLM, SamplingParams

    kwargs = dict(dtype=a.dtype, block_size=a.block_size, max_model_len=a.max_prompt + a.max_output,
                  max_num_seqs=max(a.num_requests, 256), enable_prefix_caching=False, seed=0,
                  additional_config={"h2o": {"heavy_ratio": 0.1, "recent_ratio": 0.1}})
    if a.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = a.gpu_memory_utilization
    if a.num_blocks:
        kwargs["num_gpu_blocks_override"] = a.num_blocks
    if a.bundle_settings:
        from gpu_bundle import settings
        kwargs = settings.apply(kwargs)
    from h2o_vllm.vllm_shims import introspect

    llm = LLM(a.model, **kwargs)
    engine = llm.llm_engine
    scheduler = introspect.in_process_scheduler(engine)
    pool = introspect.block_pool(scheduler)
    free_before = pool.get_num_free_blocks()
    preemptions = introspect.count_preemptions(scheduler)
    expected = {}
    for rid, prompt, max_tokens, budget in workload(a.num_requests, a.max_prompt, a.max_output,
                                                     a.vocab, a.seed):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                extra_args=budget or None)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        expected[rid] = max_tokens
    started, peak, steps, failures = time.perf_counter(), 0, 0, []
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        peak = max(peak, len(scheduler.running))
        steps += 1
    for rid, max_tokens in expected.items():
        out = finished.get(rid)
        if out is None:
            failures.append(f"{rid}: never finished")
        elif len(out.outputs[0].token_ids) != max_tokens or out.outputs[0].finish_reason != "length":
            failures.append(f"{rid}: {len(out.outputs[0].token_ids)}/{max_tokens} tokens, "
                            f"finish_reason {out.outputs[0].finish_reason}")
    free_after = pool.get_num_free_blocks()
    idle = (free_after == free_before and not scheduler.running and not scheduler.waiting)
    result = {"num_requests": a.num_requests, "finished": len(finished), "failures": failures,
              "peak_running": peak, "steps": steps, "preemptions": preemptions(),
              "seconds": round(time.perf_counter() - started, 2),
              "free_blocks_before": free_before, "free_blocks_after": free_after,
              "pool_idle_after": idle, "budgets": BUDGETS,
              "ok": not failures and idle and peak >= a.min_concurrent}
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-concurrent", type=int, default=100,
                   help="fail unless at least this many requests ran at once")
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--max-output", type=int, default=300)
    p.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool in blocks (num_gpu_blocks_override); enough for every request "
                        "at once keeps memory out of the way of concurrency")
    p.add_argument("--bundle-settings", action="store_true", help="impose gpu_bundle.settings")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    result = run(a)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "budgets"}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
