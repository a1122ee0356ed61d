"""RULER's retrieval tasks (needle in a haystack) and a question about one fact placed at the
start, the middle or the end of the context.

Pure: stdlib only. Each generator takes a seeded ``random.Random``, a ``Haystack``, the
context's size in tokens and the ``length`` that counts them, and returns one ``Sample``.
"""
from __future__ import annotations

import random

from h2o_devtools.ruler.haystack import Haystack, Length, insert
from h2o_devtools.ruler.sample import Sample

#: Needle keys: plain words that the haystack texts (licences, dictionaries) rarely use as names.
KEYS = ("apple", "river", "falcon", "lantern", "meadow", "copper", "violin", "harbor", "pepper",
        "glacier", "orchid", "canyon", "saddle", "thimble", "walnut", "comet", "pebble", "tulip",
        "anchor", "biscuit", "cobalt", "dolphin", "ember", "fjord", "garnet", "hazel", "igloo",
        "juniper", "kettle", "lemur", "marble", "nutmeg", "otter", "quartz", "raven", "sparrow")
NAMES = ("Alma", "Bruno", "Celia", "Dmitri", "Edith", "Farid", "Greta", "Hugo", "Ines", "Jonas",
         "Kira", "Lucas", "Mirela", "Nils", "Olga", "Pavel", "Rosa", "Stefan", "Tamsin", "Ugo")
#: Syllables of the invented names the fact question asks for: a real word (a city) is one token
#: to Gemma 3, and a prompt held whole gives its first answer token the full cache (eviction
#: comes after the prompt), so a one-token answer would measure nothing.
SYLLABLES = ("vor", "lan", "tix", "qua", "mer", "bos", "del", "fin", "gar", "hol", "jun", "kes", "lom",
             "nar", "pel", "ruk", "sil", "tam", "vex", "zor")

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to "
              "memorize them. I will quiz you about the numbers afterwards.\n\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QA_INTRO = "Read the following text and answer the question about it.\n\n"
FACT = "{name}'s cat is called {pet}."
QA_QUESTION = "\n\nQuestion: What is the name of {name}'s cat?\nAnswer: {name}'s cat is called"

#: The depth of the fact for each position of the fact question (0: first, 1: last).
POSITIONS = {"start": 0.0, "middle": 0.5, "end": 1.0}


def magic_number(rng: random.Random) -> str:
    """Six digits, as the pass key: long enough not to be guessed, short enough for a 135M model."""
    return str(rng.randrange(100000, 1000000))


def _context(haystack: Haystack, rng: random.Random, head: str, tail: str, needles: list[tuple[float, str]],
             num_tokens: int, length: Length) -> str:
    """head + a window with the needles + tail, the window sized so the whole is ``num_tokens``."""
    fixed = length(head + tail) + sum(length(n) + 1 for _, n in needles)
    return head + insert(haystack.window(rng, max(1, num_tokens - fixed)), needles) + tail


def niah(rng: random.Random, haystack: Haystack, num_tokens: int, length: Length, *, num_keys: int = 1,
         num_values: int = 1) -> Sample:
    """One key asked about; ``num_keys - 1`` distractor keys with a number each; the asked key
    has ``num_values`` numbers. Needles at seeded random depths."""
    keys = rng.sample(KEYS, num_keys)
    values = [magic_number(rng) for _ in range(num_values)]
    needles = [NEEDLE.format(key=keys[0], value=v) for v in values]
    needles += [NEEDLE.format(key=k, value=magic_number(rng)) for k in keys[1:]]
    placed = [(rng.random(), n) for n in needles]
    if num_values == 1:
        tail = (f"\n\nWhat is the special magic number for {keys[0]} mentioned in the provided text? "
                f"The special magic number for {keys[0]} mentioned in the provided text is")
    else:
        tail = (f"\n\nWhat are all the special magic numbers for {keys[0]} mentioned in the provided "
                f"text? The special magic numbers for {keys[0]} mentioned in the provided text are")
    task = "niah_single" if num_keys == num_values == 1 else "niah_multikey" if num_values == 1 else "niah_multivalue"
    prompt = _context(haystack, rng, NIAH_INTRO, tail, placed, num_tokens, length)
    return Sample(task, prompt, tuple(values), 12 * num_values)


def fact_qa(rng: random.Random, haystack: Haystack, num_tokens: int, length: Length, *, position: str) -> Sample:
    """A one-sentence fact at ``POSITIONS[position]``, asked about at the end; the answer is an
    invented three-syllable name."""
    name = rng.choice(NAMES)
    pet = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
    placed = [(POSITIONS[position], FACT.format(name=name, pet=pet))]
    prompt = _context(haystack, rng, QA_INTRO, QA_QUESTION.format(name=name), placed, num_tokens, length)
    return Sample(f"qa_{position}", prompt, (pet,), 10)
