"""h2o_devtools.ruler without a model: a word count stands in for the tokenizer. Generators are
seeded, put every answer in the prompt where it must be, stay near their size; the scorer and
the summary are right on hand cases."""
import random

import pytest

from h2o_devtools import ruler
from h2o_devtools.ruler import haystack as hs
from h2o_devtools.ruler import summary

def pseudo_word(i: int) -> str:
    return "".join(chr(97 + (i // 26 ** k) % 26) for k in range(3)) + "ward"


# Sentence i names its number and a word of its own: common-words extraction needs a vocabulary.
TEXT = " ".join(f"Sentence number {i} talks about the {pseudo_word(i)} keeper and his dog." for i in range(400))


def words(s: str) -> int:
    return len(s.split())


@pytest.fixture(scope="module")
def haystack():
    return ruler.Haystack(TEXT, words)


@pytest.mark.parametrize("task", ruler.TASKS)
def test_samples_are_seeded(haystack, task):
    first = ruler.samples(task, 3, 7, haystack, 300, words)
    assert first == ruler.samples(task, 3, 7, haystack, 300, words)
    assert first != ruler.samples(task, 3, 8, haystack, 300, words)
    assert len({s.prompt for s in first}) == 3


@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_answer_is_in_the_prompt_and_the_size_is_near(haystack, task):
    for s in ruler.samples(task, 5, 0, haystack, 300, words):
        assert s.task == task and s.answers and s.max_tokens > 0
        body = s.prompt.rsplit("\n\n", 1)[0] if task != "cwe" else s.prompt.rsplit("\nQuestion", 1)[0]
        assert all(a in body for a in s.answers), "the answer must be in the context, not only in the question"
        assert 250 <= words(s.prompt) <= 300


def test_a_distractor_key_is_not_the_asked_one(haystack):
    s = ruler.samples("niah_multikey", 1, 0, haystack, 300, words)[0]
    asked = s.prompt.rsplit("magic number for ", 1)[1].split()[0]
    needles = [line for line in s.prompt.split(". ") if "magic numbers for" in line and " is: " in line]
    assert len(needles) == 4
    assert [n for n in needles if f"for {asked} is" in n] == [f"One of the special magic numbers for {asked} is: {s.answers[0]}"]


@pytest.mark.parametrize("position,where", [("start", 0.0), ("middle", 0.5), ("end", 1.0)])
def test_the_fact_sits_where_its_task_says(haystack, position, where):
    s = ruler.samples(f"qa_{position}", 1, 0, haystack, 300, words)[0]
    context = s.prompt.split("\n\n")[1]
    fact = context.index(f"'s cat is called {s.answers[0]}.")
    assert abs(fact / len(context) - where) < 0.05


def test_variable_tracking_states_the_chain_in_order(haystack):
    s = ruler.samples("vt", 1, 0, haystack, 300, words)[0]
    a, b, c = s.answers
    value = s.prompt.rsplit("the value ", 1)[1].split(",")[0]
    assert s.prompt.index(f"VAR {a} = {value}.") < s.prompt.index(f"VAR {b} = VAR {a}.") < s.prompt.index(f"VAR {c} = VAR {b}.")


def test_the_common_words_are_the_most_common(haystack):
    text = "Alpha beta gamma delta. " + " ".join(f"Word{i}x yonder{i}z." for i in range(200))
    s = ruler.TASKS["cwe"](random.Random(0), ruler.Haystack(text, words), 200, words)
    listing = [line.split(". ", 1)[1] for line in s.prompt.splitlines() if line[:1].isdigit()]
    counts = {w: listing.count(w) for w in set(listing)}
    assert all(counts[w] == 16 for w in s.answers)
    assert max(c for w, c in counts.items() if w not in s.answers) == 2


def test_insert_places_needles_between_sentences():
    assert hs.insert(["A.", "B.", "C.", "D."], [(0.0, "x"), (0.5, "y"), (1.0, "z")]) == "x A. B. y C. D. z"
    with pytest.raises(ValueError, match="depth"):
        hs.insert(["A."], [(1.5, "x")])


def test_a_window_is_whole_consecutive_sentences(haystack):
    window = haystack.window(random.Random(1), 50)
    numbers = [int(s.split()[2]) for s in window]
    assert numbers == [(numbers[0] + i) % 400 for i in range(len(numbers))]
    assert sum(words(s) + 1 for s in window) <= 50 < sum(words(s) + 1 for s in window) + 12


@pytest.mark.parametrize("answers,output,expected", [
    (("123456",), "The number is 123456.", 1.0),
    (("123456",), "The number is 12345.", 0.0),
    (("Lisbon",), " lisbon, of course", 1.0),
    (("1", "2", "3", "4"), "1 and 3", 0.5),
    (("AAAAA", "BBBBB", "CCCCC"), "VAR AAAAA, VAR CCCCC", 2 / 3),
])
def test_string_match_all(answers, output, expected):
    assert ruler.string_match_all(answers, output) == pytest.approx(expected)


def test_string_match_all_needs_an_answer():
    with pytest.raises(ValueError):
        ruler.string_match_all((), "x")


def test_the_suite_score_averages_tasks_not_samples():
    rows = lambda texts: ([{"task": "a", "answers": ["x"], "text": t} for t in texts]  # noqa: E731
                          + [{"task": "b", "answers": ["y", "z"], "text": "y"}])
    out = summary.scores({"full": rows(["x", "x", "x", "no"]), "local-20%": rows(["x", "no", "no", "no"])})
    assert out["full"]["tasks"] == {"a": 0.75, "b": 0.5} and out["full"]["suite"] == pytest.approx(0.625)
    assert out["full"]["num_samples"] == {"a": 4, "b": 1}
    assert out["local-20%"]["suite"] == pytest.approx(0.375)
    assert out["local-20%"]["suite_ratio_to_full"] == pytest.approx(0.6)


def test_a_task_the_full_cache_cannot_do_is_left_out_of_the_suite():
    rows = lambda a, b: [{"task": "a", "answers": ["x"], "text": a}, {"task": "b", "answers": ["y"], "text": b}]  # noqa: E731
    out = summary.scores({"full": rows("x", "no"), "random-50%": rows("no", "y")})
    assert out["full"]["dead_tasks"] == ["b"] and out["full"]["suite"] == 1.0
    assert out["random-50%"]["tasks"]["b"] == 1.0 and out["random-50%"]["suite"] == 0.0


def test_no_ratio_where_the_full_cache_scores_nothing():
    rows = [{"task": "a", "answers": ["x"], "text": "no"}]
    assert summary.scores({"full": rows, "h2o-20%": rows})["h2o-20%"]["suite_ratio_to_full"] is None
