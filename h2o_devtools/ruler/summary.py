"""The suite's numbers from its generations: each task's mean score, the suite score (the mean
over tasks, so that a task counts the same whatever its sample count), and its ratio to the
full cache's.

Pure: stdlib only. Runs in the benchmark process.
"""
from __future__ import annotations

from h2o_devtools.ruler.sample import string_match_all

FULL = "full"


def scores(outputs: dict[str, list[dict]]) -> dict[str, dict]:
    """outputs: label -> rows of {"task", "answers", "text"}; ``FULL`` must be among the labels.
    Returns label -> {"tasks": {task: mean}, "num_samples": {task: n}, "suite", "suite_ratio_to_full"}
    (the ratio is None where the full cache scores 0: it has nothing to keep)."""
    out = {}
    for label, rows in outputs.items():
        by_task: dict[str, list[float]] = {}
        for r in rows:
            by_task.setdefault(r["task"], []).append(string_match_all(r["answers"], r["text"]))
        tasks = {t: sum(v) / len(v) for t, v in by_task.items()}
        out[label] = {"tasks": tasks, "num_samples": {t: len(v) for t, v in by_task.items()},
                      "suite": sum(tasks.values()) / len(tasks)}
    full = out[FULL]["suite"]
    for entry in out.values():
        entry["suite_ratio_to_full"] = entry["suite"] / full if full else None
    return out
