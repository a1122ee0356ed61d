"""Where one long prefill's time goes, stock vLLM vs H2O, part by part.

Each configuration runs in a fresh subprocess with an in-process engine (the CPU worker then
runs in this process, one OpenMP thread by default, so wall time is CPU time). After a short
warm-up prompt, one ``--prompt-len`` prompt of real text is prefilled (``max_tokens=1``) with
the worker's parts wrapped in timers (``timed_parts``): vLLM's attention kernel and K/V write,
H2O's step metadata, score pass, compaction. torch.profiler with Python stacks was tried first: its
overhead tripled the step and its stacks did not reach the ops. Writes ``prefill_profile.json``
and ``.md``.

    python benchmarks/prefill_profile.py                  # SmolLM2-135M, 2,048 tokens, stock + paper H2O
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path


def timed_parts() -> list[tuple[str, object, object]]:
    """(part, owner, callable) of each callable timed in the worker, named by attribute reference:
    a function renamed or moved fails here (and in tests/unit/benchmarks/test_prefill_profile.py),
    not by timing nothing. vLLM's own come through the seam (``vllm_shims.introspect``). A part's
    time excludes the time of the parts nested in it; "model and the rest" is the step's wall time
    outside all of them."""
    from h2o_vllm.vllm_shims import introspect
    from h2o_vllm.worker import attention_backend, plan
    from h2o_vllm.worker.cpu.ops import CPUOps

    vllm_attention = introspect.cpu_attention_impl()
    return [
        ("vLLM attention kernel", vllm_attention, vllm_attention.forward),
        ("K/V write", vllm_attention, vllm_attention.do_kv_cache_update),
        # The runner hook's step plan (each request's budget resolved once, then this), and the
        # attention metadata the builders derive from it.
        ("H2O step metadata", plan, plan.make_step_plan),
        ("H2O step metadata", attention_backend, attention_backend.kv_space_metadata),
        # The rest of the per-layer sequence: the keep-sets (policy.select_keep) and the mass.
        ("H2O keep-set selection", attention_backend, attention_backend.update_scores_and_compact),
        ("H2O attention + scores", CPUOps, CPUOps.attend),
        ("H2O score pass", CPUOps, CPUOps.accumulate),
        ("H2O compaction", CPUOps, CPUOps.compact),
    ]


def attribute_name(owner, fn) -> str:
    """The name under which ``owner`` holds ``fn`` (where callers look it up), or an error."""
    import inspect
    name = fn.__name__
    if inspect.getattr_static(owner, name, None) is not fn:
        raise RuntimeError(f"{getattr(owner, '__name__', owner)}.{name} is not {fn.__qualname__}: "
                           "update benchmarks/prefill_profile.py timed_parts()")
    return name


class PartTimer:
    """Wall time per part, nested calls charged to the innermost part only (single-threaded
    callers: the CPU worker runs its layers in one Python thread)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            frame = [part, time.perf_counter(), 0.0]  # part, start, time of nested parts
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[1]
                self.totals[part] += spent - frame[2]
                if self._stack:
                    self._stack[-1][2] += spent
        return timed

    def install(self) -> None:
        for part, owner, fn in timed_parts():
            setattr(owner, attribute_name(owner, fn), self.wrap(part, fn))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: offline SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--configs", default="stock,h2o:0.2", help="comma list: stock, h2o:<budget>, <mode>:<budget>")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS of the engines ('' = unset)")
    p.add_argument("--text", default="gpl3")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/<date>-<host>/prefill-profile)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_one(job: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from h2o_devtools import bench

    policy, _, budget = job["config"].partition(":")
    h2o = bench.h2o_config(policy, float(budget) if budget else None)
    extra = {} if h2o is None else {"additional_config": {"h2o": h2o}}
    n = job["prompt_len"]
    llm = LLM(job["model"], dtype=job["dtype"], block_size=job["block_size"], enable_prefix_caching=False,
              max_model_len=n + 64, max_num_batched_tokens=n + 64, enforce_eager=True, seed=0, **extra)
    ids = llm.get_tokenizer().encode(bench.read_text(job["text"]))
    warm, prompt = bench.text_prompts(ids, 2, n, seed=1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": warm[:256]}], params, use_tqdm=False)
    timer = PartTimer()
    timer.install()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    wall = time.perf_counter() - start
    parts = dict(timer.totals)
    parts["model and the rest"] = wall - sum(parts.values())
    return {"config": job["config"], "prompt_len": n, "wall_s": wall, "parts_s": dict(parts)}


def to_markdown(results: list[dict]) -> str:
    parts = sorted({p for r in results for p in r["parts_s"]})
    head = "| part | " + " | ".join(f"{r['config']} (s)" for r in results) + " |"
    lines = [head, "|---|" + "---|" * len(results)]
    for part in parts:
        lines.append(f"| {part} | " + " | ".join(f"{r['parts_s'].get(part, 0.0):.2f}" for r in results) + " |")
    lines.append("| **wall** | " + " | ".join(f"**{r['wall_s']:.2f}**" for r in results) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    from h2o_devtools import bench
    from h2o_devtools.models import smollm2_dir

    a = parse_args(argv)
    if a.one:
        bench.run_job_file(a.one, run_one)
        return []
    out = Path(a.out) if a.out else bench.results_dir(None, __file__) / "prefill-profile"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = a.model or str(smollm2_dir())
    results = []
    for config in a.configs.split(","):
        stem = out / "logs" / config.replace(":", "-")
        job = {"config": config, "model": model, "dtype": a.dtype, "prompt_len": a.prompt_len,
               "block_size": a.block_size, "text": a.text, "result": f"{stem}.result.json"}
        results.append(bench.run_child(__file__, job, stem, bench.engine_env(a.omp_threads), config))
        print(json.dumps(results[-1]), flush=True)
    (out / "prefill_profile.json").write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    (out / "prefill_profile.md").write_text(to_markdown(results))
    print(to_markdown(results))
    return results


if __name__ == "__main__":
    main()
