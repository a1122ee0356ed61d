"""The GPU bundle without the network: reproducible repacking, the manifest and its size limit,
the pins, the engine settings, and ``gpu_check.sh --dry-run`` on a small synthetic bundle.
A real bundle (``make gpu-bundle`` needs the package index) is checked only if one was built."""
import csv
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
sys.path.insert(0, str(REPO / "packaging"))
from gpu_bundle import build, bundle, settings, wheels  # noqa: E402

ELF = b"\x7fELF" + b"\0" * 60


def _platform_wheel(path: Path) -> Path:
    """A small stand-in for vLLM's platform wheel: Python, an extension, an executable, headers."""
    members = {
        "pkg/__init__.py": b"VALUE = 1\n",
        "pkg/_ext.abi3.so": ELF,
        "pkg/tool": ELF,
        "pkg/include/kernel.hpp": b"// header\n",
        "pkg/configs/N=8,K=16.json": b"{}\n",  # a comma: RECORD must quote it
        "pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
        "pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp38-abi3-linux_x86_64\n",
        "pkg-1.0.dist-info/RECORD": b"",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _repack(src: Path, out: Path) -> Path:
    out.mkdir()
    return wheels.repack_pure(src, out, {"pkg/standin.py": b"STANDIN = True\n"}, "h2o.pure")[0]


def test_repack_drops_compiled_files_and_is_reproducible(tmp_path):
    src = _platform_wheel(tmp_path / "pkg-1.0-cp38-abi3-linux_x86_64.whl")
    first, second = _repack(src, tmp_path / "a"), _repack(src, tmp_path / "b")
    assert first.name == "pkg-1.0+h2o.pure-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes()
    entries = wheels.read_wheel(first)
    assert set(entries) == {"pkg/__init__.py", "pkg/standin.py", "pkg/configs/N=8,K=16.json",
                            "pkg-1.0+h2o.pure.dist-info/METADATA", "pkg-1.0+h2o.pure.dist-info/WHEEL",
                            "pkg-1.0+h2o.pure.dist-info/RECORD"}
    assert b"Version: 1.0+h2o.pure" in entries["pkg-1.0+h2o.pure.dist-info/METADATA"]
    assert b"Tag: py3-none-any" in entries["pkg-1.0+h2o.pure.dist-info/WHEEL"]
    record = list(csv.reader(io.StringIO(entries["pkg-1.0+h2o.pure.dist-info/RECORD"].decode())))
    for name, digest, size in record[:-1]:
        assert digest == wheels._record_hash(entries[name]) and int(size) == len(entries[name])
    with zipfile.ZipFile(first) as z:
        assert {i.date_time for i in z.infolist()} == {wheels.ZIP_DATE}


def test_repacked_wheel_installs_offline_into_a_target(tmp_path):
    wheel = _repack(_platform_wheel(tmp_path / "pkg-1.0-cp38-abi3-linux_x86_64.whl"), tmp_path / "w")
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                          "--target", str(target), str(wheel)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "RECORD line" not in run.stderr
    assert (target / "pkg" / "standin.py").is_file() and not (target / "pkg" / "_ext.abi3.so").exists()


def test_manifest_records_every_file_and_catches_changes(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(b"a" * 100)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError):
        bundle.write_manifest(tmp_path, [{"name": "x"}], {})
    doc = bundle.write_manifest(tmp_path, [{"name": "a", "sha256": "0" * 64}], {"target": "t"})
    assert set(doc["files"]) == {"wheels/a.whl", "tokenizer.json"}
    assert bundle.verify(tmp_path) == []
    manifest = (tmp_path / bundle.MANIFEST).read_bytes()
    bundle.write_manifest(tmp_path, [{"name": "a", "sha256": "0" * 64}], {"target": "t"})
    assert (tmp_path / bundle.MANIFEST).read_bytes() == manifest  # no dates, no host: reproducible
    assert any("over the" in p for p in bundle.verify(tmp_path, limit=100))
    (tmp_path / "wheels" / "a.whl").write_bytes(b"b" * 100)
    (tmp_path / "extra.whl").write_bytes(b"")
    (tmp_path / "tokenizer.json").unlink()
    assert bundle.verify(tmp_path) == ["missing: tokenizer.json", "not in the manifest: extra.whl",
                                       "changed since the build: wheels/a.whl"]


def test_pins_are_exact_versions_with_hashes():
    pins = build.read_pins()
    names = [p["name"] for p in pins]
    assert len(names) == len(set(names))
    assert {"name": "vllm", "version": "0.32.0"}.items() <= pins[0].items()
    assert all(len(p["sha256"]) == 64 for p in pins)


def test_bundle_settings_force_eager_native_ops_and_keep_the_rest():
    kwargs = settings.apply({"enforce_eager": False, "block_size": 16,
                             "compilation_config": {"mode": 0}})
    assert kwargs["enforce_eager"] is True and kwargs["block_size"] == 16
    assert kwargs["compilation_config"] == {"mode": 0, "custom_ops": ["none"]}
    assert kwargs["ir_op_priority"]["rms_norm"] == ["native"]
    flags = settings.cli_flags()
    assert json.loads(flags[flags.index("--compilation-config") + 1]) == {"custom_ops": ["none"]}


def test_gpu_check_dry_run_with_a_synthetic_bundle(tmp_path, tiny_llama_dir):
    """The dry run verifies and installs a bundle offline, builds both models, starts no GPU step."""
    root = tmp_path / "bundle"
    (root / "wheels").mkdir(parents=True)
    _repack(_platform_wheel(tmp_path / "pkg-1.0-cp38-abi3-linux_x86_64.whl"), tmp_path / "w")
    for wheel in (tmp_path / "w").iterdir():
        (root / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    (root / "tokenizer").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "tokenizer" / name).write_bytes((tiny_llama_dir / name).read_bytes())
    bundle.write_manifest(root, [{"name": "pkg", "sha256": "0" * 64}], {})
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BUNDLE": str(root), "OUT_DIR": str(out)}
    run = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] and doc["mode"] == "bundle"
    assert [(s["name"], s["exit"]) for s in doc["steps"]] == [
        ("bundle_verify", 0), ("bundle_install", 0), ("models", 0)]
    for name in ("kernels", "step_timing", "engine", "load", "throughput_stock", "throughput_h2o",
                 "throughput_stock_fp8", "throughput_h2o_fp8", "throughput_h2o_keydiff",
                 "throughput_h2o_expected"):
        assert "dry run, not started" in (out / f"{name}.log").read_text()
    assert "llama-8b-shape" in (out / "models.log").read_text()


BUILT = REPO / ".gpu-bundle"


@pytest.mark.skipif(not (BUILT / bundle.MANIFEST).is_file(),
                    reason="no .gpu-bundle/ (make gpu-bundle needs the package index)")
def test_built_bundle_is_intact_within_the_limit_and_pure():
    assert bundle.verify(BUILT) == []
    doc = json.loads((BUILT / bundle.MANIFEST).read_text())
    assert doc["total_bytes"] <= bundle.SIZE_LIMIT_BYTES
    vllm = next(i for i in doc["inputs"] if i["name"] == "vllm")
    assert vllm["version"] == "0.32.0" and vllm["repacked_as"].endswith("py3-none-any.whl")
    entries = wheels.read_wheel(BUILT / "wheels" / vllm["repacked_as"])
    assert not [n for n, data in entries.items() if wheels.is_compiled(n, data)]
    for member, path in build.STANDINS.items():
        assert entries[member] == path.read_bytes()


def test_report_collects_steps_tests_load_and_the_throughput_ratio(tmp_path):
    from gpu_bundle import report
    (tmp_path / "steps.txt").write_text("kernels 0 21 40\nengine 1 100 120\nthroughput_h2o 124 120 120\n")
    (tmp_path / "engine.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
        '<testcase classname="t" name="c"/></testsuite></testsuites>')
    (tmp_path / "load.json").write_text(json.dumps({"ok": True, "peak_running": 120}))
    for name, tps in (("stock", 100.0), ("h2o", 250.0), ("h2o-keydiff", 200.0)):
        (tmp_path / f"throughput-{name}.json").write_text(
            json.dumps({"tokens_per_second": tps, "requests_per_second": tps / 10}))
    report.main([str(tmp_path), str(tmp_path / "steps.txt")])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["exit"], s["timed_out"]) for s in doc["steps"]] == [
        ("kernels", 0, False), ("engine", 1, False), ("throughput_h2o", 124, True)]
    assert doc["tests"]["engine"]["failed_tests"] == ["t::b"]
    assert doc["load"]["peak_running"] == 120
    assert doc["throughput"]["ratio_tokens_per_s"] == pytest.approx(2.5)
    # A score mode's run (gpu_check.sh step 7) against stock and the paper's score; one not run is absent.
    keydiff = doc["throughput"]["scores"]["keydiff"]
    assert (keydiff["ratio_tokens_per_s"], keydiff["vs_h2o"]) == (pytest.approx(2.0), pytest.approx(0.8))
    assert "expected" not in doc["throughput"]["scores"]


def test_pytest_plugin_gives_every_llm_the_bundle_settings(monkeypatch):
    import vllm

    from gpu_bundle import pytest_bundle
    seen = {}

    def fake_init(self, model, **kwargs):  # stands in for the engine: records what it was given
        seen.update(kwargs, model=model)

    monkeypatch.setattr(vllm.LLM, "__init__", fake_init)
    pytest_bundle.pytest_configure(None)
    pytest_bundle.pytest_configure(None)  # idempotent: wraps once
    vllm.LLM("m", enforce_eager=False, block_size=16)
    assert seen == {"model": "m", **settings.apply({"enforce_eager": False, "block_size": 16})}
