"""Soak: `h2o-vllm serve` with a small KV pool under many concurrent streaming clients, H2O and
stock vLLM side by side.

Mixed prompt/output lengths, mixed per-request budgets (``vllm_xargs``), random client
disconnects mid-stream and a few invalid requests (must be HTTP 400, before any stream), for a
fixed time or request count. Each side gets its own fresh server with the same pool and the same
seeded requests: ``h2o`` (``--server-args``, default ``--kv-eviction h2o``) and ``stock`` (stock
vLLM: the plugin not loaded, ``VLLM_PLUGINS`` names another, and no ``h2o_*`` key in any
request; its invalid requests carry a negative temperature instead). After a warm-up round and
again at the end, the script waits for the engine to go idle and reads its ``/metrics``
(``vllm:kv_cache_usage_perc``, ``h2o_vllm:live_kv_tokens``, ``vllm:num_requests_running``) and
the server group's resident memory. Nothing is retried: every failed request is counted, with
its failure class (``h2o_devtools.soak.classify``).

Writes ``soak.json`` (both sides) and ``soak.md`` (the side-by-side table) into
``benchmarks/results/<date>-<host>/``. The client logic is ``h2o_devtools.soak``, shared with
``tests/server/test_soak.py``.

    python benchmarks/soak.py                                 # 3 minutes per side, 16 clients, tiny Llama
    python benchmarks/soak.py --minutes 30 --requests 10000 --concurrency 32   # the long version
    python benchmarks/soak.py --sides h2o                     # one side only
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from h2o_devtools import server, soak


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny test Llama, built "
                                                 "in a temp dir; any vocabulary of >= 500 ids works)")
    p.add_argument("--minutes", type=float, default=3.0, help="launch new requests for this long")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=100_000, help="at most this many requests")
    p.add_argument("--warmup-requests", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=64, help="KV pool size (--num-gpu-blocks-override)")
    p.add_argument("--stock-block-size", type=int, default=32,
                   help="the stock side's block size: stock vLLM's CPU kernel takes multiples of 32 "
                        "only; its pool keeps the same token slots (--num-blocks x --block-size)")
    p.add_argument("--server-args", default="--kv-eviction h2o",
                   help="further `h2o-vllm serve` flags of the h2o side (H2O budget etc.), one string")
    p.add_argument("--sides", default="h2o,stock",
                   help="which servers to soak, one after the other: h2o, stock or both (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-keepalive", type=float, default=None, metavar="SECONDS",
                   help="pool idle connections for reuse with this httpx keepalive_expiry (default: "
                        "none pooled, each request its own connection; see h2o_devtools.soak.KEEPALIVE_EXPIRY_S)")
    p.add_argument("--rss-bound-mib", type=float, default=512.0,
                   help="rss_ok: growth from the end of the warm-up to the end <= this. The CPU worker's "
                        "RSS grows as new batch shapes arrive and levels off (stock vLLM too)")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/<date>-<host>)")
    return p.parse_args(argv)


def pool(args, side: str) -> tuple[int, int]:
    """(block size, blocks) of a side: the same KV token slots on both sides."""
    if side == "h2o":
        return args.block_size, args.num_blocks
    return args.stock_block_size, args.num_blocks * args.block_size // args.stock_block_size


def start_server(args, model: str, log_path: Path, side: str = "h2o") -> tuple[subprocess.Popen, str]:
    block_size, num_blocks = pool(args, side)
    flags = ["--dtype", "float32", "--enforce-eager", "--seed", str(args.seed),
             "--max-model-len", str(args.max_model_len), "--block-size", str(block_size),
             "--num-gpu-blocks-override", str(num_blocks)]
    env = {}
    if side == "h2o":
        flags += args.server_args.split()
    else:
        env["VLLM_PLUGINS"] = soak.STOCK_PLUGINS    # stock vLLM: our plugin is not loaded anywhere
    return server.start_server(model, flags, log_path, env)


stop_server = server.stop_server


def idle_snapshot(url: str, pgid: int, gauges) -> dict:
    values = soak.wait_idle(url, timeout_s=10, gauges=gauges)
    picked = {name: values.get(name) for name in (*soak.IDLE_GAUGES, "vllm:num_preemptions_total",
                                                  "vllm:generation_tokens_total",
                                                  "h2o_vllm:evicted_tokens_total",
                                                  "h2o_vllm:freed_blocks_total",
                                                  "h2o_vllm:compactions_total")}
    picked["idle"] = all(values.get(name) == 0 for name in gauges)
    picked["rss_bytes"] = soak.group_rss(pgid)
    return picked


def _delta(end: dict, start: dict, name: str):
    """A counter's growth over the soak (an int: Prometheus serves counters as floats)."""
    return None if end.get(name) is None or start.get(name) is None else round(end[name] - start[name])


def run_side(args, side: str, model: str, out: Path) -> dict:
    """One server, warm-up, the soak, idle check and RSS: the side's result dict."""
    h2o = side == "h2o"
    gauges = soak.IDLE_GAUGES if h2o else soak.STOCK_IDLE_GAUGES
    log_path = out / "logs" / f"soak-server-{side}.log"
    log_path.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    proc, url = start_server(args, model, log_path, side)
    startup_s = time.monotonic() - started
    rss_samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(10):
            rss_samples.append((round(time.monotonic() - started, 1), soak.group_rss(proc.pid)))

    try:
        served = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        common = dict(max_model_len=args.max_model_len, request_timeout_s=600, h2o=h2o)
        warm = soak.SoakConfig(requests=args.warmup_requests, concurrency=args.concurrency, duration_s=600,
                               seed=args.seed + 1, **common)
        main_cfg = soak.SoakConfig(requests=args.requests, concurrency=args.concurrency,
                                   duration_s=args.minutes * 60, seed=args.seed, **common)
        warm_summary = soak.summarize(asyncio.run(soak.run(url, served, soak.plan(warm), warm.concurrency,
                                                           warm.duration_s, warm.request_timeout_s,
                                                           keepalive_expiry_s=args.client_keepalive)))
        start = idle_snapshot(url, proc.pid, gauges)
        print(f"[{side}] warm-up: {warm_summary['requests']} requests, {warm_summary['failed']} failed, "
              f"idle={start['idle']}, rss {start['rss_bytes'] / 2**20:.0f} MiB", flush=True)
        threading.Thread(target=sample_rss, daemon=True).start()
        done = [0, 0]

        def progress(outcome):
            done[0] += 1
            done[1] += outcome.status == "failed"
            if outcome.status == "failed":
                print(f"[{side}] FAILED {outcome}", flush=True)
            if done[0] % 250 == 0:
                print(f"[{side}] {done[0]} requests, {done[1]} failed, {time.monotonic() - started:.0f} s",
                      flush=True)

        soak_started = time.monotonic()
        outcomes = asyncio.run(soak.run(url, served, soak.plan(main_cfg), main_cfg.concurrency,
                                        main_cfg.duration_s, main_cfg.request_timeout_s, progress,
                                        keepalive_expiry_s=args.client_keepalive))
        soak_s = time.monotonic() - soak_started
        end = idle_snapshot(url, proc.pid, gauges)
        stop.set()
        # The server still answers after the soak.
        after = soak.summarize(asyncio.run(soak.run(
            url, served, [soak.Job(0, list(range(40, 140)), 16, None, soak.FULL)], 1, 60)))
    finally:
        stop.set()
        stop_server(proc)

    summary = soak.summarize(outcomes)
    growth = end["rss_bytes"] - start["rss_bytes"]
    result = {
        "side": side,
        "server_args": args.server_args if h2o else f"(stock vLLM: VLLM_PLUGINS={soak.STOCK_PLUGINS})",
        "server_log": str(log_path),
        "block_size": pool(args, side)[0], "num_blocks": pool(args, side)[1],
        "server_startup_s": round(startup_s, 1),
        "soak_s": round(soak_s, 1),
        "warmup": {k: warm_summary[k] for k in ("requests", "ok", "aborted", "rejected", "failed")},
        **summary,
        "output_tok_per_s": round(summary["tokens_streamed"] / soak_s, 1),
        "engine_start": start, "engine_end": end,
        "preemptions": _delta(end, start, "vllm:num_preemptions_total"),
        "evicted_tokens": _delta(end, start, "h2o_vllm:evicted_tokens_total"),
        "freed_blocks": _delta(end, start, "h2o_vllm:freed_blocks_total"),
        "final_kv_cache_usage_perc": end["vllm:kv_cache_usage_perc"],
        "final_live_kv_tokens": end["h2o_vllm:live_kv_tokens"],
        "final_num_requests_running": end["vllm:num_requests_running"],
        "idle_at_end": end["idle"],
        "rss_start_mib": round(start["rss_bytes"] / 2**20, 1),
        "rss_end_mib": round(end["rss_bytes"] / 2**20, 1),
        "rss_growth_mib": round(growth / 2**20, 1),
        "rss_ok": growth <= args.rss_bound_mib * 2**20,
        # Growth over the second half of the soak (from the 10 s samples): levelling off or not.
        "rss_growth_second_half_mib": (round((rss_samples[-1][1] - rss_samples[len(rss_samples) // 2][1])
                                             / 2**20, 1) if len(rss_samples) > 2 else None),
        "rss_samples_mib": [(t, round(b / 2**20, 1)) for t, b in rss_samples],
        "answers_after_soak": after["ok"] == 1,
    }
    result["passed"] = (summary["failed"] == 0 and warm_summary["failed"] == 0 and end["idle"]
                        and result["rss_ok"] and result["answers_after_soak"])
    return result


#: Rows of soak.md: (label, key or function of a side's result).
TABLE = [
    ("KV pool (blocks x block size)", lambda r: f"{r['num_blocks']} x {r['block_size']}"),
    ("requests", "requests"), ("completed (exact tokens)", "ok"), ("aborted by the client", "aborted"),
    ("invalid, refused with HTTP 400", "rejected"), ("**failed**", "failed"),
    ("failure classes", lambda r: ", ".join(f"{k}: {v}" for k, v in r["failure_classes"].items()) or "-"),
    ("soak time (s)", "soak_s"), ("output tok/s", "output_tok_per_s"),
    ("latency p50 / p95 / p99 (s), completed", lambda r: " / ".join(
        str(r["latency_s"].get(q, "-")) for q in ("p50", "p95", "p99"))),
    ("first token p50 / p95 (s)", lambda r: " / ".join(
        str(r["first_token_s"].get(q, "-")) for q in ("p50", "p95"))),
    ("preemptions", "preemptions"), ("H2O tokens evicted", "evicted_tokens"),
    ("H2O blocks freed", "freed_blocks"),
    ("idle at the end (KV usage, running, waiting 0)", "idle_at_end"),
    ("RSS after warm-up -> end (MiB)", lambda r: f"{r['rss_start_mib']} -> {r['rss_end_mib']}"),
    ("RSS growth (MiB), of it in the 2nd half", lambda r: (
        f"{r['rss_growth_mib']:+}, {r['rss_growth_second_half_mib']:+}"
        if r["rss_growth_second_half_mib"] is not None else f"{r['rss_growth_mib']:+}")),
    ("passed", "passed"),
]


def table(sides: dict) -> str:
    names = list(sides)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in TABLE:
        cells = [key(r) if callable(key) else r.get(key) for r in sides.values()]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - {"h2o", "stock"}:
        raise SystemExit(f"--sides: give h2o, stock or h2o,stock, got {args.sides!r}")
    host = socket.gethostname()
    out = Path(args.out or Path(__file__).parent / "results" / f"{datetime.date.today()}-{host}")
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from h2o_devtools import models
        model = str(models.build_tiny_llama(tempfile.mkdtemp(prefix="h2o-soak-tiny-")))

    results = {side: run_side(args, side, model, out) for side in sides}
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "model": model if args.model else "tiny-llama (h2o_devtools.models.build_tiny_llama)",
        "args": vars(args),
        "keepalive": {"client_expiry_s": args.client_keepalive,
                      "client_pools_idle_connections": args.client_keepalive is not None,
                      "server_timeout_s": int(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))},
        "sides": results,
        "passed": all(r["passed"] for r in results.values()),
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "soak.md").write_text(table(results))
    print(table(results))
    print(f"passed: {report['passed']}; wrote {out / 'soak.json'} and {out / 'soak.md'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
