"""Soak load for a running OpenAI-compatible server: many concurrent streaming clients, mixed
prompt/output lengths and per-request H2O budgets, random client disconnects mid-stream.

Shared by ``tests/server/test_soak.py`` (small, bounded) and ``benchmarks/soak.py`` (long). The
pieces: ``plan`` (a seeded list of requests), ``run`` (drives them through
``openai.AsyncOpenAI``, at most ``concurrency`` at a time, stops launching at a deadline),
``summarize``, ``scrape`` (``/metrics`` as ``{name: value}``, labels summed away),
``wait_idle`` (polls until the engine holds no KV block and runs nothing) and ``group_rss``
(resident memory summed over a process group, from ``/proc``).

Prompts are token ids (``prompt=[...]``), so lengths are exact and any vocabulary of at least
``TOKEN_IDS.stop`` ids works (the tiny test Llama has 512). Every request sets ``ignore_eos``:
one that is not disconnected must stream exactly ``max_tokens`` tokens and finish with
``"length"``.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import requests

TOKEN_IDS = range(10, 500)

#: Per-request budgets (``vllm_xargs``); None: the server's budget. Mixed ways and intervals.
BUDGETS: list[dict | None] = [
    None,
    {"h2o_heavy_tokens": 8, "h2o_recent_tokens": 8},
    {"h2o_heavy_tokens": 4, "h2o_recent_tokens": 12, "h2o_interval": 1},
    {"h2o_heavy_ratio": 0.05, "h2o_recent_ratio": 0.05},
    {"h2o_heavy_ratio": 0.3, "h2o_recent_ratio": 0.2, "h2o_interval": 16},
    {"h2o_heavy_tokens": 32, "h2o_recent_ratio": 0.1, "h2o_interval": 7},
    {"h2o_heavy_ratio": 0.0, "h2o_recent_tokens": 24},
    {"h2o_heavy_tokens": 1024, "h2o_recent_tokens": 1024},    # above every length: never evicts
]
#: A per-request value the server must refuse with HTTP 400 (interval must be >= 1).
BAD_BUDGET = {"h2o_interval": 0}

#: What a client does with its request.
FULL, CLOSE, CANCEL, BAD = "full", "close", "cancel", "bad"


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    xargs: dict | None
    action: str             # FULL: read to the end; CLOSE: close the stream after `after` chunks;
    after: int = 0          # CANCEL: cancel the task `delay_s` after sending; BAD: expect a 400
    delay_s: float = 0.0


@dataclass
class Outcome:
    index: int
    action: str
    status: str             # ok | aborted | rejected | failed
    prompt_len: int
    max_tokens: int
    tokens: int = 0         # token ids streamed back
    error: str = ""
    seconds: float = 0.0


@dataclass
class SoakConfig:
    requests: int = 80
    concurrency: int = 16
    duration_s: float = 90.0        # stop launching new requests after this
    max_model_len: int = 512
    prompt_len: tuple[int, int] = (1, 320)
    max_tokens: tuple[int, int] = (1, 192)
    close_share: float = 0.15       # disconnect after a few chunks
    cancel_share: float = 0.1       # cancel the task after a random delay (maybe before any chunk)
    bad_share: float = 0.04         # invalid per-request budget: must be a 400
    request_timeout_s: float = 300.0
    seed: int = 0
    budgets: list = field(default_factory=lambda: list(BUDGETS))


def plan(cfg: SoakConfig) -> Iterator[Job]:
    """Seeded, mixed requests, made as they are taken; prompt + max_tokens always fits
    ``max_model_len``."""
    rng = random.Random(cfg.seed)
    for i in range(cfg.requests):
        # Lengths: mostly uniform, some at block boundaries (16/32 multiples) and the extremes.
        r = rng.random()
        if r < 0.15:
            prompt_len = rng.choice([1, 15, 16, 17, 31, 32, 33, 64, 128, 256])
        else:
            prompt_len = rng.randint(*cfg.prompt_len)
        prompt_len = min(prompt_len, cfg.max_model_len - 1)
        max_tokens = rng.choice([1, 2]) if rng.random() < 0.05 else rng.randint(*cfg.max_tokens)
        max_tokens = max(1, min(max_tokens, cfg.max_model_len - prompt_len))
        r = rng.random()
        if r < cfg.bad_share:
            action, xargs = BAD, BAD_BUDGET
        else:
            xargs = rng.choice(cfg.budgets)
            if r < cfg.bad_share + cfg.close_share:
                action = CLOSE
            elif r < cfg.bad_share + cfg.close_share + cfg.cancel_share:
                action = CANCEL
            else:
                action = FULL
        yield Job(i, [rng.choice(TOKEN_IDS) for _ in range(prompt_len)], max_tokens, xargs, action,
                  after=rng.randint(1, 8), delay_s=rng.uniform(0.0, 2.0))


async def _stream(client, model: str, job: Job, out: Outcome) -> None:
    extra_body = {"ignore_eos": True, "return_token_ids": True}
    if job.xargs is not None:
        extra_body["vllm_xargs"] = job.xargs
    stream = await client.completions.create(
        model=model, prompt=job.prompt, max_tokens=job.max_tokens, temperature=0.8, seed=job.index,
        stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
    finish = usage = None
    chunks = 0
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                out.tokens += len(getattr(choice, "token_ids", None) or [])
                finish = choice.finish_reason or finish
                chunks += 1
            if job.action == CLOSE and chunks >= job.after and finish is None:
                out.status = "aborted"          # the client goes away mid-stream
                return
    finally:
        await stream.close()
    if finish != "length" or out.tokens != job.max_tokens or usage != job.max_tokens:
        out.status = "failed"
        out.error = (f"finish_reason={finish} tokens={out.tokens} usage={usage}, "
                     f"expected length/{job.max_tokens}")
    else:
        out.status = "ok"


async def run_job(client, model: str, job: Job) -> Outcome:
    import openai

    out = Outcome(job.index, job.action, "failed", len(job.prompt), job.max_tokens)
    started = time.monotonic()
    task = asyncio.ensure_future(_stream(client, model, job, out))
    try:
        if job.action == CANCEL:
            done, _ = await asyncio.wait({task}, timeout=job.delay_s)
            if not done:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    # Ours: a cancel landing while httpx connects can surface as
                    # APIConnectionError instead of CancelledError.
                    pass
                out.status = "aborted"
            else:
                task.result()
        else:
            await task
        if job.action == BAD:
            out.status, out.error = "failed", "an invalid budget was accepted"
    except openai.BadRequestError as e:
        if job.action == BAD:
            out.status = "rejected"
        else:
            out.status, out.error = "failed", f"400: {e}"
    except openai.APIError as e:
        # A streaming request's invalid value is found once the stream has begun (in the engine
        # client's input processing): vLLM sends it as an SSE error event, code 400, HTTP 200.
        body = e.body if isinstance(e.body, dict) else {}
        if job.action == BAD and "h2o_interval" in str(e) and body.get("code") == 400:
            out.status, out.error = "rejected", "400 as an SSE error event (HTTP 200)"
        else:
            out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - every other error is a failure, recorded
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - started
    return out


async def run(base_url: str, model: str, jobs: Iterable[Job], concurrency: int, duration_s: float,
              request_timeout_s: float = 300.0, progress=None) -> list[Outcome]:
    """Run ``jobs`` with at most ``concurrency`` in flight; jobs not started within
    ``duration_s`` are not run (in-flight ones finish). Returns one Outcome per started job."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                                timeout=request_timeout_s,
                                http_client=httpx.AsyncClient(limits=limits, timeout=request_timeout_s))
    deadline = time.monotonic() + duration_s
    pending = iter(jobs)
    outcomes: list[Outcome] = []

    async def worker():
        while time.monotonic() < deadline and (job := next(pending, None)) is not None:
            outcome = await run_job(client, model, job)
            outcomes.append(outcome)
            if progress:
                progress(outcome)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return sorted(outcomes, key=lambda o: o.index)


def summarize(outcomes: list[Outcome]) -> dict:
    statuses = Counter(o.status for o in outcomes)
    return {
        "requests": len(outcomes),
        "ok": statuses["ok"], "aborted": statuses["aborted"], "rejected": statuses["rejected"],
        "failed": statuses["failed"],
        "rejected_in_stream": sum(o.status == "rejected" and "SSE" in o.error for o in outcomes),
        "by_action": dict(Counter(o.action for o in outcomes)),
        "tokens_streamed": sum(o.tokens for o in outcomes),
        "tokens_ok": sum(o.tokens for o in outcomes if o.status == "ok"),
        "prompt_tokens": sum(o.prompt_len for o in outcomes),
        "failures": [asdict(o) for o in outcomes if o.status == "failed"][:20],
    }


def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value}, summed over label sets (one engine here); samples
    with a ``finished_reason`` label also under ``name{finished_reason="..."}``."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            keys = [sample.name]
            if "finished_reason" in sample.labels:
                keys.append(f'{sample.name}{{finished_reason="{sample.labels["finished_reason"]}"}}')
            for key in keys:
                values[key] = values.get(key, 0.0) + sample.value
    return values


#: Gauges that are 0 when the engine holds nothing.
IDLE_GAUGES = ("vllm:kv_cache_usage_perc", "h2o_vllm:live_kv_tokens", "vllm:num_requests_running",
               "vllm:num_requests_waiting")


def wait_idle(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Poll ``/metrics`` until every IDLE_GAUGES entry is 0 (or the timeout); returns the last
    scrape. vLLM updates its gauges at each engine step, H2O's writers flush every 0.2 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(base_url)
        if all(values.get(name) == 0 for name in IDLE_GAUGES) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def group_rss(pgid: int) -> int:
    """Resident bytes summed over the processes of process group ``pgid`` (Linux /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # Fields after the parenthesised command: state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue  # the process ended meanwhile
    return total
