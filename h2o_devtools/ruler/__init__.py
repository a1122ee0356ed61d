"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, arXiv 2404.06654), made here
from public-domain text: nothing is downloaded.

Pure: stdlib only; the benchmark (``benchmarks/quality_suite.py``) tokenizes and runs them.
One module per RULER category (retrieval: ``needles``; multi-hop tracing: ``tracing``;
aggregation: ``aggregation``), plus the haystack and the sample with its scorer. ``TASKS`` is
the registry: a task is one line here.
"""
from __future__ import annotations

import functools
import random

from h2o_devtools.ruler.aggregation import common_words
from h2o_devtools.ruler.haystack import Haystack, Length
from h2o_devtools.ruler.needles import fact_qa, niah
from h2o_devtools.ruler.sample import Sample, score, string_match_all
from h2o_devtools.ruler.tracing import variable_tracking

#: name -> generator(rng, haystack, num_tokens, length) -> Sample
TASKS = {
    "niah_single": niah,
    "niah_multikey": functools.partial(niah, num_keys=4),
    "niah_multivalue": functools.partial(niah, num_values=4),
    "vt": variable_tracking,
    "cwe": common_words,
    "qa_start": functools.partial(fact_qa, position="start"),
    "qa_middle": functools.partial(fact_qa, position="middle"),
    "qa_end": functools.partial(fact_qa, position="end"),
}


def samples(task: str, num: int, seed: int, haystack: Haystack, num_tokens: int, length: Length) -> list[Sample]:
    """``num`` samples of ``task``; sample i depends only on (seed, task, i)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: {', '.join(TASKS)}")
    return [TASKS[task](random.Random(f"{seed}/{task}/{i}"), haystack, num_tokens, length) for i in range(num)]


__all__ = ["TASKS", "Haystack", "Sample", "samples", "score", "string_match_all"]
