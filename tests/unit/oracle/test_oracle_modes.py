"""The dense oracle's score modes past the paper (decay, sinks, observation window, min_tokens)
against the naive twin, which implements each of them from scratch.

Spec (the one the engine implements too): queries in order, each does
``s(t) <- decay * s(t) + w_i * p_i(t)`` for every live token (``w_i = oracle.cache.query_weight``: 0 for
a prompt query before the prompt's last ``obs_window``, else 1); compaction keeps the ``sinks``
first logical tokens, the ``recent`` newest and the ``heavy`` best-scored of the rest, back to
``Budget.tokens``; ``min_tokens`` grows ``recent``. Each mode must change what paper H2O keeps on
this model (else matching the twin would prove nothing), and paper H2O must be bit-identical
when a mode is set to its neutral value.
"""
from __future__ import annotations

import pytest
import torch

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import H2OOracle, LayerCache
from h2o_vllm.oracle.attention import attend_and_score
from naive_h2o import naive_generate, naive_score
from test_oracle import CHUNK, NEW_TOKENS, NUM_KV_HEADS, NUM_LAYERS, model, prompts  # noqa: F401 (fixtures)

#: name -> (mode config, its paper counterpart: the same budget with the mode left unset)
MODES = {
    "decay-0.9": (dict(heavy_tokens=4, recent_tokens=4, decay=0.9),
                  dict(heavy_tokens=4, recent_tokens=4)),
    "sinks-4-streaming": (dict(sink_tokens=4, heavy_ratio=0, recent_tokens=8),
                          dict(heavy_ratio=0, recent_tokens=8)),
    "sinks-4+heavy": (dict(sink_tokens=4, heavy_tokens=4, recent_tokens=4),
                      dict(heavy_tokens=4, recent_tokens=4)),
    "obs-window-8": (dict(heavy_tokens=4, recent_tokens=4, obs_window=8),
                     dict(heavy_tokens=4, recent_tokens=4)),
    "min-tokens-32": (dict(heavy_ratio=0.1, recent_ratio=0.1, min_tokens=32),
                      dict(heavy_ratio=0.1, recent_ratio=0.1, min_tokens=0)),
    "decay+sinks+window": (dict(heavy_tokens=6, recent_tokens=4, decay=0.95, sink_tokens=2, obs_window=8),
                           dict(heavy_tokens=6, recent_tokens=4)),
    "pool-5": (dict(heavy_tokens=6, recent_tokens=4, pool_kernel=5),
               dict(heavy_tokens=6, recent_tokens=4)),
    "pool-3+window+sinks": (dict(heavy_tokens=6, recent_tokens=4, pool_kernel=3, obs_window=8, sink_tokens=2),
                            dict(heavy_tokens=6, recent_tokens=4, obs_window=8, sink_tokens=2)),
}
CASES = [(name, 1) for name in MODES] + [("sinks-4+heavy", 16), ("decay+sinks+window", 16), ("pool-5", 16)]


def kept_positions(states) -> list:
    return [[layer.positions.tolist() for layer in state.layers] for state in states]


@pytest.mark.parametrize("mode,interval", CASES, ids=[f"{m}-interval-{i}" for m, i in CASES])
def test_modes_match_naive(model, prompts, mode, interval):
    config = H2OConfig(**MODES[mode][0], interval=interval)
    ref = H2OOracle(model, config, query_chunk=CHUNK)
    got = ref.generate(prompts, NEW_TOKENS)
    compacted = 0
    for prompt, tokens, state in zip(prompts, got, ref.last_states):
        want, naive = naive_generate(model, config, prompt, NEW_TOKENS)
        assert tokens == want, f"prompt_len={len(prompt)}"
        assert state.kv_len == naive.expected_kv_len()
        compacted += state.kv_len < state.num_tokens
        for layer in range(NUM_LAYERS):
            cache = state.layers[layer]
            for kv_head in range(NUM_KV_HEADS):
                positions, scores = naive.kept(layer, kv_head)
                assert cache.positions[kv_head].tolist() == positions, (len(prompt), layer, kv_head)
                torch.testing.assert_close(cache.scores[kv_head], torch.tensor(scores, dtype=torch.float32),
                                           rtol=1e-3, atol=1e-4)
                sinks = state.budget.sink_tokens
                assert cache.positions[kv_head, :sinks].tolist() == list(range(sinks))
    assert compacted >= 2


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_changes_what_paper_h2o_keeps(model, prompts, mode):
    """Otherwise the equality with the twin would not tell the mode's arithmetic apart."""
    with_mode, paper = (H2OOracle(model, H2OConfig(**kwargs, interval=1), query_chunk=CHUNK)
                        for kwargs in MODES[mode])
    with_mode.generate(prompts, NEW_TOKENS)
    paper.generate(prompts, NEW_TOKENS)
    assert kept_positions(with_mode.last_states) != kept_positions(paper.last_states)
    for a, b in zip(with_mode.last_states, paper.last_states):
        if mode.startswith("min-tokens"):
            assert a.budget.tokens == max(32, b.budget.tokens)
            assert a.kv_len >= min(32, a.num_tokens) and b.kv_len < 32
        else:
            assert a.budget.tokens == b.budget.tokens + a.budget.sink_tokens - b.budget.sink_tokens


def test_decay_and_window_change_generated_tokens(model, prompts):
    """Stronger than the kept sets: the modes reach the output tokens on this model."""
    outputs = {}
    for mode in ("decay-0.9", "obs-window-8", "sinks-4+heavy", "pool-5"):
        with_mode, paper = (H2OOracle(model, H2OConfig(**kwargs, interval=1), query_chunk=CHUNK)
                            for kwargs in MODES[mode])
        outputs[mode] = (with_mode.generate(prompts, NEW_TOKENS), paper.generate(prompts, NEW_TOKENS))
    assert any(a != b for a, b in outputs.values())


def test_sinks_are_kept_at_every_step(model, prompts):
    """StreamingLLM (sinks + recent, no heavy) with per-step eviction: after every step each
    (layer, KV head) holds exactly the sinks and the most recent tokens."""
    sinks, recent = 4, 8
    ref = H2OOracle(model, H2OConfig(sink_tokens=sinks, heavy_ratio=0, recent_tokens=recent, interval=1))
    prompt = prompts[2]
    state = ref.new_state(len(prompt))
    logits = ref.step(state, prompt)
    for _ in range(NEW_TOKENS):
        n = state.num_tokens
        want = list(range(sinks)) + list(range(n - recent, n)) if n >= sinks + recent + 1 else list(range(n))
        for layer in state.layers:
            assert layer.positions.tolist() == [want] * NUM_KV_HEADS
        logits = ref.step(state, [int(logits.argmax())])


def test_sinks_with_heavy_keep_sinks_and_count(model, prompts):
    config = H2OConfig(sink_tokens=4, heavy_tokens=4, recent_tokens=4, interval=3)
    ref = H2OOracle(model, config, query_chunk=CHUNK)
    prompt = prompts[3]
    state = ref.new_state(len(prompt))
    logits = ref.step(state, prompt)  # 64 >= 12 + 3: the prefill step compacts to 12
    assert state.kv_len == 12
    for _ in range(NEW_TOKENS):
        assert state.kv_len == 12 + (state.num_tokens - 64) % 3  # cadence on budget.tokens
        for layer in state.layers:
            assert layer.positions[:, :4].tolist() == [[0, 1, 2, 3]] * NUM_KV_HEADS
        logits = ref.step(state, [int(logits.argmax())])


def test_min_tokens_floor_on_short_prompt(model, prompts):
    """23-token prompt, 10% + 10% (2 + 2): the floor grows recent to 30, so the cache compacts
    back to 32 tokens (sinks + heavy + recent), the newest 30 of them kept as the recent part."""
    config = H2OConfig(heavy_ratio=0.1, recent_ratio=0.1, min_tokens=32, interval=1)
    ref = H2OOracle(model, config, query_chunk=CHUNK)
    got = ref.generate([prompts[1]], NEW_TOKENS)
    state = ref.last_states[0]
    assert (state.budget.heavy, state.budget.recent, state.budget.tokens) == (2, 30, 32)
    assert state.num_tokens == 46 and state.kv_len == 32
    for layer in state.layers:
        assert layer.positions[:, 2:].tolist() == [list(range(16, 46))] * NUM_KV_HEADS
    want, naive = naive_generate(model, config, prompts[1], NEW_TOKENS)
    assert got[0] == want and naive.expected_kv_len() == 32
    # A prompt whose budget already exceeds the floor is unaffected.
    long = H2OOracle(model, H2OConfig(heavy_ratio=0.3, recent_ratio=0.3, min_tokens=32, interval=1))
    assert long.new_state(64).budget.tokens == 19 + 19


def test_neutral_modes_are_bit_identical_to_paper(model, prompts):
    """decay 1, sink_tokens 0, an observation window covering the prompt, a floor under the
    budget, a pool of 1: the paper's arithmetic path itself, so scores are equal bit for bit."""
    base = dict(heavy_tokens=4, recent_tokens=4, interval=1)
    paper = H2OOracle(model, H2OConfig(**base), query_chunk=CHUNK)
    neutral = H2OOracle(model, H2OConfig(**base, decay=1.0, sink_tokens=0, obs_window=64, min_tokens=8,
                                         pool_kernel=1),
                        query_chunk=CHUNK)
    assert paper.generate(prompts, NEW_TOKENS) == neutral.generate(prompts, NEW_TOKENS)
    for a, b in zip(paper.last_states, neutral.last_states):
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.positions, lb.positions)
            assert torch.equal(la.scores, lb.scores)


def test_modes_prefill_chunking_does_not_change_results(model, prompts):
    config = H2OConfig(**MODES["decay+sinks+window"][0], interval=1)
    chunked, whole = H2OOracle(model, config, query_chunk=5), H2OOracle(model, config, query_chunk=4096)
    assert chunked.generate(prompts, 8) == whole.generate(prompts, 8)
    for a, b in zip(chunked.last_states, whole.last_states):
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.positions, lb.positions)
            torch.testing.assert_close(la.scores, lb.scores, rtol=1e-5, atol=1e-5)


def test_modes_score_matches_naive(model, prompts):
    prompt, continuation = prompts[2], prompts[3][:20]
    config = H2OConfig(**MODES["decay+sinks+window"][0], interval=1)
    got = H2OOracle(model, config).score(prompt, continuation)
    torch.testing.assert_close(got, naive_score(model, config, prompt, continuation), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decay", [1.0, 0.8], ids=["decay-1", "decay-0.8"])
@pytest.mark.parametrize("window", [False, True], ids=["all-queries", "window"])
def test_attend_and_score_follows_the_sequential_definition(decay, window):
    """One step of 10 queries in chunks of 4 over 7 older tokens with scores: equal to running
    the queries one by one, s <- decay * s + w_i * p_i, p_i summed over the GQA group."""
    gen = torch.Generator().manual_seed(3)
    num_kv, group, head_dim, num_old, num_new = 2, 3, 8, 7, 10
    cache = LayerCache(num_kv, head_dim)
    cache.append(torch.randn(num_kv, num_old, head_dim, generator=gen),
                 torch.randn(num_kv, num_old, head_dim, generator=gen), torch.arange(num_old))
    cache.scores[:] = torch.rand(num_kv, num_old, generator=gen) * 3
    old_scores = cache.scores.clone()
    cache.append(torch.randn(num_kv, num_new, head_dim, generator=gen),
                 torch.randn(num_kv, num_new, head_dim, generator=gen), torch.arange(num_old, num_old + num_new))
    queries = torch.randn(num_kv * group, num_new, head_dim, generator=gen)
    weights = torch.tensor([0.0] * 6 + [1.0] * 4) if window else None
    keys = cache.keys.clone()
    plain = LayerCache(num_kv, head_dim)
    plain.append(cache.keys.clone(), cache.values.clone(), cache.positions[0].clone())
    out = attend_and_score(queries, cache, 0.5, query_chunk=4, query_scale=decay, weights=weights)
    assert torch.equal(out, attend_and_score(queries, plain, 0.5, query_chunk=4))  # outputs untouched

    want = torch.cat([old_scores, torch.zeros(num_kv, num_new)], dim=1).double()
    q = queries.reshape(num_kv, group, num_new, head_dim).double()
    for i in range(num_new):
        visible = num_old + i + 1
        probs = torch.softmax(q[:, :, i] @ keys[:, :visible].double().transpose(-1, -2) * 0.5, dim=-1)
        w = 1.0 if weights is None else float(weights[i])
        want *= decay
        want[:, :visible] += w * probs.sum(dim=1)
    torch.testing.assert_close(cache.scores.double(), want, rtol=1e-5, atol=1e-6)
