"""The shipped Grafana dashboard (dashboards/h2o-vllm.json), rendered from real data: serve a
model with H2O (20% budget), let a local Prometheus scrape it while clients keep it busy,
then evaluate every panel's PromQL over the run and draw the panels with matplotlib.

    .venv/bin/python benchmarks/dashboard_snapshot.py [--tiny | --model DIR] [--seconds 120]

Writes ``dashboard.json`` (every series) and ``dashboard.png`` under
``benchmarks/results/<date>-<host>/dashboard/``. Needs the ``prometheus`` binary.
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from h2o_devtools.prometheus import LocalPrometheus, dashboard_queries
from h2o_devtools.server import results_subdir, run_header, served_model, start_server, stop_server

FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-ratio", "0.1", "--h2o-recent-ratio", "0.1",
         "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32", "--enforce-eager"]
WORDS = ("the budget keeps the recent tokens and the heavy hitters that received most attention while "
         "the rest of the cache returns to the pool so more requests run at once").split()


def _load(url: str, model: str, until: float, concurrency: int, seed: int) -> int:
    """Requests of 200-600 random words, 64-256 output tokens, ``concurrency`` at a time."""
    rng, lock, done = random.Random(seed), threading.Lock(), [0]

    def client() -> None:
        while time.monotonic() < until:
            with lock:
                prompt = " ".join(rng.choices(WORDS, k=rng.randint(200, 600)))
                max_tokens = rng.randint(64, 256)
            requests.post(f"{url}/v1/completions", timeout=600, json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}).raise_for_status()
            with lock:
                done[0] += 1
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(client)
    return done[0]


def render(series: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    titles = list(dict.fromkeys(title for title, _, _ in series["queries"]))
    fig, axes = plt.subplots((len(titles) + 1) // 2, 2, figsize=(13, 3.2 * ((len(titles) + 1) // 2)))
    start = series["start"]
    for ax, title in zip(axes.flat, titles):
        twin = None
        for n, query in enumerate(q for q in series["queries"] if q[0] == title):
            # A percentage beside token counts gets its own axis, as Grafana's unit override would.
            if "(%)" in query[1]:
                twin = twin or ax.twinx()
            for s in series["results"][query[2]]:
                t = [float(x) - start for x, _ in s["values"]]
                v = [float(y) for _, y in s["values"]]
                (twin or ax).plot(t, v, label=query[1], color=f"C{n}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds")
        handles = [h for a in (ax, twin) if a for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles=handles, fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(titles):]:
        ax.axis("off")
    fig.suptitle(f"dashboards/h2o-vllm.json on {series['model']}, H2O 20%, "
                 f"{series['concurrency']} clients, {series['requests']} requests", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: offline SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead (seconds to build)")
    p.add_argument("--seconds", type=int, default=120, help="length of the load")
    p.add_argument("--concurrency", type=int, default=8, help="clients at a time")
    p.add_argument("--out", default=None, help="output directory")
    args = p.parse_args(argv)
    model_dir, name = served_model(args.model, args.tiny, "h2o-dashboard-")
    out = results_subdir(args.out, __file__, "dashboard")
    proc, url = start_server(model_dir, FLAGS, out / "logs" / "server.log")
    try:
        served = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        with tempfile.TemporaryDirectory(prefix="h2o-prometheus-") as tsdb, \
                LocalPrometheus(Path(tsdb), url.removeprefix("http://")) as prom:
            start = time.time()
            done = _load(url, served, time.monotonic() + args.seconds, args.concurrency, seed=0)
            time.sleep(3)  # the last scrape
            end = time.time()
            queries = dashboard_queries()
            results = {expr: prom.query_range(expr, start, end, step=2) for _, _, expr in queries}
    finally:
        stop_server(proc)
    series = {**run_header(__file__, argv), "model": name, "flags": FLAGS, "concurrency": args.concurrency,
              "requests": done, "start": start, "end": end, "queries": queries, "results": results}
    (out / "dashboard.json").write_text(json.dumps(series, indent=1))
    render(series, out / "dashboard.png")
    print(f"{done} requests; {out / 'dashboard.png'}")


if __name__ == "__main__":
    main()
