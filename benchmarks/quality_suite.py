"""Long-context quality suite (issue 59): RULER-style tasks made here, the pass key and
(optionally) perplexity, every policy against the full cache, with and without ``prefill_chunk``.

Tasks (``h2o_devtools.ruler``; Hsieh et al. 2024): needle in a haystack with one key, with
distractor keys, with several values; variable tracking; common-words extraction; a question
about a fact at the start, middle or end; plus ``benchmarks/quality.py``'s pass key
(``passkey``) and, with ``--tasks ...,ppl``, its streaming perplexity (the dense oracle, as
there; not in the suite score, which averages accuracies). Haystacks are windows of a
public-domain text (``--haystack``), nothing is downloaded.

Every generation runs through vLLM with the plugin: stock vLLM for the full cache, and one H2O
engine serving every (policy, budget, prefill chunk) through per-request ``extra_args``
(``prefill_chunk`` is a per-request key too). ``random`` is the paper's budget with the heavy
half drawn at random, a benchmark-only score mode (``h2o_devtools/random_eviction.py``).

    python benchmarks/quality_suite.py --samples 2 --policies local,random,h2o,window+pool
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # quality.py and quality_suite_report.py, beside this script
import quality  # noqa: E402
import quality_suite_report as report  # noqa: E402

#: Policies beside the full cache. A new score mode is one line in ``h2o_devtools.bench.MODES``
#: (e.g. ``"keydiff": {"score": "keydiff"}``) and one name here.
POLICIES = ("local", "random", "h2o", "decay", "sinks", "window", "window+sinks", "pool", "window+pool",
            "window+pool+sinks")


def parse_args(argv=None) -> argparse.Namespace:
    from h2o_devtools import ruler
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory, or smollm2 (default) | gemma3-270m")
    p.add_argument("--budgets", default="0.5,0.2,0.1", help="total budgets, fractions of the prompt")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="beside the full cache: local, random, h2o and h2o_devtools.bench.MODES' names")
    p.add_argument("--chunks", default="256",
                   help="prefill_chunk sizes each policy also runs with ('' none); the prompt held whole always runs")
    p.add_argument("--tasks", default=",".join([*ruler.TASKS, "passkey"]),
                   help=f"of {', '.join(ruler.TASKS)}, passkey, ppl")
    p.add_argument("--samples", type=int, default=4, help="samples per task")
    p.add_argument("--context-len", type=int, default=1024, help="tokens of each prompt (about)")
    p.add_argument("--haystack", default="gpl3", help="gpl3, jargon, devil or a path (bench.read_text)")
    p.add_argument("--ppl-texts", default="gpl3,devil", help="quality.py's --texts, for the ppl task")
    p.add_argument("--ppl-windows", type=int, default=1)
    p.add_argument("--ppl-prompt-len", type=int, default=512)
    p.add_argument("--ppl-continuation-len", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS ('' = leave unset); see throughput.py")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default benchmarks/results/<date>-<host>-quality-suite")
    p.add_argument("--rescore", default=None, metavar="DIR",
                   help="score DIR/quality_suite.json's outputs again (scorer or table changed), no engine")
    p.add_argument("--merge", default=None, metavar="DIR,DIR",
                   help="join runs of one model that split the grid (their full caches must agree) into --out, no engine")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one vLLM engine
    return p.parse_args(argv)


def labels(args) -> list[tuple[str, str, float | None]]:
    """(label, policy, budget): the full cache, then each policy, held whole and with each chunk."""
    chunks = [f"@c{c}" for c in args.chunks.split(",") if c]
    names = [p + c for p in args.policies.split(",") if p for c in ["", *chunks]]
    return quality.policies([float(b) for b in args.budgets.split(",")], names)


def build_requests(args: argparse.Namespace, tokenizer) -> list[dict]:
    """The suite's prompts as token ids, identical in every engine (seeded)."""
    from h2o_devtools import bench, ruler
    text = bench.read_text(args.haystack)
    lead = quality.leading_specials(tokenizer)
    tasks = args.tasks.split(",")
    requests = []
    length = lambda s: len(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    haystack = ruler.Haystack(text, length)
    for task in (t for t in tasks if t in ruler.TASKS):
        for i, s in enumerate(ruler.samples(task, args.samples, args.seed, haystack, args.context_len, length)):
            requests.append({"task": task, "id": f"{task}-{i}", "answers": list(s.answers),
                             "prompt": lead + tokenizer.encode(s.prompt, add_special_tokens=False),
                             "max_tokens": s.max_tokens})
    if "passkey" in tasks:
        filler = tokenizer.encode(text, add_special_tokens=False)
        for i, (prompt, key) in enumerate(quality.passkey_prompts(tokenizer, filler, args.samples,
                                                                  args.context_len - 48, args.seed)):
            requests.append({"task": "passkey", "id": f"passkey-{i}", "answers": [key], "prompt": prompt,
                             "max_tokens": 12})
    return requests


def run_engine(job: dict) -> dict:
    """Child process: stock vLLM (the full cache) or one H2O engine for every other label,
    one ``generate`` per label, each finished label a line in ``job['progress']``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from h2o_devtools import bench, random_eviction

    a = job["args"]
    if job["h2o"]:
        random_eviction.register()  # before the engine parses a config; inert for other policies
    llm = bench.quality_engine(job["model"], a, job["max_model_len"], job["h2o"])
    requests = build_requests(argparse.Namespace(**a), llm.get_tokenizer())
    todo = [lab for lab in job["labels"] if (lab[1] != "full") == job["h2o"]]
    results = {}
    for label, policy, budget in todo:
        h2o = random_eviction.h2o_config(policy, budget) if policy != "full" else None
        extra_args = {f"h2o_{k}": v for k, v in h2o.items()} if h2o else None
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], extra_args=extra_args)
                  for r in requests]
        outputs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, use_tqdm=False)
        results[label] = [{"task": r["task"], "id": r["id"], "answers": r["answers"], "prompt_len": len(r["prompt"]),
                           "text": out.outputs[0].text} for r, out in zip(requests, outputs)]
        with open(job["progress"], "a") as f:
            f.write(label + "\n")
    return results


def run_with_progress(job: dict, stem: Path, env: dict, what: str, bar: tqdm) -> dict:
    """``bench.run_child`` that advances ``bar`` by each label the child reports done."""
    from h2o_devtools import bench
    Path(job["progress"]).write_text("")
    proc = bench.spawn_child(__file__, job, stem, env)
    done = 0
    while proc.poll() is None:
        time.sleep(2)
        now = len(Path(job["progress"]).read_text().splitlines())
        if now > done:  # update(0) would redraw the bar: a line every 2 s in a log file
            bar.update(now - done)
            done = now
    Path(job["progress"]).unlink()
    return bench.child_result(job, stem, what, proc.returncode)


def ppl_task(args, model: str, suite_labels, bar: tqdm) -> dict:
    """quality.py's streaming perplexity (the dense oracle) for every label it can state:
    ``random`` is the engine's benchmark-only mode and is left out."""
    from h2o_devtools import random_eviction
    texts = quality.available_texts(args.ppl_texts)
    ns = argparse.Namespace(**vars(args), kv_cache_dtype="auto")
    runnable = [lab for lab in suite_labels if not lab[1].startswith(random_eviction.POLICY)]
    bar.total += len(texts) * len(runnable) * args.ppl_windows
    return quality.streaming_ppl(ns, model, texts, runnable, bar)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        from h2o_devtools import bench
        bench.run_job_file(args.one, run_engine)
        return {}
    if args.rescore:
        return rescore(Path(args.rescore))
    if args.merge:
        return merge([Path(d) for d in args.merge.split(",")], Path(args.out))
    if not set(args.tasks.split(",")) - {"ppl"}:
        raise SystemExit("ppl runs beside the engine tasks (the suite score is theirs); for ppl alone: quality.py")
    from h2o_devtools import bench, models

    model = str(models.model_dir(args.model))
    host = socket.gethostname()
    out = bench.results_dir(args.out or str(Path(__file__).parent / "results" /
                                            f"{datetime.date.today()}-{host}-quality-suite"), __file__)
    env = bench.engine_env(args.omp_threads)
    suite_labels = labels(args)
    started = time.perf_counter()
    result = {"meta": {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host, "nproc": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "command": " ".join([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]),
        "model": model, "args": vars(args)},
        "policies": {lab: {"policy": pol, "budget": b} for lab, pol, b in suite_labels}}
    # + <bos>, the sizing's slack (whole sentences) and the longest answer
    max_len = -(-(args.context_len + 160) // args.block_size) * args.block_size
    bar = tqdm(total=len(suite_labels), desc="quality suite", unit="policy")
    outputs = {}
    for h2o in (False, True)[:2 if len(suite_labels) > 1 else 1]:  # --policies '': the full cache alone
        name = "h2o" if h2o else "stock"
        bar.set_postfix_str("vLLM " + ("H2O, every policy" if h2o else "stock (full cache)"))
        job = {"args": vars(args), "model": model, "h2o": h2o, "labels": suite_labels, "max_model_len": max_len,
               "result": str(out / "logs" / f"suite-{name}.part.json"),
               "progress": str(out / "logs" / f"suite-{name}.progress")}
        outputs.update(run_with_progress(job, out / "logs" / f"suite-{name}", env, f"{name} engine", bar))
    if "ppl" in args.tasks.split(","):
        bar.set_postfix_str("streaming perplexity (oracle)")
        for label, per_text in ppl_task(args, model, suite_labels, bar).items():
            result["policies"][label]["ppl"] = per_text
    bar.close()
    result["outputs"] = outputs
    result["meta"]["loadavg_after"] = os.getloadavg()
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    return write(result, out)


def write(result: dict, out: Path) -> dict:
    """Score the outputs; write the JSON, the table and the plot."""
    from h2o_devtools.ruler import summary
    for label, entry in summary.scores(result["outputs"]).items():
        result["policies"][label].update(entry)
    (out / "quality_suite.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "quality_suite.md").write_text(report.markdown_table(result))
    report.plot(result, out / "quality_suite.png")
    print(report.markdown_table(result))
    print(f"wrote {out / 'quality_suite.json'}, {out / 'quality_suite.md'} and {out / 'quality_suite.png'}")
    return result


def rescore(out: Path) -> dict:
    return write(json.loads((out / "quality_suite.json").read_text()), out)



def merge(dirs: list[Path], out: Path) -> dict:
    """One result from runs that split the grid (e.g. a budget per run, to fit the time there
    is): every run's stock engine must have written the same full-cache outputs."""
    runs = [json.loads((d / "quality_suite.json").read_text()) for d in dirs]
    if any(r["outputs"]["full"] != runs[0]["outputs"]["full"] for r in runs):
        raise SystemExit("the runs' full-cache outputs differ: not one experiment")
    result = {"meta": {**runs[0]["meta"], "merged_from": [r["meta"] for r in runs]},
              "policies": {}, "outputs": {}}
    for r in runs:
        result["policies"].update(r["policies"])
        result["outputs"].update(r["outputs"])
    # a run's order: policy by policy (first seen), budgets from large to small
    order = list(dict.fromkeys(e["policy"] for e in result["policies"].values()))
    result["policies"] = dict(sorted(result["policies"].items(),
                                     key=lambda kv: (order.index(kv[1]["policy"]), -(kv[1]["budget"] or 0))))
    out.mkdir(parents=True, exist_ok=True)
    return write(result, out)


if __name__ == "__main__":
    main()
