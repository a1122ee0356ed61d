"""benchmarks/cuda_step_timing.py --tiny: every path the GPU run times (plain attention, the
fused H2O step, vLLM's attention, the unfused step) runs, interpreted on the CPU, and the JSON
has the fields the docs/results.md table reads. Its times mean nothing (interpreter, one call)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_tiny_run_times_every_path(tmp_path):
    out = tmp_path / "timing.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_step_timing.py"),
                           "--tiny", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["q_len"] > 1, c["compacted"], c["obs_window"]) for c in cases] == [
        (False, False, None), (False, True, None), (True, False, None), (True, False, 8),
        (False, False, None)]  # the last, 2 rows of 300 keys, runs the split-KV decode
    assert cases[-1]["kv_len"] == 300
    for c in cases:
        for key in ("plain_attention_ms", "h2o_fused_ms", "vllm_attention_ms", "h2o_unfused_ms"):
            assert c[key] > 0, (key, c)
