"""Soak load for a running OpenAI-compatible server (client process: the test or benchmark that
drives the server): many concurrent streaming clients, mixed prompt/output lengths and
per-request H2O budgets, random client disconnects mid-stream.

Shared by ``tests/server/test_soak.py`` (small, bounded) and ``benchmarks/soak.py`` (long). The
modules: ``jobs`` (``SoakConfig``, ``plan``: a seeded list of ``Job``), ``client`` (``run``:
drives them), ``transport`` (the httpx pool, its connection trace, ``classify``), ``outcome``
(``Outcome``, ``summarize``) and ``readings`` (``scrape``, ``wait_idle``, ``group_rss``: the
server seen from outside). Every name is re-exported here, so callers use ``soak.X``.

Two sides run the same load: ``h2o`` (per-request budgets in ``vllm_xargs``) and ``stock``
(``SoakConfig.h2o=False``: the same prompts, lengths, actions and seeds, no ``h2o_*`` key; its
invalid requests carry a value stock vLLM refuses instead).
"""
from h2o_devtools.soak.jobs import (BAD, BAD_BUDGET, BUDGETS, CANCEL, CLOSE, FULL, STOCK_BAD,
                                      STOCK_PLUGINS, TOKEN_IDS, Job, SoakConfig, plan)
from h2o_devtools.soak.outcome import Outcome, summarize
from h2o_devtools.soak.transport import (KEEPALIVE_EXPIRY_S, classify, http_client,
                                           note_connection, trace_connections)
from h2o_devtools.soak.client import run, run_job
from h2o_devtools.soak.readings import IDLE_GAUGES, STOCK_IDLE_GAUGES, group_rss, scrape, wait_idle

__all__ = [
    "BAD", "BAD_BUDGET", "BUDGETS", "CANCEL", "CLOSE", "FULL", "IDLE_GAUGES", "Job",
    "KEEPALIVE_EXPIRY_S", "Outcome", "STOCK_BAD", "STOCK_IDLE_GAUGES", "STOCK_PLUGINS",
    "SoakConfig", "TOKEN_IDS", "classify", "group_rss", "http_client", "note_connection", "plan",
    "run", "run_job", "scrape", "summarize", "trace_connections", "wait_idle",
]
