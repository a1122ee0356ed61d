"""RULER's multi-hop tracing task: variable tracking (a chain of assignments in a haystack).

Pure: stdlib only.
"""
from __future__ import annotations

import random
import string

from h2o_devtools.ruler.haystack import Haystack, Length, insert
from h2o_devtools.ruler.needles import magic_number
from h2o_devtools.ruler.sample import Sample

VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"


def variable_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def variable_tracking(rng: random.Random, haystack: Haystack, num_tokens: int, length: Length, *,
                      num_hops: int = 2) -> Sample:
    """``VAR A = 123456.`` then ``num_hops`` copies (``VAR B = VAR A.`` ...) in order at seeded
    depths; the answer is every variable of the chain. The answer starts with "VAR": without it
    SmolLM2-135M with the full cache numbers an empty list instead ("1. 2. 3.")."""
    names = []
    while len(names) < num_hops + 1:
        name = variable_name(rng)
        if name not in names:
            names.append(name)
    value = magic_number(rng)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = sorted(rng.random() for _ in statements)
    tail = (f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain of variable assignments in the text above, "
            f"{len(names)} variables are assigned the value {value}, they are: VAR")
    fixed = length(VT_INTRO + tail) + sum(length(s) + 1 for s in statements)
    window = haystack.window(rng, max(1, num_tokens - fixed))
    prompt = VT_INTRO + insert(window, list(zip(depths, statements))) + tail
    return Sample("vt", prompt, tuple(names), 8 * len(names))
