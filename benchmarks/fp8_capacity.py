"""KV capacity at equal KV bytes (issue 41): the pool vLLM builds for ``--kv-cache-dtype auto``
and ``fp8``, and how many sequences of a workload it holds, stock and H2O 20%.

    python benchmarks/fp8_capacity.py                       # tiny Llama, fp16, 1 GiB of KV
    python benchmarks/fp8_capacity.py --model smollm2

Each dtype is one fresh engine on H2O's CUDA path (on a CPU: ``H2O_VLLM_TRITON_ON_CPU=1`` with
``TRITON_INTERPRET=1``, the only place an fp8 cache runs here), started with the same KV space
(``VLLM_CPU_KVCACHE_SPACE``; on a GPU, ``--gpu-memory-utilization``), and asked for vLLM's own
block count. A sequence's blocks: stock, its prompt and answer; H2O, what it holds while it
decodes (the budget resolved for its prompt plus one interval, as the scheduler counts). fp8
halves a 16-bit token's bytes and H2O bounds the tokens, so the two multiply. Writes
``capacity.json`` and ``capacity.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
from pathlib import Path

RATIO = 0.1  # heavy and recent each: H2O 20%


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory or smollm2; default: a tiny Llama")
    p.add_argument("--dtype", default="float16", help="model dtype (the interpreter refuses bf16)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV space per engine, GiB (CPU: whole GiB)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--out", default=None, help="default benchmarks/results/<date>-<host>/fp8-capacity")
    return p.parse_args(argv)


def _num_blocks(model: str, dtype: str, kv_cache_dtype: str, block_size: int, max_model_len: int,
                kv_gib: int) -> int:
    """In a fresh process: vLLM's block count for one engine (H2O on, so the CUDA path runs)."""
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM
    try:
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                  max_model_len=max_model_len, enforce_eager=True, enable_prefix_caching=False,
                  additional_config={"h2o": {"heavy_ratio": RATIO, "recent_ratio": RATIO}})
    except Exception as e:  # vLLM's errors do not always pickle back to the parent
        raise RuntimeError(f"{kv_cache_dtype}: {type(e).__name__}: {e}") from None
    return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def blocks_per_sequence(prompt_len: int, output_len: int, block_size: int) -> dict[str, int]:
    """Blocks one sequence holds while it decodes: stock, all its tokens; H2O 20%, its budget
    for this prompt plus one interval (the most it holds between compactions)."""
    from h2o_vllm.config import H2OConfig
    budget = H2OConfig(heavy_ratio=RATIO, recent_ratio=RATIO).budget(prompt_len, block_size)
    return {"stock": math.ceil((prompt_len + output_len) / block_size),
            "h2o": math.ceil((budget.tokens + budget.interval) / block_size)}


def main(argv=None) -> None:
    args = parse_args(argv)
    import datetime
    import socket
    if not os.environ.get("H2O_VLLM_TRITON_ON_CPU") and not _has_gpu():
        os.environ.update({"H2O_VLLM_TRITON_ON_CPU": "1", "TRITON_INTERPRET": "1"})
    from h2o_devtools import models
    model = str(models.model_dir(args.model) if args.model else
                models.build_tiny_llama(models.default_cache_dir() / "tiny-llama-fp8-capacity"))
    out = Path(args.out or f"benchmarks/results/{datetime.date.today()}-{socket.gethostname().split('.')[0]}"
               "/fp8-capacity")
    out.mkdir(parents=True, exist_ok=True)
    max_model_len = args.prompt_len + args.output_len
    context = multiprocessing.get_context("spawn")
    blocks = {}
    for kv in ("auto", "fp8"):
        with context.Pool(1) as pool:
            blocks[kv] = pool.apply(_num_blocks, (model, args.dtype, kv, args.block_size, max_model_len,
                                                  args.kv_gib))
    per_seq = blocks_per_sequence(args.prompt_len, args.output_len, args.block_size)
    rows = [{"config": f"{policy} {kv}", "kv_cache_dtype": kv, "policy": policy,
             "num_blocks": blocks[kv], "blocks_per_sequence": per_seq[policy],
             "sequences": blocks[kv] // per_seq[policy]}
            for kv in ("auto", "fp8") for policy in ("stock", "h2o")]
    base = rows[0]["sequences"]
    for row in rows:
        row["vs_stock_auto"] = round(row["sequences"] / base, 2) if base else None
    doc = {"model": model, "dtype": args.dtype, "kv_gib": args.kv_gib, "block_size": args.block_size,
           "prompt_len": args.prompt_len, "output_len": args.output_len, "h2o": f"{RATIO}+{RATIO}",
           "command": "python benchmarks/fp8_capacity.py " + " ".join(argv or []), "rows": rows}
    (out / "capacity.json").write_text(json.dumps(doc, indent=2))
    _plot(rows, out / "capacity.png", doc)
    print("| config | KV blocks | blocks / sequence | sequences | vs stock auto |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['num_blocks']} | {r['blocks_per_sequence']} | {r['sequences']} | "
              f"{r['vs_stock_auto']}x |")
    print(f"written to {out}")


def _has_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def _plot(rows, path: Path, doc) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["config"] for r in rows], [r["sequences"] for r in rows], color=["0.6", "C0", "0.4", "C1"])
    ax.set_ylabel("sequences that fit")
    ax.set_title(f"KV capacity at {doc['kv_gib']} GiB, {doc['prompt_len']}+{doc['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
