"""A real Prometheus scrapes `h2o-vllm serve` (tiny Llama, H2O on) under load: what it stores
equals what /metrics says, and every PromQL expression of the shipped Grafana dashboard
(dashboards/h2o-vllm.json) returns data, H2O's rates above zero."""
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import Server, serving, wait_for

from h2o_devtools.prometheus import LocalPrometheus, dashboard_queries

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no prometheus binary: apt-get install prometheus (make venv does)")

FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8",
         "--h2o-interval", "4", "--block-size", "16"]
PROMPT = ("Free software is a matter of liberty, not price; to understand the concept you should "
          "think of free as in free speech, not as in free beer")
LOAD_S = 12


@pytest.fixture(scope="module")
def scraped(tiny_llama_dir, tmp_path_factory):
    with serving(Server(tiny_llama_dir, FLAGS)) as server, \
            LocalPrometheus(tmp_path_factory.mktemp("prometheus"), server.url.removeprefix("http://")) as prom:
        def complete(_):
            return server.client().completions.create(
                model=server.model, prompt=PROMPT, max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + LOAD_S
        with ThreadPoolExecutor(4) as pool:
            while time.monotonic() < deadline:
                list(pool.map(complete, range(4)))
        yield server, prom


def _value(result) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_prometheus_stores_what_metrics_reports(scraped):
    server, prom = scraped
    assert _value(prom.query(f'up{{job="h2o-vllm"}}')) == 1
    totals = server.settled_metrics()
    assert totals["evicted_tokens_total"] > 0
    for name in ("evicted_tokens_total", "freed_blocks_total", "compactions_total"):
        assert wait_for(lambda: _value(prom.query(f"h2o_vllm:{name}")) == totals[name], 10), name


@pytest.mark.parametrize(("title", "legend", "expr"), dashboard_queries(), ids=[q[1] for q in dashboard_queries()])
def test_every_dashboard_query_returns_data(scraped, title, legend, expr):
    _, prom = scraped
    result = prom.query(expr)
    assert result, f"{title} / {legend}: {expr} returned nothing"
    if "rate(h2o_vllm:" in expr:
        assert _value(result) > 0, (expr, result)
