"""Soak load for a running OpenAI-compatible server: many concurrent streaming clients, mixed
prompt/output lengths and per-request H2O budgets, random client disconnects mid-stream.

Shared by ``tests/server/test_soak.py`` (small, bounded) and ``benchmarks/soak.py`` (long). The
pieces: ``plan`` (a seeded list of requests), ``run`` (drives them through
``openai.AsyncOpenAI``, at most ``concurrency`` at a time, stops launching at a deadline),
``summarize``, ``scrape`` (``/metrics`` as ``{name: value}``, labels summed away),
``wait_idle`` (polls until the engine holds no KV block and runs nothing) and ``group_rss``
(resident memory summed over a process group, from ``/proc``).

Two sides run the same load: ``h2o`` (per-request budgets in ``vllm_xargs``) and ``stock``
(``SoakConfig.h2o=False``: the same prompts, lengths, actions and seeds, no ``h2o_*`` key; its
invalid requests carry a value stock vLLM refuses instead).

Nothing is retried. A failed request is recorded with a ``failure_class`` and what the HTTP
client saw (``trace_connections``: new or reused keep-alive connection, the last transport
phase, the exception chain), so a rare failure can be told apart from a server fault.

Prompts are token ids (``prompt=[...]``), so lengths are exact and any vocabulary of at least
``TOKEN_IDS.stop`` ids works (the tiny test Llama has 512). Every request sets ``ignore_eos``:
one that is not disconnected must stream exactly ``max_tokens`` tokens and finish with
``"length"``.
"""
from __future__ import annotations

import asyncio
import contextvars
import os
import random
import statistics
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
#: The stock side's invalid request: a value stock vLLM refuses with HTTP 400 before any stream
#: (``SamplingParams``: temperature must be non-negative), in place of the bad budget.
STOCK_BAD = {"temperature": -1.0}

#: ``VLLM_PLUGINS`` of the stock side's server: any installed plugin but ours, so no process
#: of that server loads h2o-vllm (as tests/engine/engines.py does for stock engines).
STOCK_PLUGINS = "lora_filesystem_resolver"

#: The clients' keep-alive: None, no connection is kept for reuse (each request opens its own;
#: the default), or seconds of httpx ``keepalive_expiry``. Reusing idle connections made two
#: client-side races that kill a request with ``APIConnectionError: Connection error.``:
#: - the server (vLLM's uvicorn, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s) closes a connection the
#:   client still takes for alive (httpx's expiry is 5 s too; the server's clock starts when it
#:   wrote the last byte, the client's when a busy client has read it): ``stale-keepalive``;
#: - httpcore 1.0.9's pool closes an idle connection it has already handed to a request that has
#:   not started on it yet, and then closes it under that request (encode/httpcore#1110, open):
#:   ``pool-closed``. The shorter the expiry, the more often.
#: Neither can happen without pooled idle connections. See benchmarks/keepalive_race.py.
KEEPALIVE_EXPIRY_S: float | None = None

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
    extra: dict | None = None   # further request fields (the stock side's invalid value)


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
    first_token_s: float | None = None  # time to the first streamed token
    failure_class: str = ""  # see classify()
    connection: str = ""    # "new" or "reused" keep-alive connection (httpcore trace); "" unknown
    idle_s: float | None = None  # reused and answered: how long its connection sat idle before
    phase: str = ""         # last transport event the request reached (httpcore trace)
    cause: str = ""         # the exception chain, outermost first


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
    h2o: bool = True                # False: the stock side, no h2o_* key in any request


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
        extra = None
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
        if not cfg.h2o:     # after every draw: both sides get the same sequence of requests
            xargs, extra = None, (STOCK_BAD if action == BAD else None)
        yield Job(i, [rng.choice(TOKEN_IDS) for _ in range(prompt_len)], max_tokens, xargs, action,
                  after=rng.randint(1, 8), delay_s=rng.uniform(0.0, 2.0), extra=extra)


#: The Outcome of the request the current task is sending (read by the trace hooks).
_current: contextvars.ContextVar[Outcome | None] = contextvars.ContextVar("soak_outcome", default=None)


#: Connections back in the pool after a response read to its end: id -> (stream, when). At most
#: one entry per pooled connection (taken out again when the connection is reused).
_released: dict[int, tuple[object, float]] = {}


async def trace_connections(request) -> None:
    """httpx request hook (async: httpx awaits them): records on the current Outcome whether
    httpcore opened a new connection for the request or reused a kept-alive one, and the last
    transport phase."""
    out = _current.get()
    if out is None:
        return

    async def trace(event: str, info: dict) -> None:
        if event.startswith("connection.connect_tcp."):
            out.connection = "new"
        elif event.startswith("http11.send_request_headers.started") and not out.connection:
            out.connection = "reused"
            out._sent_at = time.monotonic()
        # The furthest step reached: not the body reads (one per chunk) nor response_closed,
        # which httpcore also runs to clean up after a failed send.
        if not event.startswith(("http11.receive_response_body", "http11.response_closed")):
            out.phase = event
    request.extensions["trace"] = trace


async def note_connection(response) -> None:
    """httpx response hook: for a reused connection, how long it sat idle in the pool (client
    clock; the server's clock started earlier, when it wrote the last byte)."""
    out = _current.get()
    stream = response.extensions.get("network_stream")
    if out is None or stream is None:
        return
    out._stream = stream
    previous = _released.pop(id(stream), None)
    if out.connection == "reused" and previous is not None and previous[0] is stream:
        out.idle_s = round(out._sent_at - previous[1], 3)


def _release(out: Outcome) -> None:
    stream = getattr(out, "_stream", None)
    if stream is not None:
        _released[id(stream)] = (stream, time.monotonic())


def http_client(concurrency: int, timeout_s: float, keepalive_expiry_s: float | None = KEEPALIVE_EXPIRY_S):
    """The soak's httpx client; ``keepalive_expiry_s`` None: nothing pooled for reuse."""
    import httpx
    keep = 0 if keepalive_expiry_s is None else concurrency + 4
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=keep,
                          keepalive_expiry=keepalive_expiry_s)
    return httpx.AsyncClient(limits=limits, timeout=timeout_s,
                             event_hooks={"request": [trace_connections], "response": [note_connection]})


def _chain(exc: BaseException) -> list[BaseException]:
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def classify(exc: BaseException, out: Outcome) -> str:
    """The failure class of an exception a request raised (nothing is retried):

    - ``stale-keepalive``: a reused keep-alive connection closed by the server before it sent
      any response (the request never reached the server's handler: no log line, no tokens);
    - ``pool-closed``: a reused connection closed by the client's own pool under the request
      (anyio ``ClosedResourceError``: our side closed the socket; encode/httpcore#1110);
    - ``connection``: any other transport error before the response (connect refused, reset);
    - ``stream-broken``: the connection broke after the response had started;
    - ``timeout``; ``http-<status>``: an error status; ``in-stream-error``: an error event
      inside an HTTP 200 stream; ``other``.
    """
    import openai
    out.cause = " <- ".join(f"{type(e).__name__}: {e}" for e in _chain(exc))[:600]
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        before_response = out.phase != "http11.receive_response_headers.complete"
        disconnected = any("Server disconnected without sending a response" in str(e)
                           or isinstance(e, (ConnectionResetError, BrokenPipeError)) for e in _chain(exc))
        if out.connection == "reused" and before_response and disconnected:
            return "stale-keepalive"
        if any(type(e).__name__ == "ClosedResourceError" for e in _chain(exc)):
            return "pool-closed"
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http-{exc.status_code}"
    if isinstance(exc, openai.APIError):
        return "in-stream-error"
    if any(type(e).__module__.startswith(("httpx", "httpcore")) for e in _chain(exc)):
        return "stream-broken"
    return "other"


async def _stream(client, model: str, job: Job, out: Outcome) -> None:
    _current.set(out)
    started = time.monotonic()
    extra_body = {"ignore_eos": True, "return_token_ids": True}
    if job.xargs is not None:
        extra_body["vllm_xargs"] = job.xargs
    request = dict(model=model, prompt=job.prompt, max_tokens=job.max_tokens, temperature=0.8,
                   seed=job.index, stream=True, stream_options={"include_usage": True},
                   extra_body=extra_body)
    request.update(job.extra or {})
    stream = await client.completions.create(**request)
    finish = usage = None
    chunks = 0
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                out.tokens += len(getattr(choice, "token_ids", None) or [])
                if out.tokens and out.first_token_s is None:
                    out.first_token_s = time.monotonic() - started
                finish = choice.finish_reason or finish
                chunks += 1
            if job.action == CLOSE and chunks >= job.after and finish is None:
                out.status = "aborted"          # the client goes away mid-stream
                return
    finally:
        await stream.close()
        if finish is not None:      # read to its end: the connection went back to the pool
            _release(out)
    if finish != "length" or out.tokens != job.max_tokens or usage != job.max_tokens:
        out.status, out.failure_class = "failed", "wrong-output"
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
            out.status, out.failure_class = "failed", "bad-accepted"
            out.error = "an invalid request was accepted"
    except openai.BadRequestError as e:
        # Raised by create(): the HTTP status of the response itself, before any stream.
        if job.action == BAD:
            out.status = "rejected"
        else:
            out.status, out.failure_class, out.error = "failed", "http-400", f"400: {e}"
    except Exception as e:  # noqa: BLE001 - every other error is a failure, recorded and classified
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
        out.failure_class = classify(e, out)
    out.seconds = time.monotonic() - started
    return out


async def run(base_url: str, model: str, jobs: Iterable[Job], concurrency: int, duration_s: float,
              request_timeout_s: float = 300.0, progress=None,
              keepalive_expiry_s: float | None = KEEPALIVE_EXPIRY_S) -> list[Outcome]:
    """Run ``jobs`` with at most ``concurrency`` in flight; jobs not started within
    ``duration_s`` are not run (in-flight ones finish). Returns one Outcome per started job."""
    import openai

    # max_retries=0: a failure is counted and classified, never retried.
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                                timeout=request_timeout_s,
                                http_client=http_client(concurrency, request_timeout_s, keepalive_expiry_s))
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


def _percentiles(values: list[float]) -> dict:
    if len(values) < 2:
        return {"n": len(values)}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"n": len(values), "p50": round(q[49], 3), "p95": round(q[94], 3), "p99": round(q[98], 3),
            "max": round(max(values), 3)}


def summarize(outcomes: list[Outcome]) -> dict:
    statuses = Counter(o.status for o in outcomes)
    ok = [o for o in outcomes if o.status == "ok"]
    return {
        "requests": len(outcomes),
        "ok": statuses["ok"], "aborted": statuses["aborted"], "rejected": statuses["rejected"],
        "failed": statuses["failed"],
        "failure_rate": round(statuses["failed"] / len(outcomes), 6) if outcomes else None,
        "failure_classes": dict(Counter(o.failure_class for o in outcomes if o.status == "failed")),
        "by_action": dict(Counter(o.action for o in outcomes)),
        "connections": dict(Counter(o.connection or "unknown" for o in outcomes)),
        # Idle time of the reused connections that answered (the keep-alive race needs it near
        # the server's timeout; the client's expiry bounds it).
        "reused_idle_s": _percentiles([o.idle_s for o in outcomes if o.idle_s is not None]),
        "tokens_streamed": sum(o.tokens for o in outcomes),
        "tokens_ok": sum(o.tokens for o in outcomes if o.status == "ok"),
        "prompt_tokens": sum(o.prompt_len for o in outcomes),
        # Completed requests only; the engine queues requests the pool cannot hold yet.
        "latency_s": _percentiles([o.seconds for o in ok]),
        "first_token_s": _percentiles([o.first_token_s for o in ok if o.first_token_s is not None]),
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


#: Gauges that are 0 when the engine holds nothing (stock vLLM: the ``vllm:`` ones).
IDLE_GAUGES = ("vllm:kv_cache_usage_perc", "h2o_vllm:live_kv_tokens", "vllm:num_requests_running",
               "vllm:num_requests_waiting")
STOCK_IDLE_GAUGES = tuple(name for name in IDLE_GAUGES if name.startswith("vllm:"))


def wait_idle(base_url: str, timeout_s: float = 10.0, gauges=IDLE_GAUGES) -> dict[str, float]:
    """Poll ``/metrics`` until every one of ``gauges`` is 0 (or the timeout); returns the last
    scrape. vLLM updates its gauges at each engine step, H2O's writers flush every 0.2 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(base_url)
        if all(values.get(name) == 0 for name in gauges) or time.monotonic() > deadline:
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
