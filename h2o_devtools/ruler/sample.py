"""One task instance and RULER's scorer (Hsieh et al. 2024, arXiv 2404.06654).

Pure: stdlib only. Runs in the benchmark process and in its engine children.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """A prompt (plain text, completion style: it ends where the answer starts, so a base model
    such as Gemma 3 270M and an instruct one such as SmolLM2 read it alike), the strings a right
    answer contains, and how many tokens the answer may take."""

    task: str
    prompt: str
    answers: tuple[str, ...]
    max_tokens: int


def string_match_all(answers: tuple[str, ...] | list[str], output: str) -> float:
    """RULER's metric for every synthetic task: the fraction of the answers found in the
    output, case-insensitive. One answer: exact containment; several (multi-value, variable
    tracking, common words): recall."""
    if not answers:
        raise ValueError("a sample needs at least one answer")
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def score(sample: Sample, output: str) -> float:
    return string_match_all(sample.answers, output)
