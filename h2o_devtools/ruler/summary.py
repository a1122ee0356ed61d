"""The suite's numbers from its generations: each task's mean score, the suite score (the mean
over tasks, so that a task counts the same whatever its sample count), and its ratio to the
full cache's. A task the full cache scores 0 on measures nothing (nothing to keep, and an
evicting policy's lucky hit there is noise): it is listed as dead and left out of every suite score.

Pure: stdlib only. Runs in the benchmark process.
"""
from __future__ import annotations

from h2o_devtools.ruler.sample import string_match_all

FULL = "full"


def scores(outputs: dict[str, list[dict]]) -> dict[str, dict]:
    """outputs: label -> rows of {"task", "answers", "text"}; ``FULL`` must be among the labels.
    Returns label -> {"tasks": {task: mean}, "num_samples": {task: n}, "dead_tasks", "suite",
    "suite_ratio_to_full"} (the ratio is None where the full cache scores 0 on every task)."""
    out = {}
    for label, rows in outputs.items():
        by_task: dict[str, list[float]] = {}
        for r in rows:
            by_task.setdefault(r["task"], []).append(string_match_all(r["answers"], r["text"]))
        out[label] = {"tasks": {t: sum(v) / len(v) for t, v in by_task.items()},
                      "num_samples": {t: len(v) for t, v in by_task.items()}}
    dead = [t for t, v in out[FULL]["tasks"].items() if v == 0]
    for entry in out.values():
        live = [v for t, v in entry["tasks"].items() if t not in dead]
        entry["dead_tasks"] = dead
        entry["suite"] = sum(live) / len(live) if live else 0.0
    full = out[FULL]["suite"]
    for entry in out.values():
        entry["suite_ratio_to_full"] = entry["suite"] / full if full else None
    return out
