"""The shared H2O rules: live KV length (cadence) and the per-head keep-set (pure, no vLLM)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from h2o_vllm import policy
from h2o_vllm.config import H2OConfig
from h2o_vllm.policy import first_compaction, kv_len_after, live_kv_len, peak_kv_len, select_keep
from h2o_vllm.score_modes import Pooling

# --------------------------------------------------------------------------- live_kv_len

prompt_lens = st.integers(0, 300)
budgets = st.integers(1, 120)
intervals = st.integers(1, 48)


def _lives(prompt_len, budget_tokens, interval, upto):
    return [live_kv_len(n, prompt_len, budget_tokens, interval) for n in range(upto + 1)]


def _horizon(prompt_len, budget_tokens, interval):
    return max(prompt_len, budget_tokens + interval) + 4 * interval + 3


@given(prompt_len=prompt_lens, budget_tokens=budgets, interval=intervals)
def test_live_len_invariants(prompt_len, budget_tokens, interval):
    upto = _horizon(prompt_len, budget_tokens, interval)
    live = _lives(prompt_len, budget_tokens, interval, upto)
    for n, value in enumerate(live):
        assert isinstance(value, int)
        if n < prompt_len:
            assert value == n, "evicted during the prompt"
        else:
            assert value <= budget_tokens + interval
            assert value >= min(n, budget_tokens)
        assert value <= n


@given(prompt_len=prompt_lens, budget_tokens=budgets, interval=intervals, data=st.data())
def test_live_len_never_grows_faster_than_tokens_written(prompt_len, budget_tokens, interval, data):
    upto = _horizon(prompt_len, budget_tokens, interval)
    live = _lives(prompt_len, budget_tokens, interval, upto)
    # One token at a time (which implies every q by induction): the worker can only compact,
    # never invent tokens.
    for n in range(upto):
        assert live[n + 1] <= live[n] + 1, n
    # Explicit pairs (n, n + q): inside the horizon, and far-away jumps (a big prefill chunk,
    # a recompute after preemption).
    for _ in range(5):
        n = data.draw(st.integers(0, upto), label="n")
        q = data.draw(st.integers(0, upto - n), label="q")
        assert live[n + q] <= live[n] + q, (n, q)
        n = data.draw(st.integers(0, 10**6), label="far n")
        q = data.draw(st.integers(0, 10**6), label="far q")
        assert (live_kv_len(n + q, prompt_len, budget_tokens, interval)
                <= live_kv_len(n, prompt_len, budget_tokens, interval) + q)


@given(budget_tokens=budgets, extra=st.integers(1, 200), n_after=st.integers(0, 500))
def test_interval_one_is_exactly_the_budget_after_a_longer_prompt(budget_tokens, extra, n_after):
    prompt_len = budget_tokens + extra  # L > budget
    assert live_kv_len(prompt_len - 1, prompt_len, budget_tokens, 1) == prompt_len - 1
    assert live_kv_len(prompt_len + n_after, prompt_len, budget_tokens, 1) == budget_tokens


@given(prompt_len=prompt_lens, budget_tokens=budgets, interval=intervals)
def test_compaction_cadence(prompt_len, budget_tokens, interval):
    upto = _horizon(prompt_len, budget_tokens, interval)
    live = _lives(prompt_len, budget_tokens, interval, upto)
    compactions = [n for n in range(1, upto + 1) if live[n] < live[n - 1] + 1]
    first = max(prompt_len, budget_tokens + interval)
    assert first_compaction(prompt_len, budget_tokens, interval) == first
    assert compactions, "never compacted"
    assert compactions[0] == first
    assert all(n >= prompt_len for n in compactions)
    assert all(b - a == interval for a, b in zip(compactions, compactions[1:]))
    assert compactions[-1] + interval > upto  # none missing at the end of the horizon
    assert all(live[n] == budget_tokens for n in compactions)


@pytest.mark.parametrize("prompt_len, budget_tokens, interval, expected", [
    # L=10, B=4, I=3: grows to 10 in the prompt, compacts at 10, then every 3 tokens.
    (10, 4, 3, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 5, 6, 4, 5, 6, 4]),
    # L=3 below the budget: grows until B+I=7, compacts to 4.
    (3, 4, 3, [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5]),
    # Paper cadence.
    (6, 2, 1, [0, 1, 2, 3, 4, 5, 2, 2, 2, 2]),
    # B < L < B + I: no compaction at the prompt end, first one at B + I.
    (5, 3, 4, [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 3]),
])
def test_live_len_examples(prompt_len, budget_tokens, interval, expected):
    assert _lives(prompt_len, budget_tokens, interval, len(expected) - 1) == expected


@given(rows=st.lists(st.tuples(st.integers(0, 2000), prompt_lens, budgets, intervals),
                     min_size=1, max_size=40))
def test_tensor_path_equals_int_path(rows):
    n, prompt_len, budget_tokens, interval = (torch.tensor(col, dtype=torch.int64) for col in zip(*rows))
    got = live_kv_len(n, prompt_len, budget_tokens, interval)
    assert got.dtype == torch.int64
    assert got.shape == n.shape
    expected = [live_kv_len(*row) for row in rows]
    assert got.tolist() == expected


@given(ns=st.lists(st.integers(0, 2000), min_size=1, max_size=40),
       prompt_len=prompt_lens, budget_tokens=budgets, interval=intervals)
def test_tensor_path_with_scalar_parameters(ns, prompt_len, budget_tokens, interval):
    got = live_kv_len(torch.tensor(ns, dtype=torch.int64), prompt_len, budget_tokens, interval)
    assert got.dtype == torch.int64
    assert got.tolist() == [live_kv_len(n, prompt_len, budget_tokens, interval) for n in ns]


@given(n=st.integers(0, 3000), prompt_len=st.integers(0, 1000),
       heavy_ratio=st.sampled_from([0, 0.05, 0.1, 0.3]), recent_tokens=st.integers(1, 64),
       interval=st.one_of(st.none(), st.integers(1, 32)), block_size=st.sampled_from([1, 16, 32]))
def test_kv_len_after_matches_live_kv_len(n, prompt_len, heavy_ratio, recent_tokens, interval, block_size):
    cfg = H2OConfig(heavy_ratio=heavy_ratio, recent_tokens=recent_tokens, interval=interval, min_tokens=0)
    budget = cfg.budget(prompt_len, block_size)
    heavy, recent = cfg.part_budget("heavy", prompt_len), cfg.part_budget("recent", prompt_len)
    assert (budget.heavy, budget.recent, budget.tokens) == (heavy, recent, heavy + recent)
    step = interval if interval is not None else block_size
    assert budget.interval == step
    assert kv_len_after(n, prompt_len, budget) == live_kv_len(n, prompt_len, heavy + recent, step)


def test_kv_len_after_default_interval_is_one_block():
    cfg = H2OConfig(heavy_tokens=8, recent_tokens=8)
    lens = [kv_len_after(n, 100, cfg.budget(100, 16)) for n in range(100, 140)]
    assert lens[0] == 16                      # compacted at the end of the 100-token prompt
    assert max(lens) == 16 + 15
    # An explicit interval=1 (the paper's per-step eviction) wins over the block.
    per_step = H2OConfig(heavy_tokens=8, recent_tokens=8, interval=1).budget(100, 16)
    assert [kv_len_after(n, 100, per_step) for n in range(100, 105)] == [16] * 5


@given(prompt_len=st.integers(1, 200), max_new=st.integers(0, 300), heavy=st.integers(0, 40),
       recent=st.integers(1, 40), interval=st.integers(1, 40))
def test_peak_kv_len_is_the_largest_step(prompt_len, max_new, heavy, recent, interval):
    """What the scheduler reserves per running sequence: the most slots one decode step needs
    (live length before it + the token it writes), brute-forced over the whole sequence."""
    config = H2OConfig.from_dict({"heavy_tokens": heavy, "recent_tokens": recent, "interval": interval})
    budget = config.budget(prompt_len, 16)
    assert budget.interval == interval
    max_len = prompt_len + max_new
    steps = [kv_len_after(n, prompt_len, budget) + 1 for n in range(prompt_len, max_len)]
    assert peak_kv_len(prompt_len, max_len, budget) == max(steps, default=prompt_len)
    assert peak_kv_len(prompt_len, max_len, budget) <= max(prompt_len, heavy + recent + interval)


# --------------------------------------------------------------------------- select_keep


def _reference_keep(row: list[float], heavy: int, recent: int, sinks: int = 0, pool: int = 1) -> list[int]:
    """Sinks first, then the paper's pick (highest first, ties to the more recent token) on each
    candidate's best score within pool // 2 candidates of it (candidates: between the sinks and
    the recent window)."""
    n = len(row)
    num_sinks = min(sinks, n)
    num_recent = min(recent, n - num_sinks)
    candidates = list(range(num_sinks, n - num_recent))
    half = pool // 2
    rank = {t: max(row[u] for u in candidates[max(0, i - half): i + half + 1])
            for i, t in enumerate(candidates)}
    ranked = sorted(candidates, key=lambda t: (-rank[t], -t))
    return list(range(num_sinks)) + sorted(ranked[:heavy]) + list(range(n - num_recent, n))


# Few distinct values, so ties are frequent; plus arbitrary finite fp32 values.
score_values = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                         st.floats(-1e6, 1e6, allow_nan=False, width=32))


@st.composite
def score_batches(draw, max_lead_dims=2):
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=max_lead_dims))
    n = draw(st.integers(0, 40))
    count = 1
    for dim in lead:
        count *= dim
    values = draw(st.lists(score_values, min_size=count * n, max_size=count * n))
    return torch.tensor(values, dtype=torch.float32).reshape(*lead, n)


@settings(max_examples=300, deadline=None)
@given(scores=score_batches(), heavy=st.integers(0, 30), recent=st.integers(0, 30))
def test_select_keep_properties(scores, heavy, recent):
    n = scores.shape[-1]
    keep = select_keep(scores, heavy, recent)
    assert keep.dtype == torch.int64
    # Same count for every head.
    assert keep.shape == (*scores.shape[:-1], min(n, heavy + recent))
    num_heads = math.prod(scores.shape[:-1])
    rows = scores.reshape(num_heads, n).tolist()
    kept_rows = keep.reshape(num_heads, keep.shape[-1]).tolist()
    num_recent = min(recent, n)
    for row, kept in zip(rows, kept_rows):
        assert kept == sorted(kept) and len(set(kept)) == len(kept)   # ascending, distinct
        assert all(0 <= t < n for t in kept)
        assert set(range(n - num_recent, n)) <= set(kept)             # recent window kept
        if n <= heavy + recent:
            assert kept == list(range(n))
        assert kept == _reference_keep(row, heavy, recent)            # top-heavy, ties -> recent


@given(scores=score_batches(max_lead_dims=0), heavy=st.integers(0, 30), recent=st.integers(0, 30))
def test_select_keep_heavy_part_is_top_scores(scores, heavy, recent):
    n = scores.shape[-1]
    keep = select_keep(scores, heavy, recent).tolist()
    num_older = n - min(recent, n)
    heavy_part = [t for t in keep if t < num_older]
    dropped = [t for t in range(num_older) if t not in heavy_part]
    assert len(heavy_part) == min(heavy, num_older)
    for kept in heavy_part:
        for gone in dropped:
            # Every kept older token beats every dropped one; equal scores keep the more recent.
            assert scores[kept] > scores[gone] or (scores[kept] == scores[gone] and kept > gone)


def test_select_keep_explicit_ties():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert select_keep(scores, 2, 1).tolist() == [2, 3, 5]
    # All equal: heavy takes the most recent of the older tokens.
    assert select_keep(torch.zeros(10), 3, 2).tolist() == [5, 6, 7, 8, 9]
    # A strictly higher old score still wins over a tie group.
    scores = torch.tensor([5.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0])
    assert select_keep(scores, 2, 2).tolist() == [0, 4, 5, 6]
    # The recent window is kept even with the lowest scores.
    scores = torch.tensor([9.0, 8.0, 7.0, 0.0, 0.0])
    assert select_keep(scores, 1, 2).tolist() == [0, 3, 4]


def test_select_keep_per_head_sets_same_count():
    # [layers=2, heads=3, n=6]: each head its own set, every head the same count.
    scores = torch.tensor([
        [[9, 0, 0, 0, 0, 0], [0, 0, 9, 0, 0, 0], [0, 0, 0, 0, 9, 0]],
        [[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1], [0, 0, 0, 0, 0, 0]],
    ], dtype=torch.float32)
    keep = select_keep(scores, heavy=1, recent=2)
    assert keep.shape == (2, 3, 3)
    assert keep.tolist() == [
        [[0, 4, 5], [2, 4, 5], [3, 4, 5]],
        [[3, 4, 5], [0, 4, 5], [3, 4, 5]],
    ]


@pytest.mark.parametrize("n, heavy, recent, expected", [
    (0, 3, 3, []),
    (4, 3, 3, [0, 1, 2, 3]),
    (6, 3, 3, [0, 1, 2, 3, 4, 5]),
    (5, 0, 2, [3, 4]),       # recent-only
    (5, 2, 0, [3, 4]),       # heavy-only on equal scores keeps the most recent
    (5, 0, 0, []),
])
def test_select_keep_small_cases(n, heavy, recent, expected):
    keep = select_keep(torch.zeros(2, n), heavy, recent)
    assert keep.shape == (2, len(expected))
    assert keep.tolist() == [expected, expected]


def test_select_keep_does_not_modify_scores():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0, 5.0]])
    before = scores.clone()
    select_keep(scores, 2, 1)
    assert torch.equal(scores, before)



@settings(max_examples=300, deadline=None)
@given(scores=score_batches(), heavy=st.integers(0, 30), recent=st.integers(0, 30),
       sinks=st.integers(0, 6), pool=st.sampled_from([1, 3, 5, 15]))
def test_select_keep_sinks_and_pooling(scores, heavy, recent, sinks, pool):
    n = scores.shape[-1]
    keep = select_keep(scores, heavy, recent, sinks, (Pooling(pool),))
    assert keep.shape == (*scores.shape[:-1], min(n, sinks + heavy + recent))
    num_heads = math.prod(scores.shape[:-1])
    for row, kept in zip(scores.reshape(num_heads, n).tolist(),
                         keep.reshape(num_heads, keep.shape[-1]).tolist()):
        assert kept == _reference_keep(row, heavy, recent, sinks, pool)


def test_pooling_keeps_the_neighbours_of_a_peak():
    # One peak at 3 among flat candidates: pooled over 3 it lifts 2, 3 and 4 alike; ties keep
    # the more recent, so heavy=2 keeps 3 and 4 (unpooled: the peak and the newest flat token).
    scores = torch.tensor([0.0, 0.1, 0.1, 5.0, 0.1, 0.1, 0.1, 0.0])
    assert select_keep(scores, 2, 1).tolist() == [3, 6, 7]
    assert select_keep(scores, 2, 1, rank=(Pooling(3),)).tolist() == [3, 4, 7]
    assert select_keep(scores, 3, 1, rank=(Pooling(3),)).tolist() == [2, 3, 4, 7]
    # Pooling never reaches into the sinks or the recent window: token 7's score is not a candidate's.
    scores = torch.tensor([9.0, 0.0, 0.2, 0.0, 0.0, 0.3, 0.0, 9.0])
    assert select_keep(scores, 1, 1, sink_tokens=1, rank=(Pooling(3),)).tolist() == [0, 6, 7]


# --------------------------------------------------------------------------- prefill_chunk

chunks = st.one_of(st.none(), st.integers(1, 64))


def _walk(prompt_len, budget_tokens, interval, chunk, upto):
    """The rule, one token at a time (independent of the closed form): a check at the end of
    each prefill chunk (multiples of ``chunk`` inside the prompt, the prompt's end) and after
    every later token; a check finding budget + interval tokens or more compacts to the
    budget. Returns (live length after each token count, the length before each prompt check)."""
    live, lives, prompt_checks = 0, [0], []
    for t in range(1, upto + 1):
        live += 1
        in_prompt_check = t <= prompt_len and (t == prompt_len or (chunk and t % chunk == 0))
        if in_prompt_check:
            prompt_checks.append(live)
        if (t >= prompt_len or in_prompt_check) and live >= budget_tokens + interval:
            live = budget_tokens
        lives.append(live)
    return lives, prompt_checks


@given(prompt_len=prompt_lens, budget_tokens=budgets, interval=intervals, chunk=chunks)
def test_closed_form_is_the_rule_walked_token_by_token(prompt_len, budget_tokens, interval, chunk):
    upto = _horizon(prompt_len, budget_tokens, interval)
    walked, _ = _walk(prompt_len, budget_tokens, interval, chunk, upto)
    assert [live_kv_len(n, prompt_len, budget_tokens, interval, chunk) for n in range(upto + 1)] == walked
    drops = [n for n in range(1, upto + 1) if walked[n] < walked[n - 1] + 1]
    assert first_compaction(prompt_len, budget_tokens, interval, chunk) == drops[0]


@given(rows=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 300), budgets, intervals,
                               st.integers(1, 64)), min_size=1, max_size=40))
def test_chunked_tensor_path_equals_int_path(rows):
    n, prompt_len, budget_tokens, interval, chunk = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows))
    assert live_kv_len(n, prompt_len, budget_tokens, interval, chunk).tolist() == [
        live_kv_len(*row) for row in rows]
    assert first_compaction(prompt_len, budget_tokens, interval, chunk).tolist() == [
        first_compaction(*row[1:]) for row in rows]


@given(prompt_len=st.integers(1, 300), budget_tokens=budgets, interval=intervals, chunk=chunks,
       decode=st.integers(0, 100))
def test_peaks_are_the_walked_maxima(prompt_len, budget_tokens, interval, chunk, decode):
    from h2o_vllm.config import Budget
    from h2o_vllm.policy import prompt_peak_kv_len
    budget = Budget(heavy=budget_tokens, recent=0, interval=interval, prefill_chunk=chunk)
    max_len = prompt_len + decode
    walked, prompt_checks = _walk(prompt_len, budget_tokens, interval, chunk, max_len)
    assert prompt_peak_kv_len(prompt_len, budget) == max(prompt_checks)
    if chunk is None:
        assert prompt_peak_kv_len(prompt_len, budget) == prompt_len
    else:  # what a chunked prompt's admission rests on: never more than one chunk past the cadence
        assert prompt_peak_kv_len(prompt_len, budget) <= budget_tokens + interval + chunk - 1
    decode_steps = [walked[t] + 1 for t in range(prompt_len, max_len)]
    expected = max(decode_steps) if decode_steps else max(prompt_checks)
    assert peak_kv_len(prompt_len, max_len, budget) == expected


def test_chunked_examples():
    # P=20, B=4, I=2, C=5: checks at 5 (5 < 6), 10 (10 -> 4), 15 (9 -> 4), 20 (9 -> 4).
    lives = [live_kv_len(n, 20, 4, 2, 5) for n in range(24)]
    assert lives == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5, 4, 5]
    assert first_compaction(20, 4, 2, 5) == 10
    # A chunk at least the prompt is the prompt held whole.
    assert [live_kv_len(n, 20, 4, 2, 20) for n in range(24)] == [live_kv_len(n, 20, 4, 2) for n in range(24)]


# --------------------------------------------------------------------------- speculative decoding

@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 120), heavy=st.integers(1, 12), recent=st.integers(1, 12),
       interval=st.integers(1, 20), chunk=st.sampled_from([None, 7, 32]), drafts=st.integers(1, 6),
       data=st.data())
def test_draft_steps_never_hold_a_compaction(prompt_len, heavy, recent, interval, chunk, drafts, data):
    """Whatever the speculator proposes and the target accepts, a step with drafts never
    reaches a compaction (it grows the cache by exactly its tokens), and every compaction
    still comes where plain decoding has it: in a step of one token."""
    budget = H2OConfig(heavy_tokens=heavy, recent_tokens=recent, interval=interval,
                       prefill_chunk=chunk).budget(prompt_len, 16)
    n, end = prompt_len, prompt_len + 60
    compactions = []
    while n < end:
        q = min(1 + drafts, policy.draft_step_limit(n, prompt_len, budget))
        before, after = kv_len_after(n, prompt_len, budget), kv_len_after(n + q, prompt_len, budget)
        if q > 1:
            assert after == before + q
        accepted = data.draw(st.integers(0, q - 1))  # of the q - 1 drafts
        if after < before + q:
            compactions.append(n + q)
        n += 1 + accepted
    plain = [m for m in range(prompt_len + 1, end + 1)
             if kv_len_after(m, prompt_len, budget) < kv_len_after(m - 1, prompt_len, budget) + 1]
    assert compactions == [m for m in plain if m <= n]
    if interval == 1:  # the paper's per-step eviction: once compacting, no step has room for a draft
        first = policy.first_compaction(prompt_len, budget.tokens, 1, chunk)
        assert all(policy.draft_step_limit(m, prompt_len, budget) == 1 for m in range(max(first, prompt_len), end))


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 120), heavy=st.integers(1, 12), recent=st.integers(1, 12),
       interval=st.integers(1, 20), chunk=st.sampled_from([None, 7, 32]), start=st.integers(0, 200),
       tokens=st.integers(1, 8))
def test_a_step_compacts_when_one_of_its_tokens_would_alone(prompt_len, heavy, recent, interval, chunk, start,
                                                            tokens):
    """``step_compacts`` (the scheduler's async-drafts rule asks it) agrees with the cadence
    walked one token at a time over the step's tokens."""
    budget = H2OConfig(heavy_tokens=heavy, recent_tokens=recent, interval=interval,
                       prefill_chunk=chunk).budget(prompt_len, 16)
    start = max(start, prompt_len)  # steps that may hold drafts: past the prompt
    one_by_one = any(kv_len_after(m, prompt_len, budget) < kv_len_after(m - 1, prompt_len, budget) + 1
                     for m in range(start + 1, start + tokens + 1))
    assert policy.step_compacts(start, tokens, prompt_len, budget) == one_by_one
