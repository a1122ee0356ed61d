"""H2O Prometheus metrics, correct across vLLM's processes.

The numbers are born in three processes: the worker compacts (tokens evicted, compactions,
attention mass dropped), the engine core frees blocks and tracks running requests, and
process 0 (API server or ``LLM``) serves ``/metrics``. Each writer process keeps its totals
in memory and a background thread writes them, at most every ``FLUSH_S`` seconds and only
when they changed, to ``<dir>/<pid>.json`` (atomic rename). Process 0 creates the directory
at plugin load (before vLLM spawns anything; spawned children inherit its path through
``H2O_VLLM_METRICS_DIR``) and registers a collector that sums the files at each scrape.
No message is added to vLLM's own engine-core/worker channels.
"""
from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import weakref
from typing import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

DIR_ENV = "H2O_VLLM_METRICS_DIR"
FLUSH_S = 0.2
PREFIX = "h2o_vllm:"

#: name -> (kind, help). Counters are totals since process 0 started.
METRICS = {
    "evicted_tokens": ("counter", "Tokens evicted from the KV cache by H2O, per (layer, KV head) "
                                  "(every head evicts the same count), summed over requests."),
    "freed_blocks": ("counter", "KV-cache blocks returned to the pool by H2O eviction."),
    "compactions": ("counter", "H2O compactions: one per request each time its cache shrinks."),
    "evicted_attention_mass": ("counter", "Accumulated attention score carried by evicted tokens, "
                                          "summed over layers and KV heads."),
    "attention_mass": ("counter", "Accumulated attention score of the compacted rows before "
                                  "compaction, summed over layers and KV heads."),
    "live_kv_tokens": ("gauge", "KV tokens held per (layer, KV head) by running requests."),
    "score_record_tokens": ("gauge", "Prefix-cache score records held, in tokens: each is one fp32 "
                                     "per (layer, KV head) (0 with prefix caching off)."),
    "kv_transfer_saved_bytes": ("counter", "Bytes of kept K/V and scores a KV-transfer producer "
                                           "wrote (files or NIXL staging), summed over ranks."),
    "kv_transfer_loaded_prompts": ("counter", "Prompts a KV-transfer consumer loaded from a producer's "
                                              "state instead of computing them."),
    "kv_transfer_recomputed_prompts": ("counter", "Prompts a KV-transfer consumer computed itself "
                                                  "because the producer's state could not be loaded."),
    "kv_transfer_staging_bytes": ("gauge", "NIXL staging bytes a producer holds for decoders "
                                           "that have not read them yet."),
}


class Recorder:
    """This process's totals; a daemon thread writes them when they change."""

    def __init__(self, directory: str | None) -> None:
        self.values: dict[str, float] = {}
        self.path = os.path.join(directory, f"{os.getpid()}.json") if directory else None
        self._dirty = threading.Event()
        self._lock = threading.Lock()
        # The flush thread and the exit handler share one temp file: one writer at a time,
        # each writing the snapshot it took, so the file is never torn or older than a flush.
        self._write_lock = threading.Lock()
        if self.path is not None:
            threading.Thread(target=self._flush_loop, name="h2o-metrics", daemon=True).start()
            atexit.register(self.flush)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.values[name] = self.values.get(name, 0) + delta
        self._dirty.set()

    def set(self, **values: float) -> None:
        with self._lock:
            changed = any(self.values.get(name) != value for name, value in values.items())
            self.values.update(values)
        if changed:
            self._dirty.set()

    def flush(self) -> None:
        if self.path is None:
            return
        with self._write_lock:
            with self._lock:
                text = json.dumps(self.values)
            try:
                tmp = f"{self.path}.tmp"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except OSError:  # directory gone: process 0 has exited
                pass

    def _flush_loop(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            self.flush()
            threading.Event().wait(FLUSH_S)


_recorder: Recorder | None = None


def recorder() -> Recorder:
    """This process's recorder (writes nowhere when no process 0 set up the directory)."""
    global _recorder
    if _recorder is None:
        _recorder = Recorder(os.environ.get(DIR_ENV))
    return _recorder


def read_totals(directory: str | None = None) -> dict[str, float]:
    """Every writer's totals summed (what ``/metrics`` shows)."""
    directory = directory or os.environ.get(DIR_ENV)
    totals = {name: 0.0 for name in METRICS}
    if not directory or not os.path.isdir(directory):
        return totals
    for entry in os.scandir(directory):
        if not entry.name.endswith(".json"):
            continue
        try:
            with open(entry.path) as f:
                values = json.load(f)
        except (OSError, ValueError):
            continue
        for name, value in values.items():
            if name in totals:
                totals[name] += value
    return totals


def evicted_share(totals: dict[str, float]) -> float:
    return totals["evicted_attention_mass"] / totals["attention_mass"] if totals["attention_mass"] else 0.0


def summary_line(totals: dict[str, float]) -> str:
    return (f"H2O: evicted {int(totals['evicted_tokens'])} tokens in {int(totals['compactions'])} "
            f"compactions, freed {int(totals['freed_blocks'])} KV blocks, live KV tokens "
            f"{int(totals['live_kv_tokens'])}, evicted attention share {100 * evicted_share(totals):.2f}%")


def summary_if_changed(state: dict) -> str | None:
    """The periodic log line, or None when nothing changed since the last one.

    Like vLLM's own stats line: at INFO while something changes, silent when idle. ``state``
    is the caller's per-logger dict; the last totals are kept in it."""
    totals = read_totals()
    if totals == state.get("_h2o_last_totals"):
        return None
    state["_h2o_last_totals"] = totals
    return summary_line(totals)


class H2OCollector:
    """Prometheus collector summing the writers' files at scrape time (process 0)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterator:
        totals = read_totals(self.directory)
        for name, (kind, doc) in METRICS.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + name, doc, value=totals[name])
        yield GaugeMetricFamily(PREFIX + "evicted_attention_share",
                                "evicted_attention_mass / attention_mass: the share of accumulated "
                                "attention score that eviction dropped.", value=evicted_share(totals))


def in_ray_actor() -> bool:
    ray = sys.modules.get("ray")  # never imported here: a Ray worker has imported it already
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


_collector: H2OCollector | None = None
_registries: weakref.WeakSet = weakref.WeakSet()  # the served registries holding one


def register_collector(registry) -> None:
    """H2O's collector in ``registry``, once. With one API server /metrics serves the global
    registry, where ``setup_process0`` put it; with ``--api-server-count`` > 1 each API server
    serves Prometheus multiprocess registries of its own (the hook on ``MultiProcessCollector``
    calls this for each), and the collector there reads the same writers' files (their
    directory is inherited from process 0), so every server shows the same totals."""
    directory = os.environ.get(DIR_ENV)
    if registry is REGISTRY or registry in _registries or not directory:
        return
    _registries.add(registry)
    registry.register(H2OCollector(directory))


def setup_process0() -> None:
    """In process 0 only: a fresh directory for this engine's writers and the collector.

    A spawned child (``multiprocessing.parent_process()`` set) keeps the inherited path, and
    so does a Ray actor that was handed one (a worker of vLLM's Ray executor, given process 0's
    environment before it loads the plugins); a Ray actor without one is process 0 itself (an
    engine inside Ray Serve); any other top-level process replaces a path inherited from an
    unrelated parent's environment.
    """
    global _collector
    if _collector is not None or multiprocessing.parent_process() is not None or (
            in_ray_actor() and os.environ.get(DIR_ENV)):
        return
    directory = tempfile.mkdtemp(prefix="h2o-vllm-metrics-")
    os.environ[DIR_ENV] = directory
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(directory, ignore_errors=True))
    _collector = H2OCollector(directory)
    REGISTRY.register(_collector)
