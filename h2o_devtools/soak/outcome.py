"""What each soak request came to, and the summary over a run (client process): ``Outcome``,
``summarize``."""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass


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
    failure_class: str = ""  # see transport.classify()
    connection: str = ""    # "new" or "reused" keep-alive connection (httpcore trace); "" unknown
    idle_s: float | None = None  # reused and answered: how long its connection sat idle before
    phase: str = ""         # last transport event the request reached (httpcore trace)
    cause: str = ""         # the exception chain, outermost first


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
