"""Shared-prefix serving through vLLM's own serving benchmark: stock vLLM with prefix caching,
H2O without and H2O with it, each against its own fresh `h2o-vllm serve`.

Each side gets the same model and the same KV pool (``--block-size``, ``--num-gpu-blocks-override``,
fp32, eager) and the same seeded requests from ``h2o-vllm bench serve --dataset-name
prefix_repetition`` (vLLM's ``vllm bench serve``: ``--num-prefixes`` random prefixes of
``--prefix-len`` tokens, each followed by ``--suffix-len`` random tokens, ``--output-len`` tokens
generated with ``ignore_eos``). Sides (``--sides``):

- ``stock-pc``: stock vLLM (the plugin not loaded: ``VLLM_PLUGINS`` names another) with prefix caching;
- ``h2o-nopc``: ``--kv-eviction h2o`` (``--h2o-args``, default budget 20%) with ``--no-enable-prefix-caching``;
- ``h2o-pc``: the same with ``--enable-prefix-caching`` (hits copied with their score records).

Per side: request and token throughput, TTFT and TPOT (mean, median, p99) from the bench JSON; the
prefix-cache hit rate from the server's own counters (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``, deltas over the run); the score records held afterwards
(``h2o_vllm:score_record_tokens``) in bytes (one fp32 per token, layer and KV head) and as a
fraction of the KV pool's bytes. Writes ``prefix_serving.json``, ``prefix_serving.md`` (the
docs/results.md table) and ``prefix_serving.png`` into ``benchmarks/results/<date>-<host>/prefix-serving/``
(``--out``), the bench JSONs in ``bench/``, the servers' and clients' logs in ``logs/``.

    python benchmarks/prefix_serving.py                  # SmolLM2-135M, 512 + 64 tokens, 4 prefixes
    python benchmarks/prefix_serving.py --tiny           # tiny random Llama, seconds per side (the test)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path

import requests

from h2o_devtools import server, soak

SIDES = ("stock-pc", "h2o-nopc", "h2o-pc")
LABELS = {"stock-pc": "stock vLLM + prefix caching", "h2o-nopc": "H2O, no prefix caching",
          "h2o-pc": "H2O + prefix caching"}
#: Sizes of --tiny (the end-to-end test), unless given on the command line.
TINY = dict(prefix_len=64, suffix_len=32, num_prefixes=2, output_len=8, num_prompts=8, max_concurrency=4)
DEFAULTS = dict(prefix_len=512, suffix_len=64, num_prefixes=4, output_len=32, num_prompts=64, max_concurrency=8)
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
COUNTERS = (HITS, QUERIES, "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:num_preemptions_total", "h2o_vllm:evicted_tokens_total", "h2o_vllm:compactions_total")
#: Fields copied from vLLM's bench JSON (milliseconds, tokens/s, requests/s).
BENCH_FIELDS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: offline SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random Llama (h2o_devtools.models.build_tiny_llama) and small sizes: "
                        + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of " + ", ".join(SIDES))
    p.add_argument("--prefix-len", type=int, default=None, help=f"tokens (default {DEFAULTS['prefix_len']})")
    p.add_argument("--suffix-len", type=int, default=None, help=f"tokens (default {DEFAULTS['suffix_len']})")
    p.add_argument("--num-prefixes", type=int, default=None, help=f"default {DEFAULTS['num_prefixes']}")
    p.add_argument("--output-len", type=int, default=None, help=f"tokens (default {DEFAULTS['output_len']})")
    p.add_argument("--num-prompts", type=int, default=None, help=f"default {DEFAULTS['num_prompts']}")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help=f"requests in flight at most (default {DEFAULTS['max_concurrency']})")
    p.add_argument("--request-rate", default="inf", help="requests/s (Poisson), inf = all at once")
    p.add_argument("--block-size", type=int, default=32, help="every side (stock CPU vLLM: multiples of 32)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool in blocks, every side (default: --max-concurrency full sequences plus "
                        "every prefix once)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: a sequence plus 2 blocks")
    p.add_argument("--h2o-args", default="--kv-eviction h2o",
                   help="the H2O sides' serve flags (budget etc.), one string")
    p.add_argument("--omp-threads", default="1",
                   help="OMP_NUM_THREADS of the servers ('' = leave unset); 1 on a shared CPU as in "
                        "throughput.py")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output directory (default benchmarks/results/<date>-<host>/prefix-serving)")
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def model_shape(model: str) -> dict:
    """Layers, KV heads and head size from the model's config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {"num_layers": config["num_hidden_layers"],
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "vocab_size": config["vocab_size"]}


def side_flags(args, side: str) -> tuple[list[str], dict[str, str]]:
    """Serve flags and extra environment of one side (the pool flags are common)."""
    flags = ["--dtype", "float32", "--enforce-eager", "--seed", str(args.seed),
             "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
             "--num-gpu-blocks-override", str(args.num_blocks)]
    env = {"OMP_NUM_THREADS": args.omp_threads} if args.omp_threads else {}
    if side == "stock-pc":
        env["VLLM_PLUGINS"] = soak.STOCK_PLUGINS    # stock vLLM: our plugin is not loaded anywhere
        return flags + ["--enable-prefix-caching"], env
    flags += args.h2o_args.split()
    return flags + (["--enable-prefix-caching"] if side == "h2o-pc" else ["--no-enable-prefix-caching"]), env


def bench_command(args, url: str, served: str, model: str, result_dir: Path, side: str) -> list[str]:
    return [server.h2o_vllm_command(), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", served, "--tokenizer", model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--request-rate", str(args.request_rate), "--ignore-eos", "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{side}.json"]


def cache_config(url: str) -> dict:
    """The server's own ``vllm:cache_config_info`` labels (pool size, block size, prefix caching)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    return {}


def settled(url: str, gauges) -> dict:
    """``/metrics`` once the engine is idle and two scrapes 0.6 s apart agree on the counters and
    the record gauge (H2O's writers flush every 0.2 s)."""
    values = soak.wait_idle(url, timeout_s=30, gauges=gauges)
    names = (*COUNTERS, "h2o_vllm:score_record_tokens")
    for _ in range(20):
        time.sleep(0.6)
        again = soak.scrape(url)
        if all(again.get(n) == values.get(n) for n in names):
            return again
        values = again
    return values


def warm_up(url: str, served: str, args, shape: dict) -> None:
    """One request of the benchmark's length on token ids no prompt shares (other seed), so the
    first measured requests do not pay the server's first-batch costs."""
    rng = random.Random(args.seed + 1_000_003)
    prompt = [rng.randrange(shape["vocab_size"]) for _ in range(args.prefix_len + args.suffix_len)]
    reply = requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": served, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
        "ignore_eos": True})
    reply.raise_for_status()


def delta(after: dict, before: dict, name: str):
    if after.get(name) is None or before.get(name) is None:
        return None
    return round(after[name] - before[name])


def run_side(args, side: str, model: str, shape: dict, out: Path) -> dict:
    flags, env = side_flags(args, side)
    log_path = out / "logs" / f"server-{side}.log"
    h2o = side != "stock-pc"
    gauges = soak.IDLE_GAUGES if h2o else soak.STOCK_IDLE_GAUGES
    started = time.monotonic()
    proc, url = server.start_server(model, flags, log_path, env)
    startup_s = time.monotonic() - started
    try:
        served = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        config = cache_config(url)
        warm_up(url, served, args, shape)
        before = settled(url, gauges)
        cmd = bench_command(args, url, served, model, out / "bench", side)
        bench_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        print(f"[{side}] server up in {startup_s:.0f} s; bench serve ...", flush=True)
        with open(out / "logs" / f"bench-{side}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=bench_env).returncode
        if rc != 0:
            raise SystemExit(f"[{side}] bench serve exited with {rc}; log: {out / 'logs' / f'bench-{side}.log'}")
        after = settled(url, gauges)
    finally:
        server.stop_server(proc)
    bench = json.loads((out / "bench" / f"{side}.json").read_text())
    hits, queries = delta(after, before, HITS), delta(after, before, QUERIES)
    record_tokens = after.get("h2o_vllm:score_record_tokens")
    record_bytes = None if record_tokens is None else round(record_tokens) * 4 * shape["num_layers"] * shape["num_kv_heads"]
    result = {
        "side": side, "label": LABELS[side], "serve_flags": flags,
        "env": env, "server_log": str(log_path.relative_to(out)), "bench_json": f"bench/{side}.json",
        "bench_command": cmd, "server_startup_s": round(startup_s, 1),
        "cache_config": {k: config.get(k) for k in ("num_gpu_blocks", "block_size", "enable_prefix_caching")},
        **{k: bench.get(k) for k in BENCH_FIELDS},
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
        **{name.split(":")[1].removesuffix("_total"): delta(after, before, name) for name in COUNTERS[2:]},
        "score_record_tokens": None if record_tokens is None else round(record_tokens),
        "score_record_bytes": record_bytes,
        "score_record_fraction_of_kv": None if record_bytes is None else record_bytes / kv_pool_bytes(args, shape),
        "idle_at_end": all(after.get(name) == 0 for name in gauges),
    }
    if str(result["cache_config"]["num_gpu_blocks"]) != str(args.num_blocks):
        raise SystemExit(f"[{side}] the server's pool is {config.get('num_gpu_blocks')} blocks, "
                         f"asked for {args.num_blocks}")
    print(f"[{side}] {result['completed']} requests, {result['output_throughput']:.1f} output tok/s, "
          f"TTFT mean {result['mean_ttft_ms']:.0f} ms, hit rate {fmt(result['prefix_cache_hit_rate'], '.1%')}, "
          f"records {result['score_record_tokens']} tokens", flush=True)
    return result


def kv_pool_bytes(args, shape: dict, dtype_bytes: int = 4) -> int:
    """K and V of every block: blocks x block size x 2 x head size x dtype x layers x KV heads."""
    return (args.num_blocks * args.block_size * 2 * shape["head_dim"] * dtype_bytes
            * shape["num_layers"] * shape["num_kv_heads"])


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(report: dict) -> str:
    """The docs/results.md table, straight from the JSON (no number typed by hand)."""
    lines = ["| side | req/s | output tok/s | TTFT mean / median / p99 (ms) | TPOT mean / median / p99 (ms) "
             "| prefix-cache hit rate (hits / queries, tokens) | score records: tokens, MiB, of KV pool |",
             "|---|---|---|---|---|---|---|"]
    for r in report["sides"].values():
        hit = ("-" if r["prefix_cache_hit_rate"] is None
               else f"{r['prefix_cache_hit_rate']:.1%} ({r['prefix_cache_hits']} / {r['prefix_cache_queries']})")
        records = ("-" if r["score_record_tokens"] is None else
                   f"{r['score_record_tokens']}, {r['score_record_bytes'] / 2**20:.2f}, "
                   f"{r['score_record_fraction_of_kv']:.2%}")
        lines.append(
            f"| {r['label']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
            f"| {r['mean_tpot_ms']:.0f} / {r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | {hit} | {records} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = list(report["sides"].values())
    names = [r["side"] for r in sides]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    axes[0].bar(names, [r["output_throughput"] for r in sides], color="C0")
    axes[0].set(title="output throughput", ylabel="tok/s")
    width = 0.38
    xs = range(len(sides))
    for ax, metric, title in ((axes[1], "ttft", "time to first token"), (axes[2], "tpot", "time per output token")):
        ax.bar([x - width / 2 for x in xs], [r[f"mean_{metric}_ms"] for r in sides], width, label="mean")
        ax.bar([x + width / 2 for x in xs], [r[f"p99_{metric}_ms"] for r in sides], width, label="p99")
        ax.set_xticks(list(xs), names)
        ax.set(title=title, ylabel="ms")
        ax.legend(fontsize=8)
    axes[3].bar(names, [100 * (r["prefix_cache_hit_rate"] or 0) for r in sides], color="C2")
    axes[3].set(title="prefix-cache hit rate (tokens)", ylabel="%", ylim=(0, 100))
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8)
    a = report["args"]
    fig.suptitle(f"{report['model_name']}: {a['num_prompts']} prompts = {a['num_prefixes']} prefixes x "
                 f"{a['prefix_len']} + {a['suffix_len']} tokens, {a['output_len']} out, concurrency "
                 f"{a['max_concurrency']}, {report['num_blocks']} x {a['block_size']} KV slots each", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sides = server.sides_of(args.sides, SIDES)
    out = server.results_subdir(args.out, __file__, "prefix-serving")
    model, model_name = server.served_model(args.model, args.tiny, "h2o-prefix-tiny-")
    shape = model_shape(model)
    seq = args.prefix_len + args.suffix_len + args.output_len
    if args.max_model_len is None:
        args.max_model_len = (cdiv(seq, args.block_size) + 2) * args.block_size
    if args.num_blocks is None:
        args.num_blocks = (args.max_concurrency * cdiv(seq, args.block_size)
                           + args.num_prefixes * (args.prefix_len // args.block_size))
    report = {
        **server.run_header("prefix_serving.py", argv),
        "model": model, "model_name": model_name, "model_shape": shape,
        "num_blocks": args.num_blocks, "kv_tokens": args.num_blocks * args.block_size,
        "kv_pool_bytes": kv_pool_bytes(args, shape), "args": vars(args), "sides": {},
    }
    started = time.monotonic()
    for side in sides:
        report["sides"][side] = run_side(args, side, model, shape, out)
    report["loadavg_after"] = os.getloadavg()
    report["wall_s"] = round(time.monotonic() - started, 1)
    (out / "prefix_serving.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "prefix_serving.md").write_text(markdown_table(report))
    plot(report, out / "prefix_serving.png")
    print(markdown_table(report))
    print(f"wrote {out / 'prefix_serving.json'}, {out / 'prefix_serving.md'} and {out / 'prefix_serving.png'}")
    return report


if __name__ == "__main__":
    main()
