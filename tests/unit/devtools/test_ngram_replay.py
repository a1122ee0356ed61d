"""h2o_devtools.ngram_replay: n-gram drafts replayed on a finished greedy sequence, with and
without H2O's draft cut (benchmarks/speculative.py checks the cut replay against vLLM's own
counters on every run)."""
from h2o_devtools.ngram_replay import NgramDrafter, replay
from h2o_vllm.config import Budget

PASSAGE = list(range(10, 20))
PROMPT = PASSAGE + PASSAGE[:3]  # ends three tokens into a copy
OUTPUT = PASSAGE[3:]            # and the model copies on
DRAFTER = NgramDrafter(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4, max_model_len=64)


def test_a_copy_accepts_every_draft_but_those_past_the_output():
    # Step 1 drafts PASSAGE[4:7] (all generated next); step 2 drafts PASSAGE[8:10] + PASSAGE[0],
    # whose last token lies past the output's end.
    assert replay(PROMPT, OUTPUT, DRAFTER) == (6, 5)


def test_h2os_cut_shortens_the_step_that_would_reach_a_compaction():
    # 8 kept tokens, compacting when the cache reaches 16: the 13-token prompt stays whole, the
    # first step (from 13) may hold 2 tokens (one draft), the next two (from 14 and 15: the
    # token that compacts) none; after the compaction three drafts fit again.
    budget = Budget(heavy=4, recent=4, interval=8)
    assert replay(PROMPT, OUTPUT, DRAFTER, budget) == (4, 4)


def test_no_match_drafts_nothing():
    assert replay([1, 2, 3, 4], [5, 6, 7], DRAFTER) == (0, 0)


def test_missing_lookup_bounds_are_vllms_defaults():
    assert NgramDrafter.from_config({"num_speculative_tokens": 2, "prompt_lookup_max": 4}, 64) == \
        NgramDrafter(2, 4, 4, 64)
    assert NgramDrafter.from_config({"num_speculative_tokens": 2}, 64) == NgramDrafter(2, 5, 5, 64)
