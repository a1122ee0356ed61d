"""Long prompts with ``prefill_chunk`` (issue 26): capacity, throughput and quality, one mode each.

    python benchmarks/long_prompts.py capacity    # which prompt lengths complete in a 1,024-token KV pool
    python benchmarks/long_prompts.py throughput  # ~2,000-token prompts, 64-token answers, equal KV memory
    python benchmarks/long_prompts.py quality     # prefill chunks vs the prompt held whole, 20% budget

``capacity`` runs one prompt per fresh engine (``--one``, a subprocess each) with the KV pool
fixed by ``num_gpu_blocks_override`` and ``max_model_len`` = prompt + answer, prefix caching off,
and reads the pool's peak from the in-process scheduler (``h2o_devtools.bench.measure``).
``throughput`` and ``quality`` call ``benchmarks/throughput.py`` and ``benchmarks/quality.py``
with the issue's sizes and the ``@c<N>`` policies (``bench.CHUNK_SUFFIX``), then tabulate their JSON.
Everything lands in ``--out`` (default ``benchmarks/results/<date>-<host>/long-prompts/<mode>/``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))  # throughput.py and quality.py, run as they are

CAPACITY_CONFIGS = "stock,h2o:0.2,h2o-req:0.2,h2o@c256:0.2,h2o@c128:0.2,tokens@c128:64+64"
#: The engine a ``h2o-req`` config's request runs in: any budget whose engine starts (a chunked one).
REQ_ENGINE = {"heavy_tokens": 16, "recent_tokens": 16, "prefill_chunk": 32}
QUALITY_POLICIES = "h2o,window+pool"
QUALITY_CHUNKS = "64,256,1024"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one capacity engine
    modes = p.add_subparsers(dest="mode")
    for mode in ("capacity", "throughput", "quality"):
        m = modes.add_parser(mode)
        m.add_argument("--model", default=None, help="HF model directory, or smollm2 (default) | gemma3-270m")
        m.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS of the engines ('' = leave unset)")
        m.add_argument("--seed", type=int, default=0)
        m.add_argument("--out", default=None, help="default benchmarks/results/<date>-<host>/long-prompts/<mode>")
    c = modes.choices["capacity"]
    c.add_argument("--lengths", default="2048,3072,4096,8160",
                   help="prompt lengths (8160 + 32 = SmolLM2's 8,192 positions)")
    c.add_argument("--output-len", type=int, default=32)
    c.add_argument("--block-size", type=int, default=32)
    c.add_argument("--num-blocks", type=int, default=32, help="num_gpu_blocks_override (the null block included)")
    c.add_argument("--configs", default=CAPACITY_CONFIGS,
                   help="stock; h2o:B (held whole, engine config); h2o-req:B (held whole, per-request "
                        "budget in an engine that starts); h2o@cN:B (prefill_chunk N); tokens@cN:H+R")
    c.add_argument("--text", default="gpl3", help="prompt text (repeated when shorter than a prompt)")
    c.add_argument("--timeout", type=float, default=900, help="seconds per engine before it counts as hung")
    t = modes.choices["throughput"]
    t.add_argument("--configs", default="stock,h2o:0.2,h2o@c256:0.2")
    t.add_argument("--num-requests", type=int, default=16)
    t.add_argument("--prompt-len", type=int, default=2000)
    t.add_argument("--output-len", type=int, default=64)
    t.add_argument("--stock-concurrency", type=int, default=2,
                   help="the pool holds this many full sequences (plus vLLM's null block)")
    t.add_argument("--workloads", default="text")
    t.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="also run stock vLLM with a pool that holds every request at once: the most any "
                        "memory saving can buy on this machine (memory is then not the limit)")
    q = modes.choices["quality"]
    q.add_argument("--policies", default=QUALITY_POLICIES, help="each also with every --chunks suffix")
    q.add_argument("--chunks", default=QUALITY_CHUNKS)
    q.add_argument("--budget", default="0.2")
    q.add_argument("--prompt-len", type=int, default=2048, help="ppl prompt and generation prompt")
    q.add_argument("--ppl-continuation-len", type=int, default=64)
    q.add_argument("--gen-prompts", type=int, default=1)
    q.add_argument("--gen-len", type=int, default=48)
    q.add_argument("--passkey-samples", type=int, default=4)
    q.add_argument("--passkey-filler", type=int, default=2000)
    q.add_argument("--tasks", default="ppl,gen,passkey", help="quality.py's tasks")
    args = p.parse_args(argv)
    if not args.one and not args.mode:
        p.error("a mode: capacity, throughput or quality")
    return args


def out_dir(args) -> Path:
    from h2o_devtools import bench
    default = BENCHMARKS / "results" / f"{datetime.date.today()}-{socket.gethostname()}" / "long-prompts" / args.mode
    return bench.results_dir(args.out or str(default), __file__)


# ---------------------------------------------------------------------------------------- capacity

def capacity_config(spec: str, prompt_len: int) -> tuple[dict | None, dict | None]:
    """(engine's additional_config["h2o"], the request's extra_args) of one ``--configs`` entry."""
    from h2o_devtools import bench
    name, _, budget = spec.partition(":")
    if name == "stock":
        return None, None
    if name.startswith("tokens"):
        heavy, recent = budget.split("+")
        h2o = {"heavy_tokens": int(heavy), "recent_tokens": int(recent)}
        if bench.CHUNK_SUFFIX in name:
            h2o["prefill_chunk"] = int(name.partition(bench.CHUNK_SUFFIX)[2])
        return h2o, None
    if name == "h2o-req":  # the prompt held whole by the request's own budget
        h2o = bench.h2o_config("h2o", float(budget))
        return REQ_ENGINE, {f"h2o_{k}": v for k, v in {**h2o, "prefill_chunk": prompt_len}.items()}
    return bench.h2o_config(name, float(budget)), None


def label(spec: str) -> str:
    name, _, budget = spec.partition(":")
    base, _, chunk = name.partition("@c")
    if base == "stock":
        return "stock vLLM"
    what = f"H2O {budget} tokens" if base == "tokens" else f"H2O {round(float(budget) * 100):g}%"
    how = {"h2o": "prompt whole (engine)", "h2o-req": "prompt whole (request)"}.get(base, "")
    return f"{what}, chunk {chunk}" if chunk else f"{what}, {how}"


def first_error_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:600]


def capacity_one(job: dict) -> dict:
    """Child: one engine, one prompt; what happened and the pool's peak."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from h2o_vllm.config import H2OConfig, request_config
    from h2o_vllm.policy import request_peak_blocks
    from h2o_devtools import bench

    a, length = job["args"], job["prompt_len"]
    engine_h2o, request = capacity_config(job["config"], length)
    max_model_len = -(-(length + a["output_len"]) // a["block_size"]) * a["block_size"]
    out = {"engine_h2o": engine_h2o, "request_extra_args": request, "max_model_len": max_model_len,
           "completed": False, "stage": None, "error": None}
    if engine_h2o is not None:
        config = request_config(H2OConfig.from_dict(engine_h2o), request)
        out["predicted_peak_blocks"] = request_peak_blocks(
            length, length + a["output_len"], config.budget(length, a["block_size"]), a["block_size"], False)
    ids = AutoTokenizer.from_pretrained(job["model"]).encode(bench.read_text(a["text"]), add_special_tokens=False)
    prompt = bench.text_prompts(ids * (length // len(ids) + 1), 1, length, a["seed"])[0]
    started = time.perf_counter()
    try:
        llm = LLM(job["model"], disable_log_stats=False, dtype="float32", block_size=a["block_size"], enable_prefix_caching=False,
                  num_gpu_blocks_override=a["num_blocks"], max_model_len=max_model_len, enforce_eager=True,
                  seed=a["seed"], **({} if engine_h2o is None else {"additional_config": {"h2o": engine_h2o}}))
    except Exception as exc:  # vLLM's start-up check: the pool cannot hold one request
        return {**out, "stage": "start-up", "error": first_error_line(exc),
                "startup_s": time.perf_counter() - started}
    out["startup_s"] = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=a["output_len"], ignore_eos=True, extra_args=request)
    try:
        stats = bench.measure(llm, [prompt], params)
    except ValueError as exc:  # H2O's admission check (h2o_vllm.frontend.requests.check_request_fits)
        return {**out, "stage": "request", "error": first_error_line(exc)}
    s = stats.summary()
    return {**out, "completed": s["output_tokens"] == a["output_len"], "stage": "done",
            **{k: s[k] for k in ("elapsed_s", "output_tokens", "num_steps", "num_preemptions", "num_blocks",
                                 "peak_blocks_used", "peak_blocks_allocated")}}


def capacity(args, model: str, out: Path, env: dict) -> dict:
    from h2o_devtools import bench
    runs = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for spec in args.configs.split(","):
            stem = out / "logs" / f"capacity-{length}-{spec.replace(':', '_').replace('+', '_')}"
            job = {"args": vars(args), "model": model, "config": spec, "prompt_len": length,
                   "result": f"{stem}.part.json"}
            try:
                run = bench.run_child(__file__, job, stem, env, f"{length}/{spec}", timeout=args.timeout)
            except (subprocess.TimeoutExpired, RuntimeError) as exc:  # a hang or a crash: keep the log tail
                tail = Path(f"{stem}.log").read_text(errors="replace").splitlines()[-15:]
                run = {"completed": False, "stage": "crashed or hung", "error": str(exc), "log_tail": tail}
            runs.append({"prompt_len": length, "config": spec, "label": label(spec), **run})
            print(f"{length:5d} {label(spec):34s} {'completed' if run['completed'] else 'NO: ' + str(run['stage'])}"
                  f"  {run.get('error') or ''}"[:220], flush=True)
    return {"pool_tokens": (args.num_blocks - 1) * args.block_size, "runs": runs}


def capacity_table(result: dict) -> str:
    meta = result["meta"]
    lengths = list(dict.fromkeys(r["prompt_len"] for r in result["runs"]))
    pool = result["pool_tokens"]
    lines = [f"KV pool: {meta['args']['num_blocks'] - 1} blocks x {meta['args']['block_size']} = {pool} tokens "
             f"(plus vLLM's null block); answer {meta['args']['output_len']} tokens; prefix caching off.",
             "Cell: completed, wall time of the request, peak KV blocks in use (predicted by "
             "`policy.request_peak_blocks`), or why not.", "",
             "| config | " + " | ".join(f"{n:,} tokens ({n / pool:.1f}x pool)" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for spec in dict.fromkeys(r["config"] for r in result["runs"]):
        cells = []
        for n in lengths:
            r = next(r for r in result["runs"] if r["config"] == spec and r["prompt_len"] == n)
            if r["completed"]:
                cells.append(f"yes, {r['elapsed_s']:.1f} s, {r['peak_blocks_allocated']} blocks "
                             f"({r.get('predicted_peak_blocks', '-')})")
            else:
                cells.append(f"no: {r['stage']}")
        lines.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    lines += ["", "Why not (each config's first refusal, the error's first line):", ""]
    for spec in dict.fromkeys(r["config"] for r in result["runs"]):
        r = next((r for r in result["runs"] if r["config"] == spec and r["error"]), None)
        if r:
            lines.append(f"- {label(spec)}, {r['prompt_len']:,} tokens, {r['stage']}: `{r['error']}`")
    return "\n".join(lines) + "\n"


def capacity_plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, meta = result["runs"], result["meta"]
    lengths = list(dict.fromkeys(r["prompt_len"] for r in runs))
    specs = list(dict.fromkeys(r["config"] for r in runs))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(specs)
    for i, spec in enumerate(specs):
        for j, n in enumerate(lengths):
            r = next(r for r in runs if r["config"] == spec and r["prompt_len"] == n)
            x = j + (i - (len(specs) - 1) / 2) * width
            if r["completed"]:
                ax.bar(x, r["peak_blocks_allocated"], width, color=f"C{i}", label=label(spec) if j == 0 else None)
            else:
                ax.bar(x, 0, width, color=f"C{i}", label=label(spec) if j == 0 else None)
                ax.text(x, 0.5, "x", ha="center", color=f"C{i}", fontsize=11, fontweight="bold")
    ax.axhline(meta["args"]["num_blocks"] - 1, color="k", lw=0.8, ls="--", label="KV pool")
    ax.set_xticks(range(len(lengths)), [f"{n:,} tokens" for n in lengths])
    ax.set(ylabel="peak KV blocks in use (x: did not complete)", title=f"{Path(meta['model']).name}: "
           f"one prompt in a {result['pool_tokens']}-token KV pool ({meta['args']['block_size']}-token blocks)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- throughput and quality

def throughput_argv(args, model: str, out: Path, configs: str | None = None,
                    concurrency: int | None = None) -> list[str]:
    """throughput.py's flags; its pool is ``concurrency`` (default ``--stock-concurrency``) full
    sequences of 32-token blocks plus the null block vLLM takes from it (else stock vLLM preempts
    near the end)."""
    num_blocks = (concurrency or args.stock_concurrency) * -(-(args.prompt_len + args.output_len) // 32) + 1
    return ["--model", model, "--workloads", args.workloads, "--configs", configs or args.configs,
            "--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--num-blocks", str(num_blocks),
            "--block-size", "32", "--omp-threads", args.omp_threads, "--seed", str(args.seed), "--out", str(out)]


def throughput_table(result: dict) -> str:
    meta = result["meta"]
    lines = [f"{meta['args']['num_requests']} requests x ({meta['args']['prompt_len']} + "
             f"{meta['args']['output_len']}) tokens, all at once; KV pool {meta['num_blocks'] - 1} blocks x 32 = "
             f"{(meta['num_blocks'] - 1) * 32} tokens (plus the null block) for every config; prefix caching off. "
             f"Load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in meta['loadavg_before'])}, after "
             f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_after'])} (2 cores; configs run one after the other).", "",
             "| workload | config | requests/s | x stock | output tok/s | total tok/s | running mean / peak "
             "| KV blocks mean / peak (in-step peak) | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        stock = next(s for s in result["runs"] if s["workload"] == r["workload"] and s["policy"] == "stock")
        lines.append(f"| {r['workload']} | {r['config']} | {r['requests_s']:.3f} | {r['requests_s'] / stock['requests_s']:.2f} "
                     f"| {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {r['mean_running']:.1f} / {r['peak_running']} "
                     f"| {r['mean_blocks_used']:.1f} / {r['peak_blocks_used']} ({r['peak_blocks_allocated']}) "
                     f"| {r['num_preemptions']} |")
    for r in result.get("ceiling", {}).get("runs", []):
        stock = next(s for s in result["runs"] if s["workload"] == r["workload"] and s["policy"] == "stock")
        pool = result["ceiling"]["meta"]["num_blocks"] - 1
        lines.append(f"| {r['workload']} | stock, {pool} blocks (every request fits: the memory ceiling) "
                     f"| {r['requests_s']:.3f} | {r['requests_s'] / stock['requests_s']:.2f} | {r['output_tok_s']:.1f} "
                     f"| {r['total_tok_s']:.1f} | {r['mean_running']:.1f} / {r['peak_running']} "
                     f"| {r['mean_blocks_used']:.1f} / {r['peak_blocks_used']} ({r['peak_blocks_allocated']}) "
                     f"| {r['num_preemptions']} |")
    return "\n".join(lines) + "\n"


def quality_argv(args, model: str, out: Path) -> list[str]:
    policies = [f"{p}{suffix}" for p in args.policies.split(",")
                for suffix in ["", *(f"@c{c}" for c in args.chunks.split(","))]]
    return ["--model", model, "--texts", "gpl3", "--tasks", args.tasks, "--budgets", args.budget, "--policies", ",".join(policies),
            "--ppl-windows", "1", "--ppl-prompt-len", str(args.prompt_len),
            "--ppl-continuation-len", str(args.ppl_continuation_len), "--gen-prompts", str(args.gen_prompts),
            "--gen-prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--passkey-samples", str(args.passkey_samples), "--passkey-filler", str(args.passkey_filler),
            "--omp-threads", args.omp_threads, "--seed", str(args.seed), "--out", str(out)]


def quality_rows(result: dict) -> list[dict]:
    """One row per (policy, chunk): the chunk ``None`` is the prompt held whole."""
    rows = []
    for lab, e in result["policies"].items():
        policy, _, chunk = e["policy"].partition("@c")
        ppl = e.get("ppl", {}).get("gpl3", {})
        rows.append({"label": lab, "policy": policy, "chunk": int(chunk) if chunk else None,
                     "ppl": ppl.get("ppl"), "ppl_ratio": ppl.get("ppl_ratio_to_full"), "rouge_l": e.get("rouge_l"),
                     "passkey": (round(e["passkey_accuracy"] * e["num_passkey"]), e["num_passkey"])
                     if "passkey_accuracy" in e else None})
    return rows


def quality_table(result: dict) -> str:
    a = result["meta"]["args"]
    what = {"ppl": f"ppl: {a['ppl_continuation_len']} GPL-3 tokens after a {a['ppl_prompt_len']}-token prompt "
                   "(dense oracle, interval 1)",
            "gen": f"ROUGE-L vs stock vLLM: {a['gen_prompts']} prompt(s) of {a['gen_prompt_len']} tokens, "
                   f"{a['gen_len']} greedy tokens",
            "passkey": f"pass-key: the key first, {a['passkey_filler']} tokens of GPL-3, the question"}
    lines = [f"Budget {float(a['budgets']) * 100:g}% of the prompt. "
             + "; ".join(what[t] for t in a["tasks"].split(",")) + ".", "",
             "| policy | prefill chunk | ppl (vs full) | ROUGE-L vs full | pass-key |", "|---|---|---|---|---|"]
    for r in quality_rows(result):
        ppl = "" if r["ppl"] is None else f"{r['ppl']:.2f}" + (
            "" if r["policy"] == "full" else f" ({100 * (r['ppl_ratio'] - 1):+.1f}%)")
        rouge = "" if r["rouge_l"] is None else f"{r['rouge_l']:.3f}"
        key = "" if r["passkey"] is None else f"{r['passkey'][0]}/{r['passkey'][1]}"
        chunk = "-" if r["policy"] == "full" else (r["chunk"] or "whole prompt")
        lines.append(f"| {'full cache' if r['policy'] == 'full' else r['policy']} | {chunk} | {ppl} | {rouge} | {key} |")
    return "\n".join(lines) + "\n"


def quality_plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = quality_rows(result)
    full = next(r for r in rows if r["policy"] == "full")
    chunks = sorted({r["chunk"] for r in rows if r["chunk"]}) + [None]
    names = [str(c) for c in chunks[:-1]] + ["whole"]
    metrics = [("ppl", "perplexity"), ("rouge_l", "ROUGE-L vs full cache"), ("passkey", "pass-key correct")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, title) in zip(axes, metrics):
        for i, policy in enumerate(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full")):
            by_chunk = {r["chunk"]: r for r in rows if r["policy"] == policy}
            ys = [by_chunk[c][key] for c in chunks]
            ys = [y[0] / y[1] if isinstance(y, tuple) else y for y in ys]
            ax.plot(names, ys, marker="o", color=f"C{i}", label=policy)
        ref = full[key]
        if ref is not None:
            ax.axhline(ref[0] / ref[1] if isinstance(ref, tuple) else ref, color="k", lw=0.8, label="full cache")
        ax.set(title=title, xlabel="prefill chunk (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['meta']['model']).name}: prefill chunks vs the prompt held whole, "
                 f"{float(result['meta']['args']['budgets']) * 100:g}% budget", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from h2o_devtools import bench, models
    if args.one:
        bench.run_job_file(args.one, capacity_one)
        return {}
    model = str(models.model_dir(args.model))
    out = out_dir(args)
    command = " ".join([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)])
    if args.mode == "throughput":
        import throughput
        result = throughput.main(throughput_argv(args, model, out))
        if args.ceiling:
            result["ceiling"] = throughput.main(
                throughput_argv(args, model, out / "ceiling", "stock", args.num_requests))
            (out / "throughput.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "long_prompts.md").write_text(throughput_table(result))
    elif args.mode == "quality":
        import quality
        result = quality.main(quality_argv(args, model, out))
        (out / "long_prompts.md").write_text(quality_table(result))
        quality_plot(result, out / "long_prompts.png")
    else:
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
                "loadavg_before": os.getloadavg(), "command": command, "model": model, "args": vars(args)}
        started = time.perf_counter()
        result = {"meta": meta, **capacity(args, model, out, bench.engine_env(args.omp_threads))}
        meta.update(loadavg_after=os.getloadavg(), elapsed_s=time.perf_counter() - started)
        (out / "capacity.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "capacity.md").write_text(capacity_table(result))
        capacity_plot(result, out / "capacity.png")
    result["meta"]["long_prompts_command"] = command
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
