"""Haystacks: windows of a public-domain text, whole sentences, sized in tokens.

Pure: stdlib only. The length of a piece of text is whatever ``length`` says (the model's
tokenizer in the benchmark, a word count in the unit tests), so a context of N tokens is N of
the model's tokens, as in RULER.
"""
from __future__ import annotations

import random
import re
from typing import Callable

Length = Callable[[str], int]

# A sentence ends at . ! or ? followed by white space; the texts' hard line breaks are joined.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Haystack:
    """The sentences of one text, each with its length, to cut windows from."""

    def __init__(self, text: str, length: Length):
        flat = " ".join(text.split())
        self.sentences = [s for s in _SENTENCE_END.split(flat) if s]
        self.lengths = [length(s) + 1 for s in self.sentences]  # + the joining space
        if len(self.sentences) < 2:
            raise ValueError("a haystack needs a text of several sentences")

    def window(self, rng: random.Random, num_tokens: int) -> list[str]:
        """Consecutive sentences, from a seeded random start, as many as fit in ``num_tokens``
        (at least one); a window that reaches the end of the text wraps to its start."""
        start = rng.randrange(len(self.sentences))
        out, used = [], 0
        for i in range(len(self.sentences)):
            j = (start + i) % len(self.sentences)
            if out and used + self.lengths[j] > num_tokens:
                break
            out.append(self.sentences[j])
            used += self.lengths[j]
        return out

    def words(self, min_len: int = 4) -> list[str]:
        """The text's distinct lower-case words of ``min_len`` letters or more, in first-seen
        order: a vocabulary of real words for the aggregation tasks."""
        seen = dict.fromkeys(w.lower() for s in self.sentences for w in re.findall(r"[A-Za-z]+", s)
                             if len(w) >= min_len)
        return list(seen)


def insert(sentences: list[str], needles: list[tuple[float, str]]) -> str:
    """The window with each needle placed at its depth (0: before the first sentence, 1: after
    the last), between sentences, never inside one; needles at one depth keep their order."""
    slots = [[] for _ in range(len(sentences) + 1)]
    for depth, needle in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"a needle's depth is in [0, 1], got {depth}")
        slots[round(depth * len(sentences))].append(needle)
    parts = []
    for i, slot in enumerate(slots):
        parts += slot
        if i < len(sentences):
            parts.append(sentences[i])
    return " ".join(parts)
