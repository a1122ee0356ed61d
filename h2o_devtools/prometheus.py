"""A local Prometheus (the ``prometheus`` binary: Debian's package, ``make venv`` installs it)
scraping one server, and the PromQL of the shipped Grafana dashboard
(``dashboards/h2o-vllm.json``): for the dashboard test and its rendered snapshot."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import requests

from h2o_devtools.server import free_port

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "h2o-vllm.json"
JOB = "h2o-vllm"


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every target of every panel."""
    panels = json.loads(Path(path).read_text())["panels"]
    return [(p["title"], t["legendFormat"], t["expr"]) for p in panels for t in p["targets"]]


class LocalPrometheus:
    """``with LocalPrometheus(workdir, "127.0.0.1:8000") as prom:``: scrapes the target's
    /metrics every ``interval_s``; ``query`` / ``query_range`` call its HTTP API."""

    def __init__(self, workdir: Path, target: str, interval_s: int = 1,
                 binary: str | None = None) -> None:
        self.binary = binary or shutil.which("prometheus")
        if self.binary is None:
            raise FileNotFoundError("no prometheus binary: apt-get install prometheus (make venv does)")
        self.workdir, self.target, self.interval_s = Path(workdir), target, int(interval_s)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LocalPrometheus":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {self.interval_s}s\n  evaluation_interval: {self.interval_s}s\n"
            f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{self.target}']\n")
        self.log = open(self.workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def _api(self, path: str, **params) -> list[dict]:
        body = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        if body["status"] != "success":
            raise ValueError(f"{params.get('query')}: {body.get('error')}")
        return body["data"]["result"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        return self._api("query", query=expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Each series: ``{"metric": {...}, "values": [[t, "v"], ...]}``."""
        return self._api("query_range", query=expr, start=start, end=end, step=step)
