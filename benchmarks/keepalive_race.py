"""Keep-alive race probe: is a connection reused at the server's keep-alive timeout what failed
in the soak ("APIConnectionError: Connection error.", 0 tokens, nothing in the server log)?

One `h2o-vllm serve` (the soak's: tiny Llama, H2O on, 64 blocks). Probe clients each own one
keep-alive connection (an httpx pool of 1, openai client, ``max_retries=0``, httpx's default
5 s keep-alive expiry unless ``--keepalive-expiry``) and repeat: a short streaming completion read
to the end, then ``idle`` seconds of nothing, then the next request. The idle times sweep up to the
server's keep-alive timeout (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s) while background soak
clients keep the server busy. Every request records whether it reused the connection, and every
failure its exception chain and the transport phase it died in (``h2o_devtools.soak``'s trace).

    python benchmarks/keepalive_race.py --minutes 3 --out /tmp/keepalive
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import soak as soak_bench  # noqa: E402  (benchmarks/soak.py: start_server, stop_server)

from h2o_devtools import soak  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--idle", default="2.0,4.0,4.5,4.8,4.9,4.95,4.98",
                   help="idle seconds between a probe's requests, comma-separated")
    p.add_argument("--probes-per-idle", type=int, default=3)
    p.add_argument("--load", type=int, default=8, help="background soak clients (0: none)")
    p.add_argument("--keepalive-expiry", type=float, default=5.0, help="probe clients' httpx expiry")
    p.add_argument("--server-keepalive", type=int, default=None,
                   help="VLLM_HTTP_TIMEOUT_KEEP_ALIVE for the server (default: vLLM's, 5)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


async def probe(url: str, model: str, idle: float, deadline: float, expiry: float, results: list):
    import httpx
    import openai
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=expiry)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(limits=limits, timeout=120,
                                                              event_hooks={"request": [soak.trace_connections],
                                                                           "response": [soak.note_connection]}))
    job = soak.Job(0, list(range(40, 48)), 2, None, soak.FULL)
    try:
        while time.monotonic() < deadline:
            out = await soak.run_job(client, model, job)
            results.append({"idle": idle, "status": out.status, "connection": out.connection, "idle_s": out.idle_s,
                            "failure_class": out.failure_class, "phase": out.phase, "cause": out.cause,
                            "seconds": round(out.seconds, 3)})
            await asyncio.sleep(idle)
    finally:
        await client.close()


async def main_async(args, url, model):
    deadline = time.monotonic() + args.minutes * 60
    results: list[dict] = []
    idles = [float(x) for x in args.idle.split(",")]
    tasks = [probe(url, model, idle, deadline, args.keepalive_expiry, results)
             for idle in idles for _ in range(args.probes_per_idle)]
    if args.load:
        cfg = soak.SoakConfig(requests=10**6, concurrency=args.load, duration_s=args.minutes * 60)
        tasks.append(soak.run(url, model, soak.plan(cfg), cfg.concurrency, cfg.duration_s))
    done = await asyncio.gather(*tasks)
    load = soak.summarize(done[-1]) if args.load else None
    return results, load


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.server_keepalive is not None:
        os.environ["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(args.server_keepalive)
    from h2o_devtools import models
    model_dir = str(models.build_tiny_llama(tempfile.mkdtemp(prefix="h2o-keepalive-tiny-")))
    server_args = soak_bench.parse_args([])   # the soak's server: same pool, same flags
    proc, url = soak_bench.start_server(server_args, model_dir, out / "logs" / "server.log")
    try:
        import requests
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        results, load = asyncio.run(main_async(args, url, model))
    finally:
        soak_bench.stop_server(proc)
    by_idle: dict = defaultdict(Counter)
    for r in results:
        key = "ok" if r["status"] == "ok" else r["failure_class"]
        by_idle[r["idle"]][f"{r['connection'] or 'unknown'}:{key}"] += 1
    report = {
        "args": vars(args),
        "server_keepalive_s": int(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")),
        "by_idle": {str(k): dict(v) for k, v in sorted(by_idle.items())},
        "failures": [r for r in results if r["status"] != "ok"][:50],
        "background_load": {k: load[k] for k in ("requests", "ok", "aborted", "rejected", "failed",
                                                 "failure_classes")} if load else None,
    }
    (out / "keepalive_race.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("server_keepalive_s", "by_idle", "background_load")}, indent=2))
    for failure in report["failures"][:5]:
        print(failure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
