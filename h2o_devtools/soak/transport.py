"""The soak clients' HTTP side (client process): the httpx pool, the httpcore trace of each
request's connection and transport phase, and the failure class of what a request raised.

Nothing is retried. A failed request is recorded with a ``failure_class`` and what the HTTP
client saw (new or reused keep-alive connection, the last transport phase, the exception
chain), so a rare failure can be told apart from a server fault.
"""
from __future__ import annotations

import contextvars
import time

from h2o_devtools.soak.outcome import Outcome

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
