"""``ExpectedAttention`` (``score: expected``): the rule against kvpress's statement of it on
pre-RoPE queries (by hand, fp64), the worker's batched statement against the oracle's
token-by-token one (scores and keep-sets), the RoPE it reads, the step rules that hold its
query window (a recompute's too), and its refusals."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from vllm.exceptions import VLLMValidationError

from h2o_vllm.config import H2OConfig
from h2o_vllm.frontend.conflicts import check_score
from h2o_vllm.frontend.requests import check_request_fits
from h2o_vllm.oracle.cache import LayerCache
from h2o_vllm.policy import (prefill_step_limit, replay_step_limit, select_keep, step_compacts,
                             window_step_limit)
from h2o_vllm.scheduler.prefix_hits import unrecorded_hit
from h2o_vllm.score_modes import ExpectedAttention, Pooling, QueryContext
from h2o_vllm.score_modes.expected import FUTURE_POSITIONS, QUERY_WINDOW
from h2o_vllm.score_modes.rotary import Rotary, rotary_of

from flag_parsing import refused

THETA = 100.0


def rotary(head_size: int) -> Rotary:
    return Rotary(1.0 / THETA ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))


def rope_matrix(position: int, head_size: int) -> torch.Tensor:
    """HF's RoPE at ``position`` as a [d, d] fp64 matrix: x * cos + rotate_half(x) * sin."""
    half = head_size // 2
    angle = position * (1.0 / THETA ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
    swap = torch.zeros(head_size, head_size, dtype=torch.float64)
    swap[:half, half:], swap[half:, :half] = -torch.eye(half), torch.eye(half)
    return torch.diag(cos) + torch.diag(sin) @ swap


def kvpress_by_hand(pre_rope, keys, values, scale, end):
    """kvpress's ExpectedAttentionPress written again in fp64 on pre-RoPE queries ([Hkv, g, n, d])
    whose next position is ``end``: mean and covariance, the RoPE averaged over positions
    end .. end + FUTURE_POSITIONS - 1, exp(s k.mu + s^2/2 k^T Sigma k) normalised over the keys,
    averaged over the group, times the value's norm (no sinks left out, epsilon 0)."""
    heads, group, n, d = pre_rope.shape
    ahead = sum(rope_matrix(end + j, d) for j in range(FUTURE_POSITIONS)) / FUTURE_POSITIONS
    out = torch.zeros(heads, keys.shape[1], dtype=torch.float64)
    for h in range(heads):
        k = keys[h].double()
        for j in range(group):
            q = pre_rope[h, j].double()
            mu = q.mean(dim=0)
            sigma = (q - mu).T @ (q - mu) / n
            mu, sigma = ahead @ mu, ahead @ sigma @ ahead.T
            logits = scale * k @ mu + 0.5 * scale ** 2 * ((k @ sigma) * k).sum(dim=-1)
            out[h] += torch.softmax(logits, dim=-1) / group
    return out * values.double().norm(dim=-1)


def random_case(seed, heads=2, group=2, n=5, kv_len=12, d=8, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(heads, group, n, d, generator=gen) * spread
    keys = torch.randn(heads, kv_len, d, generator=gen)
    values = torch.randn(heads, kv_len, d, generator=gen) * torch.rand(heads, kv_len, 1, generator=gen) * 3
    return pre, keys, values


@pytest.mark.parametrize("n, end", [(1, 40), (5, 17), (9, 300)])
def test_the_score_is_kvpress_expected_attention_moved_from_post_rope_queries(n, end):
    """The engine sees queries after RoPE: rotating each by its distance to the last one, then
    by the average rotation over the next positions, is kvpress's rule on the pre-RoPE queries
    (rotations of one RoPE commute). One query (a decode step): covariance 0."""
    d = 8
    pre, keys, values = random_case(n, n=n, d=d)
    post = torch.stack([(rope_matrix(end - n + i, d) @ pre[..., i, :].double().unsqueeze(-1)).squeeze(-1)
                        for i in range(n)], dim=-2).float()
    context = QueryContext(values=values, queries=post, scale=d ** -0.5, rotate=rotary(d).cos_sin)
    want = kvpress_by_hand(pre, keys, values, d ** -0.5, end)
    for got in (ExpectedAttention().scores(keys, context), ExpectedAttention().oracle_scores(keys, context)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_a_zero_value_scores_zero_and_the_scores_sum_to_the_value_weighted_mass():
    pre, keys, values = random_case(0)
    values[:, 3] = 0
    context = QueryContext(values=values, queries=pre, scale=0.5, rotate=rotary(8).cos_sin)
    got = ExpectedAttention().scores(keys, context)
    assert got[:, 3].eq(0).all()
    ones = ExpectedAttention().scores(keys, QueryContext(values=torch.ones_like(values) / 8 ** 0.5,
                                                         queries=pre, scale=0.5, rotate=rotary(8).cos_sin))
    torch.testing.assert_close(ones.sum(dim=-1), torch.ones(2))  # unit values: the expected softmax


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n, kv_len, sinks, heavy, recent, pool", [(70, 40, 0, 6, 6, 1), (3, 23, 2, 5, 4, 5)])
def test_the_workers_scores_and_keep_sets_are_the_oracles(seed, n, kv_len, sinks, heavy, recent, pool):
    """Batched (the worker's, ``worker.key_scores``) and token by token (the oracle's, through
    ``LayerCache.compact`` with the last step's queries, which it cuts to the window): scores
    within 1e-6 and the same kept tokens per head."""
    heads, group, d = 2, 3, 16
    pre, keys, values = random_case(seed, heads, group, n, kv_len, d, spread=2.0)
    window = pre[..., -QUERY_WINDOW:, :]
    context = QueryContext(values=values, queries=window, scale=d ** -0.5, rotate=rotary(d).cos_sin)
    worker = ExpectedAttention().scores(keys[None], QueryContext(
        values=values[None], queries=window[None], scale=d ** -0.5, rotate=rotary(d).cos_sin))[0]
    torch.testing.assert_close(worker, ExpectedAttention().oracle_scores(keys, context), rtol=1e-5, atol=1e-6)
    # The due pass pads rows past their live slots (``DuePass.live``): the padding takes no share.
    pad = torch.randn(heads, 9, d, generator=torch.Generator().manual_seed(seed))
    padded = ExpectedAttention().scores(torch.cat([keys, pad], dim=1)[None], QueryContext(
        values=torch.cat([values, pad], dim=1)[None], queries=window[None], scale=d ** -0.5,
        rotate=rotary(d).cos_sin), live=(torch.arange(kv_len + 9) < kv_len)[None, None])[0, :, :kv_len]
    torch.testing.assert_close(padded, worker, rtol=1e-6, atol=1e-7)
    rank = (Pooling(pool),) if pool > 1 else ()
    keep = select_keep(worker, heavy, recent, sinks, rank)
    cache = LayerCache(heads, d)
    cache.append(keys, values, torch.arange(kv_len))
    cache.queries, cache.scale = pre.reshape(heads * group, n, d), d ** -0.5
    cache.compact(heavy, recent, sinks, rank, ExpectedAttention(), rotary(d).cos_sin)
    assert torch.equal(cache.positions, keep)


@pytest.mark.parametrize("rope_parameters", [{"rope_theta": 500.0, "rope_type": "default"},
                                             {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}])
def test_the_rotary_is_transformers_rope(rope_parameters):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope_parameters)
    deltas = torch.tensor([0, 1, 7, 511, 4000])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), deltas[None])
    got = rotary_of(config).cos_sin(deltas)
    torch.testing.assert_close(got[0], cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(got[1], sin[0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("hf, words", [
    (dict(model_type="gptj", rope_parameters={"rope_theta": 1e4}), "model_type 'gptj' is not among them"),
    (dict(model_type="llama", rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}),
     "this model's is 'yarn'"),
    (dict(model_type="llama", rope_parameters={"rope_theta": 1e4}, partial_rotary_factor=0.5),
     "rotates 0.5 of it"),
])
def test_a_rope_it_cannot_move_ahead_is_refused_naming_the_key_and_the_way_out(hf, words):
    with pytest.raises(ValueError, match=words) as info:
        rotary_of(SimpleNamespace(head_dim=8, **hf))
    assert "h2o.score 'expected'" in str(info.value) and "('h2o' or 'keydiff')" in str(info.value)


def test_gemma3_takes_the_full_attention_layers_rope():
    hf = SimpleNamespace(model_type="gemma3_text", head_dim=4, rope_parameters={
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}})
    torch.testing.assert_close(rotary_of(hf).inv_freq, torch.tensor([1.0, 1e-3]))


def _vllm_config(model_type="llama", step=2048, score=None):
    hf = SimpleNamespace(model_type=model_type, head_dim=8, rope_parameters={"rope_theta": 1e4})
    return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=step),
                           cache_config=SimpleNamespace(num_gpu_blocks=0),
                           additional_config={"h2o": {} if score is None else {"score": score}})


def test_a_step_smaller_than_the_window_or_a_foreign_rope_is_refused_before_load_and_per_request():
    check_score(_vllm_config(), "expected")
    check_score(_vllm_config("gptj", step=8), "keydiff")  # reads keys only
    with pytest.raises(ValueError, match=f"--max-num-batched-tokens is 8: raise it to {QUERY_WINDOW}"):
        check_score(_vllm_config(step=8), "expected")
    with pytest.raises(VLLMValidationError, match="h2o_score 'expected' moves queries ahead"):
        check_request_fits(_vllm_config("gptj"), 10, 4, {"h2o_score": "expected"})
    check_request_fits(_vllm_config("gptj"), 10, 4, {"h2o_score": "keydiff"})


def test_it_refuses_the_keys_that_only_weigh_attention_and_composes_with_pooling():
    refused({"score": "expected", "obs_window": 8}, "h2o.score 'expected' cannot be combined with h2o.obs_window")
    budget = H2OConfig.from_dict({"score": "expected", "pool_kernel": 5, "sink_tokens": 2}).budget(100, 16)
    assert budget.key_scorer == ExpectedAttention()


def test_a_prefix_hit_stops_before_the_first_compactions_query_window():
    budget = H2OConfig(score="expected", heavy_tokens=8, recent_tokens=8).budget(200, 16)
    assert unrecorded_hit(200, budget) == 200 - QUERY_WINDOW
    assert unrecorded_hit(20, H2OConfig(score="expected", heavy_tokens=8, recent_tokens=8).budget(20, 16)) == 0


@pytest.mark.parametrize("num_computed, offered, prompt_len, chunk, want", [
    (0, 300, 300, None, 300),    # the whole prompt in one step
    (0, 64, 300, None, 64),      # stops before the window (268..299): as offered
    (236, 40, 300, None, 32),    # would stop inside the window: stops at its start
    (268, 20, 300, None, 0),     # the window does not fit this step: not this step
    (268, 32, 300, None, 32),
    (280, 10, 300, None, 10),    # already inside (a step from before): as offered
    (0, 20, 48, 24, 0),          # a chunk shorter than the window runs whole
    (24, 24, 48, 24, 24),
    (0, 40, 100, 50, 18),        # a chunk of 50: its window is 18..49
    (300, 1, 300, None, 1),      # past the prompt: decode steps are one query
])
def test_the_step_that_ends_a_chunk_holds_its_query_window(num_computed, offered, prompt_len, chunk, want):
    assert QUERY_WINDOW == 32  # the cases' numbers
    assert window_step_limit(num_computed, offered, prompt_len, chunk, QUERY_WINDOW) == want
    assert window_step_limit(num_computed, offered, prompt_len, chunk, 0) == offered


def _steps(num_computed: int, end: int, prompt_len: int, budget, offers) -> list[tuple[int, int]]:
    """The (start, end) of the steps an Expected Attention request runs from ``num_computed``
    to ``end`` tokens when vLLM offers ``offers()`` tokens a step (its token budget), cut as
    ``scheduling.limit_step`` cuts them; a step given 0 waits for a larger offer."""
    steps = []
    while num_computed < end:
        offered = min(offers(), end - num_computed)
        limit = prefill_step_limit(num_computed, prompt_len, budget.prefill_chunk)
        n = offered if limit is None else min(offered, limit)
        n = min(n, replay_step_limit(num_computed, prompt_len, budget))
        n = window_step_limit(num_computed, n, prompt_len, budget.prefill_chunk, QUERY_WINDOW)
        if n:
            steps.append((num_computed, num_computed + n))
            num_computed += n
    return steps


def _compactions(steps, prompt_len: int, budget) -> list[tuple[int, int]]:
    """Each compaction as (tokens processed, first query the worker reads): the step's last
    ``QUERY_WINDOW`` queries (``worker.key_scores``)."""
    return [(b, max(a, b - QUERY_WINDOW)) for a, b in steps if step_compacts(a, b - a, prompt_len, budget)]


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 120), heavy=st.integers(1, 12), recent=st.integers(1, 12),
       interval=st.integers(1, 20), chunk=st.sampled_from([None, 7, 40]), outputs=st.integers(0, 40),
       preempted=st.integers(0, 160), data=st.data())
def test_a_recompute_compacts_where_and_from_the_queries_the_uninterrupted_run_did(
        prompt_len, heavy, recent, interval, chunk, outputs, preempted, data):
    """The prompt in vLLM's steps, then one token a step; preempted after ``preempted`` tokens
    and recomputed from 0 over the prompt and the outputs so far, in steps of whatever vLLM
    offers: the recompute compacts at the token counts where the uninterrupted run did, each
    time from the same queries (a decode compaction's one query), so it keeps what the
    uninterrupted run kept (docs/semantics.md, "Expected Attention", "Preemption")."""
    budget = H2OConfig(score="expected", heavy_tokens=heavy, recent_tokens=recent, interval=interval,
                       prefill_chunk=chunk).budget(prompt_len, 16)
    end = prompt_len + outputs
    preempted = min(preempted, end)

    def offers():
        return data.draw(st.integers(QUERY_WINDOW, 200))  # vLLM's token budget never below the window

    uninterrupted = _steps(0, prompt_len, prompt_len, budget, offers) + [(n, n + 1) for n in range(prompt_len, end)]
    recompute = _steps(0, preempted, prompt_len, budget, offers)
    assert _compactions(recompute, prompt_len, budget) == [
        c for c in _compactions(uninterrupted, prompt_len, budget) if c[0] <= preempted]


def test_a_recompute_stops_at_the_prompts_end_and_runs_each_compacting_decode_token_alone():
    # The CUDA path's case: 17 tokens compact to 16 at the prompt's end, then every token does.
    budget = H2OConfig(score="expected", heavy_tokens=8, recent_tokens=8, interval=1).budget(17, 16)
    assert [replay_step_limit(n, 17, budget) for n in (0, 5, 17, 18, 30)] == [17, 12, 1, 1, 1]
    # Interval 4: the prompt's end finds 17 < 20 tokens; the 20th token compacts, then every 4th.
    budget = H2OConfig(score="expected", heavy_tokens=8, recent_tokens=8, interval=4).budget(17, 16)
    assert [replay_step_limit(n, 17, budget) for n in (0, 17, 18, 19, 20, 23)] == [17, 2, 1, 1, 3, 1]
