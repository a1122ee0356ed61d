"""The benchmark scripts run end to end at a tiny size and write their JSON and PNG.

Not a measurement: benchmarks/README.md has the real commands. Each config still starts a
fresh engine in a subprocess, as the real runs do (~20 s each on 2 cores).
"""
import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_benchmark_runs(tiny_llama_dir, tmp_path):
    out = tmp_path / "throughput"
    result = _load("throughput").main([
        "--model", str(tiny_llama_dir), "--workloads", "synthetic", "--configs", "stock,h2o:0.2",
        "--num-requests", "3", "--prompt-len", "40", "--output-len", "24", "--out", str(out)])
    saved = json.loads((out / "throughput.json").read_text())
    assert (out / "throughput.png").stat().st_size > 0
    assert [r["config"] for r in saved["runs"]] == ["stock", "h2o-20%"]
    for run in saved["runs"]:
        assert run["output_tokens"] == 3 * 24 and run["prompt_tokens"] == 3 * 40
        assert run["total_tok_s"] > 0 and run["peak_running"] >= 1 and run["peak_blocks_used"] >= 1
    assert saved["runs"][0]["total_ratio_to_stock"] == pytest.approx(1.0)
    assert result["meta"]["num_blocks"] == saved["meta"]["num_blocks"]


def test_quality_benchmark_runs(tiny_llama_dir, tmp_path):
    out = tmp_path / "quality"
    _load("quality").main([
        "--model", str(tiny_llama_dir), "--texts", "gpl3", "--budgets", "0.5,0.2",
        "--policies", "h2o,local,window+sinks", "--ppl-prompt-len", "40", "--ppl-continuation-len", "8", "--gen-prompts", "2",
        "--gen-prompt-len", "40", "--gen-len", "8", "--passkey-samples", "2", "--passkey-filler", "40",
        "--out", str(out)])
    saved = json.loads((out / "quality.json").read_text())
    assert (out / "quality.png").stat().st_size > 0
    assert set(saved["policies"]) == {"full", "h2o-50%", "h2o-20%", "local-50%", "local-20%",
                                      "window+sinks-50%", "window+sinks-20%"}
    full = saved["policies"]["full"]
    assert full["token_agreement"] == 1.0 and full["ppl"]["gpl3"]["ppl_ratio_to_full"] == 1.0
    for entry in saved["policies"].values():
        assert entry["ppl"]["gpl3"]["tokens"] == 8
        assert 0.0 <= entry["rouge_l"] <= 1.0 and 0.0 <= entry["passkey_accuracy"] <= 1.0
