"""Throughput at equal KV-cache memory: stock vLLM vs H2O at several budgets, same workload.

Each configuration runs in a fresh subprocess (its own engine, clean memory and timing) with
the KV pool fixed to the same number of blocks (``num_gpu_blocks_override``). The parent
collects one JSON and one PNG into ``benchmarks/results/<date>-<host>/``.

    python benchmarks/throughput.py                       # default: SmolLM2-135M, CPU, <= 15 min
    python benchmarks/throughput.py --help                # GPU-sized flags: benchmarks/README.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

from tqdm import tqdm

DEFAULT_CONFIGS = "stock,full,h2o:0.5,h2o:0.2,h2o:0.1"
#: ``stock@b256``: the configuration's engine takes at most 256 tokens a step (vLLM's own
#: chunked prefill, ``max_num_batched_tokens``), the baseline that bounds a prompt's peak
#: without H2O.
BATCH_SUFFIX = "@b"
#: ``h2o:0.2+fp8``: the configuration's engine keeps an fp8 KV cache (``--kv-cache-dtype fp8``) in
#: the same KV bytes: as many more blocks as the model dtype's element is bytes (2x for bf16).
FP8_SUFFIX = "+fp8"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory, or smollm2 (default) | gemma3-270m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workloads", default="synthetic,text", help="comma list of synthetic, text")
    p.add_argument("--text", default="gpl3", help="text for the text workload: gpl3, jargon, devil or a path")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma list: stock, full (H2O, budget above every length), h2o:<budget>, "
                        "local:<budget> (recent only); budget = fraction of the prompt. Any policy "
                        f"may end in {BATCH_SUFFIX}<N>: that engine steps at most N tokens "
                        "(max_num_batched_tokens, vLLM's chunked prefill), e.g. stock@b256; and in "
                        f"{FP8_SUFFIX}: an fp8 KV cache in the same bytes, e.g. h2o:0.2{FP8_SUFFIX}")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--stock-concurrency", type=float, default=2.0,
                   help="size the KV pool so stock vLLM fits this many full-length sequences")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the above)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-enforce-eager", action="store_true", help="allow torch.compile / CUDA graphs")
    p.add_argument("--omp-threads", default="1",
                   help="OMP_NUM_THREADS for the engines ('' = leave unset). 1 by default: on a shared "
                        "CPU, OpenMP spin-waits make 2-thread runs 5-10x slower and very noisy")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the configurations this many times in turn (per workload); the table "
                        "then gives medians, each ratio to stock paired within its round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/<date>-<host>)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config
    return p.parse_args(argv)


def parse_config(spec: str) -> tuple[str, str, float | None, int | None, bool]:
    """'h2o:0.2' -> (label, policy, budget, None, False); 'stock@b256' -> ('stock@b256', 'stock',
    None, 256, False): the engine's max_num_batched_tokens (None: --max-num-batched-tokens);
    'h2o:0.2+fp8' -> ('h2o-20%+fp8', 'h2o', 0.2, None, True): an fp8 KV cache."""
    fp8 = spec.endswith(FP8_SUFFIX)
    spec = spec.removesuffix(FP8_SUFFIX)
    name, _, budget = spec.partition(":")
    policy, _, batched = name.partition(BATCH_SUFFIX)
    if batched and not batched.isdigit():
        raise ValueError(f"{spec!r}: a policy, then {BATCH_SUFFIX}<tokens per step>, e.g. stock{BATCH_SUFFIX}256")
    tokens = int(batched) if batched else None
    tail = FP8_SUFFIX if fp8 else ""
    if policy in ("stock", "full"):
        return name + tail, policy, None, tokens, fp8
    return f"{name}-{round(float(budget) * 100):g}%{tail}", policy, float(budget), tokens, fp8


def fp8_blocks(num_blocks: int, dtype: str) -> int:
    """The blocks of an fp8 cache in the bytes of ``num_blocks`` blocks of the model dtype's."""
    import torch
    return num_blocks * getattr(torch, dtype).itemsize


def run_one(job: dict) -> dict:
    """Child process: one engine, one workload, one config; returns the measured summary."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from h2o_devtools import bench

    a = job["args"]
    h2o = bench.h2o_config(job["policy"], job["budget"], job["max_model_len"], a["block_size"])
    extra = {} if h2o is None else {"additional_config": {"h2o": h2o}}
    started = time.perf_counter()
    llm = LLM(job["model"], disable_log_stats=False, dtype=a["dtype"], block_size=a["block_size"], enable_prefix_caching=False,
              num_gpu_blocks_override=job["num_blocks"], max_model_len=job["max_model_len"],
              max_num_seqs=a["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              enforce_eager=not a["no_enforce_eager"], seed=a["seed"],
              kv_cache_dtype=job.get("kv_cache_dtype", "auto"), **extra)
    startup_s = time.perf_counter() - started
    if job["workload"] == "synthetic":
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = bench.synthetic_prompts(a["num_requests"], a["prompt_len"], vocab, a["seed"])
    else:
        ids = llm.get_tokenizer().encode(bench.read_text(a["text"]), add_special_tokens=False)
        prompts = bench.text_prompts(ids, a["num_requests"], a["prompt_len"], a["seed"])
    params = SamplingParams(temperature=0.0, max_tokens=a["output_len"], ignore_eos=True)
    stats = bench.measure(llm, prompts, params)
    import torch
    return {**stats.summary(), "startup_s": startup_s, "torch_threads": torch.get_num_threads(), "h2o": h2o}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        from h2o_devtools import bench
        bench.run_job_file(args.one, run_one)
        return {}
    from vllm.utils.math_utils import cdiv

    from h2o_devtools import bench, models

    model = str(models.model_dir(args.model))
    max_model_len = cdiv(args.prompt_len + args.output_len, args.block_size) * args.block_size
    num_blocks = args.num_blocks or int(args.stock_concurrency * max_model_len / args.block_size)
    host = socket.gethostname()
    out = bench.results_dir(args.out, __file__)
    env = bench.engine_env(args.omp_threads)
    configs = [parse_config(c) for c in args.configs.split(",")]
    workloads = args.workloads.split(",")
    result = {"meta": {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host,
        "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
        "loadavg_before": os.getloadavg(), "command": " ".join([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]),
        "model": model, "num_blocks": num_blocks, "max_model_len": max_model_len,
        "kv_tokens": num_blocks * args.block_size, "args": vars(args)}, "runs": []}
    bar = tqdm(total=len(configs) * len(workloads) * args.repeat, desc="throughput", unit="config")
    for workload in workloads:
        for round_ in range(args.repeat):
            for label, policy, budget, batched, fp8 in configs:
                bar.set_postfix_str(f"{workload}/{label}")
                stem = out / "logs" / (f"throughput-{workload}-{label}" + ("" if args.repeat == 1 else f"-{round_}"))
                job = {"args": vars(args), "model": model, "workload": workload, "policy": policy,
                       "budget": budget, "max_model_len": max_model_len,
                       "num_blocks": fp8_blocks(num_blocks, args.dtype) if fp8 else num_blocks,
                       "kv_cache_dtype": "fp8" if fp8 else "auto",
                       "max_num_batched_tokens": batched or args.max_num_batched_tokens,
                       "result": str(stem) + ".part.json"}
                run = {"workload": workload, "config": label, "policy": policy, "budget": budget,
                       "kv_cache_dtype": job["kv_cache_dtype"], "num_blocks": job["num_blocks"],
                       "max_num_batched_tokens": job["max_num_batched_tokens"], "round": round_,
                       **bench.run_child(__file__, job, stem, env, f"{workload}/{label}")}
                result["runs"].append(run)
                bar.update(1)
                tqdm.write(f"{workload:9s} {label:9s} total {run['total_tok_s']:7.1f} tok/s  output "
                           f"{run['output_tok_s']:7.1f} tok/s  running mean {run['mean_running']:5.1f} "
                           f"peak {run['peak_running']:3d}  preemptions {run['num_preemptions']}")
    bar.close()
    add_ratios(result["runs"])
    result["meta"]["loadavg_after"] = os.getloadavg()
    (out / "throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "throughput.md").write_text(markdown_table(result))
    plot(result, out / "throughput.png")
    print(f"wrote {out / 'throughput.json'}, {out / 'throughput.md'} and {out / 'throughput.png'}")
    return result


def add_ratios(runs: list[dict]) -> None:
    """Each run's throughput over stock vLLM's in the same workload and round."""
    for run in runs:
        # plain stock vLLM first: a stock@b<N> run is a configuration compared with it
        stock = min((r for r in runs if r["workload"] == run["workload"] and r["policy"] == "stock"
                     and r.get("round", 0) == run.get("round", 0)),
                    key=lambda r: r["config"] != "stock", default=None)
        if stock:
            run["total_ratio_to_stock"] = run["total_tok_s"] / stock["total_tok_s"]
            run["output_ratio_to_stock"] = run["output_tok_s"] / stock["output_tok_s"]


def medians(runs: list[dict]) -> list[dict]:
    """One row per (workload, config) over the rounds: the median of each number (ratios:
    of the paired ratios), with the ratios' range."""
    import statistics
    rows = []
    for key in dict.fromkeys((r["workload"], r["config"]) for r in runs):
        group = [r for r in runs if (r["workload"], r["config"]) == key]
        row = {k: (statistics.median(r[k] for r in group) if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and all(k in r for r in group) else v) for k, v in group[0].items()}
        ratios = [r["total_ratio_to_stock"] for r in group if "total_ratio_to_stock" in r]
        if ratios:
            row["total_ratio_range"] = (min(ratios), max(ratios))
        row["rounds"] = len(group)
        rows.append(row)
    return rows


def markdown_table(result: dict) -> str:
    """The docs/results.md table of one run, straight from its JSON (no number typed by hand). A hybrid
    model's table adds the blocks held by its global (H2O's) and sliding-window layers. With
    ``--repeat``, medians over the rounds and the range of the paired ratios."""
    names = {"stock": "stock vLLM", "full": "full (tracking only)", "stock" + FP8_SUFFIX: "stock vLLM, fp8 KV",
             **{r["config"]: f"stock vLLM, {r['max_num_batched_tokens']} tokens a step" for r in result["runs"]
                if r["policy"] == "stock" and r["config"] != "stock" and r.get("kv_cache_dtype") != "fp8"}}
    hybrid = any("sliding" in r.get("held_blocks", {}) for r in result["runs"])
    repeated = result["meta"]["args"].get("repeat", 1) > 1
    lines = ["| workload | config | total tok/s | output tok/s | x stock (total) | running mean / peak "
             "| KV blocks mean / peak |" + (" held global / sliding: mean (peak) |" if hybrid else "")
             + " preemptions |", "|---|---|---|---|---|---|---|---|" + ("---|" if hybrid else "")]
    if repeated:
        lines[0] = lines[0].replace("| x stock (total) |", "| x stock (total): median (range) |")
    for r in (medians(result["runs"]) if repeated else result["runs"]):
        ratio = r.get("total_ratio_to_stock")
        held = r.get("held_blocks", {})
        split = " / ".join(f"{held[k]['mean']:.1f} ({held[k]['peak']})" for k in ("global", "sliding") if k in held)
        lines.append(
            f"| {r['workload']} | {names.get(r['config'], 'H2O ' + r['config'][4:] if r['policy'] == 'h2o' else r['config'])} "
            f"| {r['total_tok_s']:.1f} | {r['output_tok_s']:.1f} | {_ratio(ratio, r.get('total_ratio_range'))} "
            f"| {r['mean_running']:.1f} / {r['peak_running']} | {r['mean_blocks_used']:.1f} / {r['peak_blocks_used']} "
            + (f"| {split} " if hybrid else "") + f"| {r['num_preemptions']} |")
    return "\n".join(lines) + "\n"


def _ratio(ratio: float | None, spread: tuple[float, float] | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.2f}" if spread is None else f"{ratio:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in result["runs"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    repeated = result["meta"]["args"].get("repeat", 1) > 1
    for workload in workloads:
        runs = [r for r in (medians(result["runs"]) if repeated else result["runs"]) if r["workload"] == workload]
        labels = [r["config"] for r in runs]
        axes[0].plot(labels, [r["total_tok_s"] for r in runs], marker="o", label=workload)
        axes[1].plot(labels, [r["mean_running"] for r in runs], marker="o", label=f"{workload} mean")
        axes[1].plot(labels, [r["peak_running"] for r in runs], marker="x", ls="--", label=f"{workload} peak")
    meta = result["meta"]
    axes[0].set(title="total throughput (prompt + output)", ylabel="tok/s", ylim=(0, None))
    axes[1].set(title="concurrently running sequences", ylabel="sequences", ylim=(0, None))
    for ax in axes:
        ax.set_xlabel("configuration (H2O budget = fraction of the prompt)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(meta['model']).name}, {meta['kv_tokens']} KV tokens for every config, "
                 f"{meta['args']['num_requests']} x ({meta['args']['prompt_len']} + "
                 f"{meta['args']['output_len']}) tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
