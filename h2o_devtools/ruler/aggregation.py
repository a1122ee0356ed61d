"""RULER's aggregation task: common-words extraction (CWE) over words of a public-domain text.

Pure: stdlib only.
"""
from __future__ import annotations

import random

from h2o_devtools.ruler.haystack import Haystack, Length
from h2o_devtools.ruler.sample import Sample

CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n")


def common_words(rng: random.Random, haystack: Haystack, num_tokens: int, length: Length, *,
                 num_common: int = 3, common_freq: int = 16, rare_freq: int = 2) -> Sample:
    """``num_common`` words ``common_freq`` times each among rare words ``rare_freq`` times each,
    shuffled into a numbered list of about ``num_tokens`` tokens; the answer is the common words.
    RULER's default is 10 words x 30 against x 3; a 135M model needs fewer, more frequent ones."""
    vocabulary = haystack.words()
    rng.shuffle(vocabulary)
    common, rare = vocabulary[:num_common], vocabulary[num_common:]
    tail = (f"\nQuestion: What are the {num_common} most common words in the above list? "
            f"Answer: The top {num_common} words that appear most often in the list are:")
    words = [w for w in common for _ in range(common_freq)]
    # An entry is "\n<number>. <word>": priced with the number it will about have.
    used = length(CWE_INTRO + tail) + sum(length(f"\n{i}. {w}") for i, w in enumerate(words, 1))
    for w in rare:
        cost = sum(length(f"\n{len(words) + k}. {w}") for k in range(1, rare_freq + 1))
        if used + cost > num_tokens:
            break
        words += [w] * rare_freq
        used += cost
    rng.shuffle(words)
    listing = "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))
    return Sample("cwe", CWE_INTRO + listing + tail, tuple(common), 8 * num_common)
