"""metrics: each writer's totals in an atomically replaced file, summed by process 0 at scrape
time, the periodic log line, and the Prometheus collector. Files in pytest's tmp dirs; the
collector is read through a fresh prometheus_client registry (no mocks)."""
import json
import os
import time

import pytest
from prometheus_client import CollectorRegistry

from h2o_vllm import metrics

TOTALS = {"evicted_tokens": 12, "freed_blocks": 2, "compactions": 3, "evicted_attention_mass": 1.5,
          "attention_mass": 6.0, "live_kv_tokens": 40, "score_record_tokens": 32}


def _settle():
    """Let the recorder's own thread finish its writes first: two flushes at once share one
    temporary file (``<pid>.json.tmp``) and can tear it."""
    time.sleep(3 * metrics.FLUSH_S)


def _write(directory, name, values):
    (directory / name).write_text(json.dumps(values) if not isinstance(values, str) else values)


def test_metrics_recorder_adds_sets_and_flushes_atomically(tmp_path):
    recorder = metrics.Recorder(str(tmp_path))
    assert recorder.path == str(tmp_path / f"{os.getpid()}.json")
    recorder.add(evicted_tokens=5, compactions=1)
    recorder.add(evicted_tokens=7)
    recorder.set(live_kv_tokens=30)
    recorder.set(live_kv_tokens=20)  # a gauge: replaced, not summed
    _settle()
    recorder.flush()
    assert json.loads((tmp_path / f"{os.getpid()}.json").read_text()) == {
        "evicted_tokens": 12, "compactions": 1, "live_kv_tokens": 20}
    assert os.listdir(tmp_path) == [f"{os.getpid()}.json"]  # the temporary file was renamed


def test_metrics_recorder_thread_writes_changes(tmp_path):
    recorder = metrics.Recorder(str(tmp_path))
    recorder.add(freed_blocks=3)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if metrics.read_totals(str(tmp_path))["freed_blocks"] == 3:
            break
        time.sleep(0.02)
    assert metrics.read_totals(str(tmp_path))["freed_blocks"] == 3  # no explicit flush


def test_metrics_recorder_without_directory_writes_nowhere(tmp_path):
    recorder = metrics.Recorder(None)
    recorder.add(compactions=2)
    recorder.flush()
    assert recorder.path is None and recorder.values == {"compactions": 2}


def test_metrics_recorder_flush_survives_removed_directory(tmp_path):
    recorder = metrics.Recorder(str(tmp_path / "gone"))  # process 0 exited and removed it
    recorder.add(compactions=1)
    recorder.flush()


def test_metrics_read_totals_sums_writers_and_ignores_junk(tmp_path):
    _write(tmp_path, "101.json", {"evicted_tokens": 10, "freed_blocks": 1, "live_kv_tokens": 7})
    _write(tmp_path, "102.json", {"evicted_tokens": 2.5, "attention_mass": 4, "unknown": 99})
    _write(tmp_path, "105.json", {"evicted_tokens": 1, "compactions": 4})
    _write(tmp_path, "103.json", '{"evicted_tokens": 1')  # torn or foreign: skipped
    _write(tmp_path, "104.json.tmp", {"evicted_tokens": 1000})  # a write in progress
    _write(tmp_path, "notes.txt", {"evicted_tokens": 1000})
    (tmp_path / "sub.json").mkdir()  # unreadable as a file
    totals = metrics.read_totals(str(tmp_path))
    assert totals == {**{name: 0 for name in metrics.METRICS},
                      "evicted_tokens": 13.5, "freed_blocks": 1, "compactions": 4,
                      "attention_mass": 4, "live_kv_tokens": 7}


def test_metrics_read_totals_zero_without_directory(tmp_path, monkeypatch):
    zeros = {name: 0.0 for name in metrics.METRICS}
    monkeypatch.delenv(metrics.DIR_ENV, raising=False)
    assert metrics.read_totals() == zeros
    assert metrics.read_totals(str(tmp_path / "missing")) == zeros
    _write(tmp_path, "1.json", {"compactions": 2})
    monkeypatch.setenv(metrics.DIR_ENV, str(tmp_path))
    assert metrics.read_totals()["compactions"] == 2  # the directory comes from the environment


def test_metrics_evicted_share():
    assert metrics.evicted_share(TOTALS) == 0.25
    assert metrics.evicted_share({**TOTALS, "evicted_attention_mass": 0, "attention_mass": 0}) == 0.0


def test_metrics_summary_line_text():
    assert metrics.summary_line(TOTALS) == (
        "H2O: evicted 12 tokens in 3 compactions, freed 2 KV blocks, live KV tokens 40, "
        "evicted attention share 25.00%")


def test_metrics_summary_if_changed_once_per_change(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.DIR_ENV, str(tmp_path))
    _write(tmp_path, "1.json", TOTALS)
    state = {}
    assert metrics.summary_if_changed(state) == metrics.summary_line(TOTALS)
    assert metrics.summary_if_changed(state) is None
    assert metrics.summary_if_changed(state) is None
    _write(tmp_path, "2.json", {"evicted_tokens": 8})
    assert metrics.summary_if_changed(state).startswith("H2O: evicted 20 tokens in 3 compactions")
    assert metrics.summary_if_changed(state) is None
    assert metrics.summary_if_changed({}) is not None  # the state is the caller's


def test_metrics_collector_one_family_per_metric(tmp_path):
    _write(tmp_path, "1.json", TOTALS)
    _write(tmp_path, "2.json", {"evicted_tokens": 8, "live_kv_tokens": 2})
    families = {f.name: f for f in metrics.H2OCollector(str(tmp_path)).collect()}
    share = metrics.PREFIX + "evicted_attention_share"
    assert set(families) == {metrics.PREFIX + name for name in metrics.METRICS} | {share}
    summed = {**{name: 0 for name in metrics.METRICS}, **TOTALS, "evicted_tokens": 20, "live_kv_tokens": 42}
    for name, (kind, doc) in metrics.METRICS.items():
        family = families[metrics.PREFIX + name]
        assert (family.type, family.documentation) == (kind, doc)
        assert [s.value for s in family.samples] == [summed[name]]
    assert families[share].samples[0].value == 0.25


def test_metrics_collector_through_prometheus_registry(tmp_path):
    registry = CollectorRegistry()
    registry.register(metrics.H2OCollector(str(tmp_path)))
    assert registry.get_sample_value("h2o_vllm:freed_blocks_total") == 0  # no writer yet
    _write(tmp_path, "7.json", TOTALS)
    # Read at each scrape, not at registration.
    assert registry.get_sample_value("h2o_vllm:freed_blocks_total") == 2
    assert registry.get_sample_value("h2o_vllm:live_kv_tokens") == 40
    assert registry.get_sample_value("h2o_vllm:evicted_attention_share") == pytest.approx(0.25)


def test_metrics_register_collector_once_per_served_registry(tmp_path, monkeypatch):
    """An API server's own registry (``--api-server-count`` > 1) gets the collector once;
    the global one is process 0's (``setup_process0``); no directory, no H2O metrics."""
    from prometheus_client import REGISTRY
    _write(tmp_path, "7.json", TOTALS)
    monkeypatch.delenv(metrics.DIR_ENV, raising=False)
    bare = CollectorRegistry()
    metrics.register_collector(bare)
    assert bare.get_sample_value("h2o_vllm:freed_blocks_total") is None
    monkeypatch.setenv(metrics.DIR_ENV, str(tmp_path))
    served = CollectorRegistry()
    metrics.register_collector(served)
    metrics.register_collector(served)  # a second registration would raise on duplicate names
    assert served.get_sample_value("h2o_vllm:freed_blocks_total") == 2
    before = list(REGISTRY._collector_to_names)
    metrics.register_collector(REGISTRY)
    assert list(REGISTRY._collector_to_names) == before
