"""Workloads and measurement shared by ``benchmarks/throughput.py`` and ``benchmarks/quality.py``.

Runs in the benchmark process. ``measure`` needs an in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it drives ``LLMEngine.step()`` itself and reads the
scheduler between steps. The CPU executor runs the worker in the same process, so one
process holds scheduler, model and H2O; timing covers all of it.
"""
from __future__ import annotations

import datetime
import gzip
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from h2o_devtools.models import default_cache_dir

#: Real English text available offline: Debian ships GPL-3 everywhere; the other two come from
#: `apt-get install jargon-text` and `apt-get download dict-devil` + `dpkg-deb -x` into
#: $H2O_VLLM_CACHE/dict-devil (benchmarks/README.md). First existing path wins.
TEXTS = {
    "gpl3": [Path("/usr/share/common-licenses/GPL-3")],
    "jargon": [Path("/usr/share/doc/jargon-text/jargon.txt.gz")],
    "devil": [Path("/usr/share/dictd/devil.dict.dz"),
              default_cache_dir() / "dict-devil/usr/share/dictd/devil.dict.dz"],
}

def results_dir(out: str | None, script: str) -> Path:
    """``--out`` or ``benchmarks/results/<date>-<host>/`` beside ``script``, with its logs/."""
    path = Path(out or Path(script).parent / "results" / f"{datetime.date.today()}-{socket.gethostname()}")
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path


def engine_env(omp_threads: str) -> dict[str, str]:
    """Environment of a benchmark's engine child: in-process engine core (``measure`` reads the
    scheduler), a KV profile cap (pools are fixed by the scripts), one OpenMP thread unless told."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if omp_threads:
        env["OMP_NUM_THREADS"] = omp_threads
    return env


def run_child(script: str, job: dict, stem: Path, env: dict[str, str], what: str,
              timeout: float | None = None) -> dict:
    """Run ``script --one <job>`` in a fresh process (own engine, clean memory and timing),
    its output in ``<stem>.log``; returns the dict it wrote to ``job["result"]``. ``timeout``
    (s): the child is killed past it and ``subprocess.TimeoutExpired`` raised."""
    proc = spawn_child(script, job, stem, env)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return child_result(job, stem, what, rc)


def spawn_child(script: str, job: dict, stem: Path, env: dict[str, str]) -> subprocess.Popen:
    """``run_child`` without waiting: for a child that must stay up while another runs."""
    job_path = Path(f"{stem}.job.json")
    job_path.write_text(json.dumps(job))
    with open(f"{stem}.log", "w") as log:
        return subprocess.Popen([sys.executable, script, "--one", str(job_path)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def child_result(job: dict, stem: Path, what: str, rc: int | None = 0) -> dict:
    """What a child wrote to ``job["result"]`` (``rc``: its exit status, None while it runs)."""
    Path(f"{stem}.job.json").unlink(missing_ok=True)
    if rc:
        raise RuntimeError(f"{what} failed (exit {rc}); see {stem}.log")
    result_path = Path(job["result"])
    result = json.loads(result_path.read_text())
    result_path.unlink()
    return result


def run_job_file(job_file: str, run) -> None:
    """The child side of ``run_child``: ``run(job)`` and write its result where asked."""
    job = json.loads(Path(job_file).read_text())
    Path(job["result"]).write_text(json.dumps(run(job)))


#: The score modes past the paper as the benchmarks run them (docs/score-modes.md): each is the
#: paper's H2O budget (half heavy, half recent) plus these keys.
MODES: dict[str, dict[str, Any]] = {
    "decay": {"decay": 0.95},
    "sinks": {"sink_tokens": 4},
    "window": {"obs_window": 32},
    "window+sinks": {"obs_window": 32, "sink_tokens": 4},
    "pool": {"pool_kernel": 15},
    "window+pool": {"obs_window": 32, "pool_kernel": 15},
    "window+pool+sinks": {"obs_window": 32, "pool_kernel": 15, "sink_tokens": 4},
    # KeyDiff (score: keydiff): ranked by the keys, not the attention; pooled like window+pool.
    "keydiff": {"score": "keydiff"},
    "keydiff+pool": {"score": "keydiff", "pool_kernel": 15},
    # Expected Attention (score: expected): the attention the next queries are expected to give.
    "expected": {"score": "expected"},
    "expected+pool": {"score": "expected", "pool_kernel": 15},
    # The budget floor (min_tokens) on short prompts; floor0 is the paper's rule.
    "floor0": {"min_tokens": 0},
    "floor16": {"min_tokens": 16},
    "floor32": {"min_tokens": 32},
    "floor64": {"min_tokens": 64},
    "floor128": {"min_tokens": 128},
    # Probes of the window for the pass-key task (docs/results.md, "Score modes past the paper").
    "window8": {"obs_window": 8},
    "window16": {"obs_window": 16},
    "window16+decay": {"obs_window": 16, "decay": 0.95},
    "window8+sinks": {"obs_window": 8, "sink_tokens": 4},
}

#: A policy name may end in ``@c<N>``: the same policy with ``prefill_chunk = N`` (the prompt
#: processed in chunks of N tokens, evicting between them). ``h2o@c256``, ``window+pool@c64``.
CHUNK_SUFFIX = "@c"


def h2o_config(policy: str, budget: float | None, max_model_len: int | None = None,
               interval: int = 32) -> dict[str, Any] | None:
    """additional_config["h2o"] for (policy, total budget as a fraction of the prompt).

    "stock": None (no h2o key: the plugin is inert). "full": H2O's machinery with nothing ever
    evicted: heavy = max_model_len - interval, so the first compaction would come at
    max_model_len tokens, which no sequence processes (the overhead of score tracking alone;
    a larger budget is refused by h2o_vllm.frontend.conflicts). "h2o": half heavy, half recent (the
    paper's 0.1 + 0.1 = 20%). "local": recent only, the paper's baseline. A name of ``MODES``:
    the "h2o" budget with that mode's keys. Any of these but "stock" with ``@c<N>``
    (``CHUNK_SUFFIX``): plus ``prefill_chunk = N``. The budgets are the fractions they are
    named for: no floor (``min_tokens`` 0) unless the mode sets one.
    """
    if policy == "stock":
        return None
    if CHUNK_SUFFIX in policy:
        base, _, chunk = policy.partition(CHUNK_SUFFIX)
        config = h2o_config(base, budget, max_model_len, interval)
        if config is None or not chunk.isdigit():
            raise ValueError(f"{policy!r}: an H2O policy, then {CHUNK_SUFFIX}<tokens>, e.g. h2o@c256")
        return {**config, "prefill_chunk": int(chunk)}
    if policy == "full":
        if max_model_len is None:
            raise ValueError("policy 'full' needs max_model_len")
        return {"heavy_tokens": max_model_len - interval, "recent_tokens": 0, "interval": interval}
    if policy == "h2o":
        return {"heavy_ratio": budget / 2, "recent_ratio": budget / 2, "min_tokens": 0}
    if policy == "local":
        return {"heavy_ratio": 0.0, "recent_ratio": budget, "min_tokens": 0}
    if policy in MODES:
        return {"heavy_ratio": budget / 2, "recent_ratio": budget / 2, "min_tokens": 0, **MODES[policy]}
    raise ValueError(f"unknown policy {policy!r}: stock, full, h2o, local, {', '.join(MODES)}")


def quality_engine(model: str, args: dict[str, Any], max_model_len: int, h2o: bool):
    """The offline ``LLM`` of the quality benchmarks' engine children: stock vLLM (``h2o``
    false: the full cache) or an H2O engine whose budget every request overrides
    (``SamplingParams.extra_args``). ``args``: the benchmark's arguments (dtype, block_size,
    seed, kv_cache_dtype if it has one)."""
    from vllm import LLM
    extra = {"additional_config": {"h2o": {"heavy_ratio": 0.1, "recent_ratio": 0.1}}} if h2o else {}
    return LLM(model, dtype=args["dtype"], block_size=args["block_size"], enable_prefix_caching=False,
               max_model_len=max_model_len, enforce_eager=True, seed=args["seed"],
               kv_cache_dtype=args.get("kv_cache_dtype", "auto"), **extra)


def read_text(name_or_path: str) -> str:
    """The text of one of ``TEXTS`` (by name) or of a file path; ``.gz``/``.dz`` are gunzipped."""
    paths = TEXTS.get(name_or_path, [Path(name_or_path)])
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{name_or_path}: none of {[str(p) for p in paths]} exists; "
                                "see benchmarks/README.md for how to install it")
    data = path.read_bytes()
    if path.suffix in (".gz", ".dz"):
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def synthetic_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (avoiding the first 16 ids, where special tokens live)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]


def text_prompts(token_ids: list[int], num_requests: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Windows of ``prompt_len`` tokens of a real text, at seeded random offsets."""
    if len(token_ids) < prompt_len:
        raise ValueError(f"text has {len(token_ids)} tokens, fewer than prompt_len={prompt_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(token_ids) - prompt_len + 1) for _ in range(num_requests)]
    return [token_ids[s:s + prompt_len] for s in starts]


@dataclass
class RunStats:
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0
    peak_blocks_allocated: int = 0  # pool blocks not free right after any allocation (in-step peak)
    running: list[int] = field(default_factory=list)      # per step, after it
    blocks_used: list[int] = field(default_factory=list)  # per step, after it
    held_by_kind: dict[str, list[int]] = field(default_factory=dict)  # per step, by attention kind
    ttft_s: list[float] = field(default_factory=list)     # per request: submission to its first token

    def summary(self) -> dict[str, Any]:
        def mean(xs):
            return sum(xs) / len(xs) if xs else 0.0
        out = {k: v for k, v in asdict(self).items()
               if k not in ("running", "blocks_used", "held_by_kind", "ttft_s")}
        out.update(
            requests_s=self.num_requests / self.elapsed_s,
            output_tok_s=self.output_tokens / self.elapsed_s,
            total_tok_s=(self.prompt_tokens + self.output_tokens) / self.elapsed_s,
            mean_running=mean(self.running), peak_running=max(self.running, default=0),
            mean_blocks_used=mean(self.blocks_used), peak_blocks_used=max(self.blocks_used, default=0),
            held_blocks={kind: {"mean": mean(xs), "peak": max(xs, default=0)} for kind, xs in self.held_by_kind.items()},
            mean_ttft_s=mean(self.ttft_s), median_ttft_s=sorted(self.ttft_s)[len(self.ttft_s) // 2] if self.ttft_s else 0.0,
        )
        return out


def scheduler_of(llm):
    """The in-process scheduler (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from h2o_vllm.vllm_shims import introspect
    return introspect.in_process_scheduler(llm.llm_engine)


def preemptions(llm) -> int:
    """vLLM's own preemption counter (``vllm:num_preemptions``, what its /metrics serves) of
    an offline engine; it counts only with the engine's stats on (``disable_log_stats=False``)."""
    from vllm.v1.metrics.reader import Counter
    counters = [m.value for m in llm.get_metrics() if isinstance(m, Counter) and m.name == "vllm:num_preemptions"]
    if not counters:
        raise RuntimeError("measure() reads vLLM's preemption counter: build the LLM with disable_log_stats=False")
    return int(sum(counters))


def measure(llm, prompts: list[list[int]], params, progress=None) -> RunStats:
    """Submit every prompt at once, step the engine to the end, sample the scheduler per step.
    ``params``: one ``SamplingParams``, or one per prompt.

    running: ``len(scheduler.running)``; blocks_used: pool blocks not free (the null block
    excluded); held_by_kind: ``introspect.held_blocks_by_kind``; peak_blocks_allocated: the
    same right after each ``BlockPool.get_new_blocks`` (a step's peak, before the compactions
    it ends with free blocks); preemptions: vLLM's own counter over the run (``preemptions``);
    ttft_s: each request's first token, from the run's start (all are submitted then).
    ``progress``: a tqdm bar advanced
    per finished request.
    """
    from h2o_vllm.vllm_shims import introspect

    engine = llm.llm_engine
    scheduler = scheduler_of(llm)
    pool = introspect.block_pool(scheduler)
    stats = RunStats(num_requests=len(prompts), num_blocks=pool.num_gpu_blocks - 1)

    def allocated():
        stats.peak_blocks_allocated = max(stats.peak_blocks_allocated,
                                          pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())

    preempted_before = preemptions(llm)
    with introspect.after_each_allocation(pool, allocated):
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt},
                               params[i] if isinstance(params, list) else params)
        first_seen = set()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for out in outputs:
                if out.request_id not in first_seen and any(c.token_ids for c in out.outputs):
                    first_seen.add(out.request_id)
                    stats.ttft_s.append(time.perf_counter() - start)
            stats.num_steps += 1
            stats.running.append(len(scheduler.running))
            stats.blocks_used.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
            for kind, held in introspect.held_blocks_by_kind(scheduler).items():
                stats.held_by_kind.setdefault(kind, []).append(held)
            for out in outputs:
                if out.finished:
                    stats.prompt_tokens += len(out.prompt_token_ids)
                    stats.output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if progress is not None:
                        progress.update(1)
        stats.elapsed_s = time.perf_counter() - start
        stats.num_preemptions = preemptions(llm) - preempted_before
    return stats
