"""Prefill cost through the served path: time to first token and decode inter-token latency of
stock vLLM and H2O side by side, at several prompt lengths, one request at a time and concurrent.

Each side runs its own fresh ``h2o-vllm serve`` (same model, fp32, eager, ``--block-size``,
KV pool sized by vLLM from ``VLLM_CPU_KVCACHE_SPACE``: plenty for every request, so nothing is
evicted for want of memory and the difference is the prefill path) and is measured with vLLM's
own load tool, ``h2o-vllm bench serve --dataset-name random`` (``--random-input-len`` tokens,
``--output-len`` generated with ``ignore_eos``), for each prompt length: ``--single-prompts``
requests one at a time, then ``--concurrent-prompts`` with ``--concurrency`` in flight. Sides
(``--sides``): ``stock`` (the plugin not loaded), ``h2o`` (paper H2O, 20%: heavy 0.1 + recent
0.1, no floor) and ``window+pool`` (the recommended score mode: observation window 32 + pooling
15). Writes ``prefill_cost.json``, ``prefill_cost.md`` (the docs/results.md table: each H2O side's TTFT
as a ratio of stock's in the same run) and ``prefill_cost.png`` into
``benchmarks/results/<date>-<host>/prefill-cost/`` (``--out``); bench JSONs in ``bench/``,
logs in ``logs/``.

    python benchmarks/prefill_cost.py                          # SmolLM2-135M, 512 / 2,048 / 6,000 tokens
    python benchmarks/prefill_cost.py --lengths 128 --single-prompts 1 --concurrent-prompts 2 --tiny
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import requests

from h2o_devtools import server, soak

#: Serve flags of each side past the common ones.
SIDES = {
    "stock": [],
    "h2o": ["--kv-eviction", "h2o", "--h2o-heavy-ratio", "0.1", "--h2o-recent-ratio", "0.1",
            "--h2o-min-tokens", "0"],
    "window+pool": ["--kv-eviction", "h2o", "--h2o-heavy-ratio", "0.1", "--h2o-recent-ratio", "0.1",
                    "--h2o-min-tokens", "0", "--h2o-obs-window", "32", "--h2o-pool-kernel", "15"],
}
#: Fields copied from vLLM's bench JSON (milliseconds, tokens/s).
BENCH_FIELDS = ("completed", "failed", "duration", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: offline SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="tiny random Llama (h2o_devtools.models.build_tiny_llama)")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of " + ", ".join(SIDES))
    p.add_argument("--lengths", default="512,2048,6000", help="prompt lengths in tokens, comma list")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-prompts", type=int, default=2, help="requests sent one at a time, per length")
    p.add_argument("--concurrent-prompts", type=int, default=4, help="requests sent at once, per length (0: none)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight in the concurrent run")
    p.add_argument("--block-size", type=int, default=32, help="every side (stock CPU vLLM: multiples of 32)")
    p.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE of every server")
    p.add_argument("--omp-threads", default="",
                   help="OMP_NUM_THREADS of the servers ('' = leave unset: vLLM binds one thread per "
                        "core, as a user's server runs; keep the machine otherwise idle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/<date>-<host>/prefill-cost)")
    return p.parse_args(argv)


def bench_command(args, url: str, served: str, model: str, length: int, num_prompts: int,
                  concurrency: int, result_dir: Path, name: str) -> list[str]:
    return [server.h2o_vllm_command(), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", served, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(length),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]


def runs(args) -> list[tuple[int, str, int, int]]:
    """(prompt length, load name, prompts, concurrency) in the order every side runs them."""
    out = []
    for length in (int(n) for n in args.lengths.split(",")):
        if args.single_prompts:
            out.append((length, "single", args.single_prompts, 1))
        if args.concurrent_prompts:
            out.append((length, f"concurrent{args.concurrency}", args.concurrent_prompts, args.concurrency))
    return out


def warm_up(url: str, served: str) -> None:
    """One short request, so the first measured one does not pay the server's first-batch costs."""
    requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": served, "prompt": "Warm up: the quick brown fox", "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True}).raise_for_status()


def side_flags(args, side: str, max_model_len: int) -> tuple[list[str], dict[str, str]]:
    """Serve flags and environment of one side (all but the side's own flags are common)."""
    flags = ["--dtype", "float32", "--enforce-eager", "--seed", str(args.seed),
             "--max-model-len", str(max_model_len), "--block-size", str(args.block_size),
             "--no-enable-prefix-caching", *SIDES[side]]
    env = {"VLLM_CPU_KVCACHE_SPACE": args.kv_space_gib}
    if args.omp_threads:
        env["OMP_NUM_THREADS"] = args.omp_threads
    if side == "stock":
        env["VLLM_PLUGINS"] = soak.STOCK_PLUGINS  # stock vLLM: our plugin is not loaded anywhere
    return flags, env


def run_side(args, side: str, model: str, max_model_len: int, out: Path) -> dict:
    flags, env = side_flags(args, side, max_model_len)
    name = side.replace("+", "-")
    started = time.monotonic()
    proc, url = server.start_server(model, flags, out / "logs" / f"server-{name}.log", env)
    result = {"side": side, "serve_flags": flags, "env": env,
              "server_startup_s": round(time.monotonic() - started, 1), "runs": []}
    try:
        served = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        warm_up(url, served)
        for length, load, num_prompts, concurrency in runs(args):
            stem = f"{name}-{length}-{load}"
            cmd = bench_command(args, url, served, model, length, num_prompts, concurrency, out / "bench", stem)
            with open(out / "logs" / f"bench-{stem}.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
            if rc != 0:
                raise SystemExit(f"[{side}] bench serve exited with {rc}; log: {out / 'logs' / f'bench-{stem}.log'}")
            bench = json.loads((out / "bench" / f"{stem}.json").read_text())
            run = {"prompt_len": length, "load": load, "num_prompts": num_prompts,
                   "concurrency": concurrency, "bench_json": f"bench/{stem}.json",
                   "bench_command": cmd, **{k: bench.get(k) for k in BENCH_FIELDS}}
            result["runs"].append(run)
            print(f"[{side}] {length} tokens, {load}: TTFT mean {run['mean_ttft_ms']:.0f} ms, "
                  f"ITL median {run['median_itl_ms']:.1f} ms, {run['output_throughput']:.1f} output tok/s",
                  flush=True)
    finally:
        server.stop_server(proc)
    return result


def ratio_rows(report: dict) -> list[dict]:
    """Per (length, load): every side's numbers and each H2O side's TTFT / stock's."""
    by_side = {s: {(r["prompt_len"], r["load"]): r for r in v["runs"]} for s, v in report["sides"].items()}
    stock = by_side.get("stock", {})
    rows = []
    for key in (k for s in by_side.values() for k in s):
        if any(r["length"] == key[0] and r["load"] == key[1] for r in rows):
            continue
        row = {"length": key[0], "load": key[1], "sides": {}}
        for side, runs_ in by_side.items():
            run = runs_.get(key)
            if run is None:
                continue
            base = stock.get(key)
            row["sides"][side] = {
                "mean_ttft_ms": run["mean_ttft_ms"], "median_itl_ms": run["median_itl_ms"],
                "output_throughput": run["output_throughput"],
                "ttft_vs_stock": run["mean_ttft_ms"] / base["mean_ttft_ms"] if base else None,
                "throughput_vs_stock": run["output_throughput"] / base["output_throughput"] if base else None}
        rows.append(row)
    return rows


def markdown_table(report: dict) -> str:
    sides = list(report["sides"])
    head = ["prompt tokens", "load"] + [f"TTFT {s} (s)" for s in sides] + \
           [f"TTFT {s} / stock" for s in sides if s != "stock"] + \
           [f"ITL p50 {s} (ms)" for s in sides] + [f"output tok/s {s} / stock" for s in sides if s != "stock"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        cells = row["sides"]

        def get(side, key, spec):
            value = cells.get(side, {}).get(key)
            return "-" if value is None else format(value, spec)
        lines.append("| " + " | ".join(
            [f"{row['length']:,}", row["load"]]
            + [f"{cells[s]['mean_ttft_ms'] / 1000:.2f}" if s in cells else "-" for s in sides]
            + [f"**{get(s, 'ttft_vs_stock', '.2f')}x**" for s in sides if s != "stock"]
            + [get(s, "median_itl_ms", ".1f") for s in sides]
            + [get(s, "throughput_vs_stock", ".2f") + "x" for s in sides if s != "stock"]) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sides = report["rows"], list(report["sides"])
    loads = sorted({r["load"] for r in rows})
    fig, axes = plt.subplots(1, 2 * len(loads), figsize=(6.5 * len(loads), 3.8), squeeze=False)
    for i, load in enumerate(loads):
        mine = [r for r in rows if r["load"] == load]
        xs = range(len(mine))
        width = 0.8 / len(sides)
        for j, side in enumerate(sides):
            ttft = [r["sides"].get(side, {}).get("mean_ttft_ms", 0) / 1000 for r in mine]
            itl = [r["sides"].get(side, {}).get("median_itl_ms", 0) for r in mine]
            offset = [x + (j - (len(sides) - 1) / 2) * width for x in xs]
            axes[0][2 * i].bar(offset, ttft, width, label=side)
            axes[0][2 * i + 1].bar(offset, itl, width, label=side)
        for ax, title, unit in ((axes[0][2 * i], "mean TTFT", "s"), (axes[0][2 * i + 1], "median ITL", "ms")):
            ax.set_xticks(list(xs), [f"{r['length']:,}" for r in mine])
            ax.set(title=f"{title}, {load}", xlabel="prompt tokens", ylabel=unit)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
    a = report["args"]
    fig.suptitle(f"{report['model_name']}: prefill cost, {a['output_len']} output tokens, block "
                 f"{a['block_size']}, OMP threads {a['omp_threads'] or 'unset'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sides = server.sides_of(args.sides, SIDES)
    out = server.results_subdir(args.out, __file__, "prefill-cost")
    model, model_name = server.served_model(args.model, args.tiny, "h2o-prefill-tiny-")
    longest = max(int(n) for n in args.lengths.split(","))
    max_model_len = -(-(longest + args.output_len + 64) // args.block_size) * args.block_size
    report = {
        **server.run_header("prefill_cost.py", argv),
        "model": model, "model_name": model_name, "max_model_len": max_model_len,
        "args": vars(args), "sides": {},
    }
    started = time.monotonic()
    for side in sides:
        report["sides"][side] = run_side(args, side, model, max_model_len, out)
    report["loadavg_after"] = os.getloadavg()
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["rows"] = ratio_rows(report)
    (out / "prefill_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "prefill_cost.md").write_text(markdown_table(report))
    plot(report, out / "prefill_cost.png")
    print(markdown_table(report))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
