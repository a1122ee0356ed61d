"""Quality against the full cache: H2O vs "Local" (recent only) at the same budgets, real text.

(a) streaming perplexity: teacher-forced log-probs of a continuation of real text with eviction
    running, through the dense oracle (h2o_vllm.oracle, one token per step, interval 1);
(b) greedy generations through vLLM compared with stock vLLM (full cache): token agreement
    and ROUGE-L;
(c) pass-key retrieval: a number stated at the start of a long prompt of real text, asked at
    the end; accuracy.

Budgets are fractions of the prompt (H2O: half heavy, half recent; Local: all recent). The vLLM
parts run in two fresh subprocesses: stock vLLM, and one H2O engine serving every policy and
budget through per-request overrides (``SamplingParams.extra_args``).

    python benchmarks/quality.py        # default: SmolLM2-135M, <= 15 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import socket
import sys
import time
from pathlib import Path

from tqdm import tqdm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory, or smollm2 (default) | gemma3-270m")
    p.add_argument("--budgets", default="0.5,0.2,0.1", help="total budgets, fractions of the prompt")
    p.add_argument("--policies", default="h2o,local,decay,sinks,window,window+sinks,pool,window+pool,"
                                          "window+pool+sinks",
                   help="policies beside the full cache: h2o (paper), local, and the score modes of "
                        "h2o_devtools.bench.MODES")
    p.add_argument("--texts", default="gpl3,devil",
                   help="gpl3, jargon, devil or paths; missing ones are skipped with a warning")
    p.add_argument("--tasks", default="ppl,gen,passkey")
    p.add_argument("--ppl-windows", type=int, default=1, help="windows of real text per text (a)")
    p.add_argument("--ppl-prompt-len", type=int, default=512)
    p.add_argument("--ppl-continuation-len", type=int, default=256)
    p.add_argument("--gen-prompts", type=int, default=4, help="prompts per text (b)")
    p.add_argument("--gen-prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--passkey-samples", type=int, default=12, help="(c)")
    p.add_argument("--passkey-filler", type=int, default=512, help="tokens of real text between key and question")
    p.add_argument("--passkey-text", default="gpl3",
                   help="filler text for (c); SmolLM2 fails even with the full cache on devil filler")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="fp8 (e4m3, scale 1), every policy the full cache's included: (a) the "
                        "oracle's cache holds K/V as a GPU's fp8 cache gives them back (rounded to "
                        "nearest even); (b) and (c) run vLLM's CPU engines with --kv-cache-dtype fp8 "
                        "(their writer truncates; needs AVX-512 or AMX and a --block-size multiple of 32)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS ('' = leave unset); see throughput.py")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/<date>-<host>)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one vLLM engine
    return p.parse_args(argv)


def policies(budgets: list[float], names=("h2o", "local")) -> list[tuple[str, str, float | None]]:
    """(label, policy, budget): the full cache, then each policy at every budget."""
    out = [("full", "full", None)]
    for policy in names:
        out += [(f"{policy}-{round(b * 100):g}%", policy, b) for b in budgets]
    return out


def available_texts(names: str) -> dict[str, list[int]]:
    from h2o_devtools import bench
    texts = {}
    for name in names.split(","):
        try:
            texts[name] = bench.read_text(name)
        except FileNotFoundError as exc:
            print(f"skipping text {name}: {exc}", file=sys.stderr)
    return texts


def windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    """n windows of ``length`` tokens, evenly spread over the text."""
    if len(ids) < length:
        raise ValueError(f"text has {len(ids)} tokens, fewer than {length}")
    span = len(ids) - length
    return [ids[i * span // max(1, n - 1):][:length] for i in range(n)]


def leading_specials(tokenizer) -> list[int]:
    """What the tokenizer puts before any text (Gemma: <bos>, without which its output is
    garbage; SmolLM2: nothing). Every prompt here starts with it, as a served prompt would."""
    return tokenizer.encode("", add_special_tokens=True)


def passkey_prompts(tokenizer, filler_ids: list[int], n: int, filler_len: int, seed: int):
    """(prompt ids, key) pairs: the key first, ``filler_len`` tokens of real text, the question."""
    rng = random.Random(seed)
    lead = leading_specials(tokenizer)
    items = []
    for _ in range(n):
        key = str(rng.randrange(10000, 1000000))
        start = rng.randrange(0, len(filler_ids) - filler_len)
        head = tokenizer.encode(f"The secret pass key is {key}. Remember it, you will be asked for it.\n\n",
                                add_special_tokens=False)
        tail = tokenizer.encode("\n\nWhat is the secret pass key? The secret pass key is", add_special_tokens=False)
        items.append((lead + head + filler_ids[start:start + filler_len] + tail, key))
    return items


def build_requests(args, tokenizer, texts: dict[str, str]) -> list[dict]:
    """The prompts of (b) and (c), identical for every engine."""
    requests = []
    lead = leading_specials(tokenizer)
    all_ids = {}
    for name, text in texts.items():
        all_ids[name] = tokenizer.encode(text, add_special_tokens=False)
    if "gen" in args.tasks:
        for name, ids in all_ids.items():
            for i, w in enumerate(windows(ids, args.gen_prompts, args.gen_prompt_len)):
                requests.append({"task": "gen", "id": f"{name}-{i}", "prompt": lead + w,
                                 "max_tokens": args.gen_len})
    if "passkey" in args.tasks:
        filler = tokenizer.encode(available_texts(args.passkey_text)[args.passkey_text], add_special_tokens=False)
        for i, (prompt, key) in enumerate(passkey_prompts(tokenizer, filler, args.passkey_samples,
                                                          args.passkey_filler, args.seed)):
            requests.append({"task": "passkey", "id": f"key-{i}", "prompt": prompt, "max_tokens": 12,
                             "key": key})
    return requests


def run_engine(job: dict) -> dict:
    """Child process: stock vLLM (job['h2o'] false) or one H2O engine for every policy."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from h2o_devtools import bench

    a = job["args"]
    llm = bench.quality_engine(job["model"], a, job["max_model_len"], job["h2o"])
    tokenizer = llm.get_tokenizer()
    requests = build_requests(argparse.Namespace(**a), tokenizer, available_texts(a["texts"]))
    labels = [p for p in job["policies"] if p[1] != "full"] if job["h2o"] else [("full", "full", None)]
    prompts, params, keys = [], [], []
    for label, policy, budget in labels:
        h2o = bench.h2o_config(policy, budget) if policy != "full" else None
        extra_args = {f"h2o_{k}": v for k, v in h2o.items()} if h2o and job["h2o"] else None
        for req in requests:
            prompts.append({"prompt_token_ids": req["prompt"]})
            params.append(SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                                         extra_args=extra_args))
            keys.append((label, req))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results = {}
    for (label, req), out in zip(keys, outputs):
        results.setdefault(label, []).append({
            "task": req["task"], "id": req["id"], "key": req.get("key"), "prompt_len": len(req["prompt"]),
            "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text})
    return results


def compare_generations(engine_out: dict) -> dict:
    """Per policy: (b) agreement with the full cache, (c) pass-key accuracy."""
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    full = {r["id"]: r for r in engine_out["full"]}
    summary = {}
    for label, rows in engine_out.items():
        gen = [r for r in rows if r["task"] == "gen"]
        keys = [r for r in rows if r["task"] == "passkey"]
        entry = {}
        if gen:
            agree, prefix, rouge = [], [], []
            for r in gen:
                ref = full[r["id"]]["token_ids"]
                same = [a == b for a, b in zip(r["token_ids"], ref)]
                agree.append(sum(same) / len(ref))
                prefix.append((same.index(False) if False in same else len(same)) / len(ref))
                rouge.append(scorer.score(full[r["id"]]["text"], r["text"])["rougeL"].fmeasure)
            entry.update(token_agreement=sum(agree) / len(gen), prefix_agreement=sum(prefix) / len(gen),
                         rouge_l=sum(rouge) / len(gen), num_gen=len(gen))
        if keys:
            hits = [r["key"] in r["text"] for r in keys]
            entry.update(passkey_accuracy=sum(hits) / len(keys), num_passkey=len(keys),
                         passkey_answers=[r["text"] for r in keys])
        summary[label] = entry
    return summary


def streaming_ppl(args, model_dir: str, texts: dict[str, str], labels, progress) -> dict:
    """(a) per policy and text: perplexity of the continuation tokens, eviction running."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from h2o_devtools import bench
    from h2o_vllm.config import H2OConfig
    from h2o_vllm.oracle import FP8_E4M3, H2OOracle, StoredKV

    stored_kv = FP8_E4M3 if args.kv_cache_dtype == "fp8" else StoredKV()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    length = args.ppl_prompt_len + args.ppl_continuation_len
    lead = leading_specials(tokenizer)
    out = {}
    for name, text in texts.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        for label, policy, budget in labels:
            h2o = bench.h2o_config(policy, budget) if policy != "full" else None
            # interval 1: the paper's per-step eviction (what these numbers always were), not one block.
            ref = H2OOracle(model, H2OConfig.from_dict({**h2o, "interval": 1}) if h2o else None,
                            stored_kv=stored_kv)
            nll, count, started = 0.0, 0, time.perf_counter()
            for w in windows(ids, args.ppl_windows, length):
                logprobs = ref.score(lead + w[:args.ppl_prompt_len], w[args.ppl_prompt_len:])
                nll -= float(logprobs.sum())
                count += logprobs.numel()
                progress.update(1)
            out.setdefault(label, {})[name] = {"ppl": math.exp(nll / count), "nll": nll / count,
                                               "tokens": count, "seconds": time.perf_counter() - started}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        from h2o_devtools import bench
        bench.run_job_file(args.one, run_engine)
        return {}
    from h2o_devtools import bench, models

    model = str(models.model_dir(args.model))
    host = socket.gethostname()
    out = bench.results_dir(args.out, __file__)
    env = bench.engine_env(args.omp_threads)
    if args.omp_threads:
        import torch
        torch.set_num_threads(int(args.omp_threads))
    budgets = [float(b) for b in args.budgets.split(",")]
    labels = policies(budgets, args.policies.split(","))
    texts = available_texts(args.texts)
    if not texts:
        raise SystemExit("no text available; see benchmarks/README.md")
    started = time.perf_counter()
    result = {"meta": {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host, "nproc": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "command": " ".join([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]),
        "model": model, "texts": list(texts), "policies": [lab for lab, _, _ in labels], "args": vars(args)},
        "policies": {lab: {"policy": pol, "budget": b} for lab, pol, b in labels}}
    tasks = args.tasks.split(",")
    num_engines = 2 if {"gen", "passkey"} & set(tasks) else 0
    num_ppl = len(texts) * len(labels) * args.ppl_windows if "ppl" in tasks else 0
    bar = tqdm(total=num_engines + num_ppl, desc="quality", unit="step")
    if num_engines:
        max_len = max(args.gen_prompt_len + args.gen_len, args.passkey_filler + 64 + 12) + 1  # + <bos>
        max_len = -(-max_len // args.block_size) * args.block_size
        engine_out = {}
        for h2o in (False, True):
            bar.set_postfix_str("vLLM " + ("H2O + Local" if h2o else "stock (full cache)"))
            job = {"args": vars(args), "model": model, "h2o": h2o, "policies": labels, "max_model_len": max_len,
                   "result": str(out / "logs" / f"quality-{'h2o' if h2o else 'stock'}.part.json")}
            engine_out.update(bench.run_child(__file__, job, out / "logs" / f"quality-{'h2o' if h2o else 'stock'}",
                                              env, "engine"))
            bar.update(1)
        for label, entry in compare_generations(engine_out).items():
            result["policies"][label].update(entry)
        result["generations"] = engine_out
    if num_ppl:
        bar.set_postfix_str("streaming perplexity (oracle)")
        for label, per_text in streaming_ppl(args, model, texts, labels, bar).items():
            result["policies"][label]["ppl"] = per_text
    bar.close()
    if num_ppl:
        for label in result["policies"]:
            for name, entry in result["policies"][label]["ppl"].items():
                entry["ppl_ratio_to_full"] = entry["ppl"] / result["policies"]["full"]["ppl"][name]["ppl"]
    result["meta"]["loadavg_after"] = os.getloadavg()
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "quality.md").write_text(markdown_table(result))
    plot(result, out / "quality.png")
    print_table(result)
    print(f"wrote {out / 'quality.json'}, {out / 'quality.md'} and {out / 'quality.png'}")
    return result


def print_table(result: dict) -> None:
    for label, entry in result["policies"].items():
        ppl = " ".join(f"{n}={v['ppl']:.2f}" for n, v in entry.get("ppl", {}).items())
        print(f"{label:10s} ppl[{ppl}] rougeL={entry.get('rouge_l', float('nan')):.3f} "
              f"agree={entry.get('token_agreement', float('nan')):.3f} "
              f"passkey={entry.get('passkey_accuracy', float('nan')):.2f}")


def markdown_table(result: dict) -> str:
    """The docs/results.md table of one run, straight from its JSON (no number typed by hand)."""
    texts = result["meta"]["texts"]
    lines = ["| policy | " + " | ".join(f"ppl {t}" for t in texts) + " | ROUGE-L vs full | token agreement | pass-key |",
             "|---|" + "---|" * (len(texts) + 3)]
    for label, entry in result["policies"].items():
        name = "full cache" if label == "full" else label.replace("h2o-", "H2O ").replace("local-", "Local ")
        name = name.replace("-", " ")
        cells = []
        for t in texts:
            ppl = entry.get("ppl", {}).get(t)
            if ppl is None:
                cells.append("")
            elif label == "full":
                cells.append(f"{ppl['ppl']:.2f}")
            else:
                cells.append(f"{ppl['ppl']:.2f} ({100 * (ppl['ppl_ratio_to_full'] - 1):+.1f}%)")
        for key in ("rouge_l", "token_agreement"):
            cells.append(f"{entry[key]:.3f}" if key in entry else "")
        if "passkey_accuracy" in entry:
            cells.append(f"{round(entry['passkey_accuracy'] * entry['num_passkey'])}/{entry['num_passkey']}")
        else:
            cells.append("")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """One panel per metric; perplexity as its ratio to the full cache's (log scale, one line
    style per text), so that Local's scale does not flatten the rest; one legend of policies."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    pols = result["policies"]
    budgets = sorted({e["budget"] for e in pols.values() if e["budget"] is not None}, reverse=True)
    metrics = [("ppl", "perplexity / full cache's (log)"), ("rouge_l", "ROUGE-L vs full cache"),
               ("token_agreement", "token agreement vs full cache"), ("passkey_accuracy", "pass-key accuracy")]
    texts = result["meta"]["texts"]
    styles = dict(zip(texts, ("-", "--", ":")))
    names = list(dict.fromkeys(e["policy"] for e in pols.values() if e["policy"] != "full"))
    colors = {policy: f"C{i % 10}" for i, policy in enumerate(names)}
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4.2))
    for ax, (key, title) in zip(axes, metrics):
        for policy in names:
            rows = [next(e for e in pols.values() if e["policy"] == policy and e["budget"] == b) for b in budgets]
            if key == "ppl":
                for text in texts:
                    ys = [r.get("ppl", {}).get(text, {}).get("ppl_ratio_to_full") for r in rows]
                    if None not in ys:
                        ax.plot(budgets, ys, styles[text], color=colors[policy], marker="o", ms=3)
            elif all(key in r for r in rows):
                ax.plot(budgets, [r[key] for r in rows], color=colors[policy], marker="o", ms=3)
        full = pols["full"]
        if key == "ppl":
            ax.set_yscale("log")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.legend([Line2D([], [], color="k", ls=styles[t]) for t in texts], texts, fontsize=7)
        elif key in full:
            ax.axhline(full[key], color="k", lw=0.8)
        ax.set(title=title, xlabel="budget (fraction of the prompt)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colors[p], marker="o", ms=3) for p in names] + [Line2D([], [], color="k", lw=0.8)]
    labels = [{"h2o": "H2O (paper)", "local": "Local"}.get(p, p) for p in names] + ["full cache"]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
    fig.suptitle(f"{Path(result['meta']['model']).name}: quality vs KV budget", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
