"""The soak's streaming clients (client process): ``run`` drives jobs through
``openai.AsyncOpenAI``, at most ``concurrency`` at a time, and stops launching at a deadline.

Every request sets ``ignore_eos``: one that is not disconnected must stream exactly
``max_tokens`` tokens and finish with ``"length"``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Iterable

from h2o_devtools.soak.outcome import Outcome
from h2o_devtools.soak.jobs import BAD, CANCEL, CLOSE, Job
from h2o_devtools.soak.transport import KEEPALIVE_EXPIRY_S, _current, _release, classify, http_client


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
