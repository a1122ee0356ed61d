"""``gpu_check.json``: one record of a GPU check, from the step list and the files the steps wrote.

    python -m gpu_bundle.report OUT_DIR STEPS_FILE

STEPS_FILE has one line per step: ``name exit seconds cap``. Reads, when present: the pytest
JUnit files (``<step>.xml``), ``load.json``, ``throughput-stock.json`` / ``throughput-h2o.json``
(``vllm bench throughput --output-json``) and ``bundle-manifest.json``. Imports torch and vllm
only to name versions, and records their failure instead of failing.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "vllm", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            out[name] = f"not importable: {type(e).__name__}: {e}"[:200]
    try:
        import torch
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        out["gpu"] = None
    return out


def _junit(path: Path) -> dict | None:
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites
                             for c in s.iter("testcase")
                             if c.find("failure") is not None or c.find("error") is not None]
    return total


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def throughput(out: Path) -> dict | None:
    stock, h2o = _json(out / "throughput-stock.json"), _json(out / "throughput-h2o.json")
    if not (stock and h2o):
        return None
    modes = {score: run for score in SCORES if (run := _json(out / f"throughput-h2o-{score}.json"))}
    return {"stock": stock, "h2o_20": h2o,
            "ratio_tokens_per_s": h2o["tokens_per_second"] / stock["tokens_per_second"],
            "ratio_requests_per_s": h2o["requests_per_second"] / stock["requests_per_second"],
            # Each score mode's H2O 20% run (step 7), as a ratio to stock and to the paper's score.
            "scores": {score: {"run": run, "ratio_tokens_per_s": run["tokens_per_second"] / stock["tokens_per_second"],
                               "vs_h2o": run["tokens_per_second"] / h2o["tokens_per_second"]}
                       for score, run in modes.items()}}


#: The score modes gpu_check.sh times beside the paper's (its step 7).
SCORES = ("keydiff", "expected")


def main(argv: list[str] | None = None) -> int:
    out_dir, steps_file = (argv or sys.argv[1:])[:2]
    out = Path(out_dir)
    steps = []
    for line in Path(steps_file).read_text().splitlines():
        name, rc, seconds, cap = line.split()
        steps.append({"name": name, "exit": int(rc), "seconds": int(seconds), "cap_s": int(cap),
                      "timed_out": rc in ("124", "137"), "log": f"{name}.log"})
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"host": platform.node(), "dry_run": os.environ.get("GPU_CHECK_DRY_RUN") == "1",
           "mode": os.environ.get("GPU_CHECK_MODE"), "git_commit": git or None,
           "command": os.environ.get("GPU_CHECK_COMMAND"), **_versions(), "steps": steps,
           "tests": {s["name"]: _junit(out / f"{s['name']}.xml") for s in steps
                     if (out / f"{s['name']}.xml").is_file()},
           "load": _json(out / "load.json"), "throughput": throughput(out),
           "settings": os.environ.get("GPU_CHECK_SETTINGS")}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("host", "gpu", "mode", "dry_run", "steps")}, indent=2))
    if doc["throughput"]:
        print(f"throughput H2O 20% / stock at equal blocks: "
              f"{doc['throughput']['ratio_tokens_per_s']:.2f}x tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
