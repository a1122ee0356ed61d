"""The dense H2O oracle (h2o_vllm.oracle) against transformers and against a naive H2O.

Controls: with no eviction it must be transformers' own greedy decoding; with eviction it must
equal tests/unit/oracle/naive_h2o.py (a from-scratch, recompute-everything implementation) token for
token, kept position for kept position, score for score; and eviction must change the output.
Tiny random Llama (GQA 4 q / 2 KV heads), peaky attention so heavy-hitter choices are far from ties.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import H2OOracle
from naive_h2o import naive_generate, naive_score

NUM_LAYERS, NUM_KV_HEADS = 3, 2
PROMPT_LENS = (5, 23, 40, 64)
NEW_TOKENS = 24
CHUNK = 16  # small query chunks so the 40- and 64-token prefills run in several chunks

BUDGETS = {
    "ratio-0.1+0.1": dict(heavy_ratio=0.1, recent_ratio=0.1),
    "ratio-0.2+0.2": dict(heavy_ratio=0.2, recent_ratio=0.2),
    "tokens-4+4": dict(heavy_tokens=4, recent_tokens=4),
    "recent-only": dict(heavy_ratio=0, recent_ratio=0.2),
    "tokens-12+6": dict(heavy_tokens=12, recent_tokens=6),  # larger than the short prompts
}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                         num_key_value_heads=NUM_KV_HEADS, head_dim=32, initializer_range=0.2,
                         max_position_embeddings=256, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaky attention: heavy hitters well separated from the rest
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(1.5)
            layer.self_attn.k_proj.weight.mul_(1.5)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("config", [None, H2OConfig(heavy_tokens=100, recent_tokens=100)],
                         ids=["no-config", "budget-over-length"])
def test_reference_without_eviction_matches_transformers_generate(model, prompts, config):
    ref = H2OOracle(model, config, block_size=16, query_chunk=CHUNK)
    got = ref.generate(prompts, NEW_TOKENS)
    assert got == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    for prompt, state in zip(prompts, ref.last_states):
        assert state.num_tokens == state.kv_len == len(prompt) + NEW_TOKENS - 1
        assert state.layers[0].positions.tolist() == [list(range(state.num_tokens))] * NUM_KV_HEADS


@pytest.mark.parametrize("interval", [1, 16], ids=["interval-1", "interval-16"])
@pytest.mark.parametrize("budget", list(BUDGETS), ids=list(BUDGETS))
def test_reference_matches_naive(model, prompts, budget, interval):
    config = H2OConfig(**BUDGETS[budget], interval=interval)
    ref = H2OOracle(model, config, query_chunk=CHUNK)
    got = ref.generate(prompts, NEW_TOKENS)
    compacted = 0
    for prompt, tokens, state in zip(prompts, got, ref.last_states):
        want, naive = naive_generate(model, config, prompt, NEW_TOKENS)
        assert tokens == want, f"prompt_len={len(prompt)}"
        assert state.num_tokens == len(prompt) + NEW_TOKENS - 1
        assert state.kv_len == naive.expected_kv_len()
        compacted += state.kv_len < state.num_tokens
        for layer in range(NUM_LAYERS):
            cache = state.layers[layer]
            for kv_head in range(NUM_KV_HEADS):
                positions, scores = naive.kept(layer, kv_head)
                assert cache.positions[kv_head].tolist() == positions, (len(prompt), layer, kv_head)
                # The two sum the same fp32 probabilities in different orders: up to ~7e-5 apart
                # under transformers 5.19 (kept positions and tokens are compared exactly above).
                torch.testing.assert_close(cache.scores[kv_head], torch.tensor(scores), rtol=1e-3, atol=1e-4)
    assert compacted >= 2  # every budget evicts in at least two of the four sequences


def test_reference_compacts_at_end_of_prompt(model, prompts):
    """64-token prompt, 4 + 4 budget, interval 16: 64 >= 8 + 16, so the prefill step compacts."""
    ref = H2OOracle(model, H2OConfig(heavy_tokens=4, recent_tokens=4, interval=16))
    state = ref.new_state(64)
    ref.step(state, prompts[3])
    assert state.num_tokens == 64 and state.kv_len == 8
    assert state.layers[0].positions[:, -4:].tolist() == [[60, 61, 62, 63]] * NUM_KV_HEADS
    short = ref.new_state(23)  # 23 < 24: the prompt is kept whole, compaction waits for n = 24
    ref.step(short, prompts[1])
    assert short.kv_len == 23
    ref.step(short, [7])
    assert short.kv_len == 8


def test_reference_eviction_changes_output_and_heads_keep_own_sets(model, prompts):
    full = H2OOracle(model, None).generate(prompts, NEW_TOKENS)
    ref = H2OOracle(model, H2OConfig(heavy_tokens=4, recent_tokens=4, interval=1))
    evicted = ref.generate(prompts, NEW_TOKENS)
    assert any(a != b for a, b in zip(full[1:], evicted[1:]))
    assert any(not torch.equal(layer.positions[0], layer.positions[1])
               for state in ref.last_states for layer in state.layers)


def test_reference_prefill_chunking_does_not_change_results(model, prompts):
    config = H2OConfig(heavy_ratio=0.2, recent_ratio=0.2, interval=1)
    chunked, whole = H2OOracle(model, config, query_chunk=5), H2OOracle(model, config, query_chunk=4096)
    assert chunked.generate(prompts, 8) == whole.generate(prompts, 8)
    for a, b in zip(chunked.last_states, whole.last_states):
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.positions, lb.positions)
            torch.testing.assert_close(la.scores, lb.scores, rtol=1e-5, atol=1e-5)


def test_reference_score_without_eviction_is_full_model_log_softmax(model, prompts):
    prompt, continuation = prompts[2], prompts[3][:20]
    config = H2OConfig(heavy_tokens=100, recent_tokens=100)
    got = H2OOracle(model, config, block_size=16).score(prompt, continuation)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(continuation)[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_reference_score_with_eviction_matches_naive_and_differs_from_full(model, prompts):
    prompt, continuation = prompts[2], prompts[3][:20]
    config = H2OConfig(heavy_tokens=4, recent_tokens=4, interval=1)
    got = H2OOracle(model, config).score(prompt, continuation)
    torch.testing.assert_close(got, naive_score(model, config, prompt, continuation), rtol=1e-4, atol=1e-4)
    full = H2OOracle(model, None).score(prompt, continuation)
    assert (got - full).abs().max() > 0.1


def test_reference_default_interval_is_one_block(model, prompts):
    """An unset interval is one KV block: the oracle needs the engine's block size, and then
    runs exactly as with interval=block_size (and as the naive twin given the same block)."""
    config = H2OConfig(heavy_tokens=4, recent_tokens=4)
    with pytest.raises(ValueError, match="block_size"):
        H2OOracle(model, config)
    default = H2OOracle(model, config, block_size=8, query_chunk=CHUNK)
    explicit = H2OOracle(model, H2OConfig(heavy_tokens=4, recent_tokens=4, interval=8), query_chunk=CHUNK)
    got = default.generate(prompts, NEW_TOKENS)
    assert got == explicit.generate(prompts, NEW_TOKENS)
    for a, b in zip(default.last_states, explicit.last_states):
        assert a.budget.interval == b.budget.interval == 8
        assert a.kv_len == b.kv_len
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.positions, lb.positions)
    want, naive = naive_generate(model, config, prompts[2], NEW_TOKENS, block_size=8)
    assert got[2] == want
    assert default.last_states[2].kv_len == naive.expected_kv_len() < default.last_states[2].num_tokens
    for layer in range(NUM_LAYERS):
        for kv_head in range(NUM_KV_HEADS):
            positions, _ = naive.kept(layer, kv_head)
            assert default.last_states[2].layers[layer].positions[kv_head].tolist() == positions


@torch.no_grad()
def recomputed_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by a full forward per token (no KV cache: Gemma 2's cache classes want a
    sliding window, which the all-global tiny model has not)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", sorted(__import__("h2o_devtools.models", fromlist=["x"]).TINY_FAMILIES))
def test_without_eviction_every_family_is_transformers_generate(family, tmp_path):
    """The oracle's forward is each family's own (transformers' attention registry): with no
    eviction it is transformers' eager greedy decoding, Gemma 2's soft-capped logits and Gemma
    3's sliding-window layers included (prompts up to 40 tokens outgrow its 24-token window)."""
    from transformers import AutoModelForCausalLM

    from h2o_devtools import models
    model_dir = models.build_tiny_model(tmp_path, family, num_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(2)
    family_prompts = [torch.randint(5, 500, (n,), generator=generator).tolist() for n in (1, 23, 40)]
    got = H2OOracle(hf, None, query_chunk=CHUNK).generate(family_prompts, 8)
    assert got == [recomputed_greedy(hf, p, 8) for p in family_prompts]
    assert hf.config._attn_implementation == "eager"  # restored after every step


def test_sinks_take_their_share_of_each_softmax_and_nobody_scores_it():
    """gpt-oss's learned sink logits: in each softmax's denominator, without a slot of their own."""
    from h2o_vllm.oracle.attention import attend_and_score
    from h2o_vllm.oracle.cache import LayerCache
    generator = torch.Generator().manual_seed(3)
    num_kv, group, n, head = 2, 2, 5, 8
    keys, values = (torch.randn(num_kv, n, head, generator=generator) for _ in range(2))
    queries = torch.randn(num_kv * group, n, head, generator=generator)
    sinks = torch.randn(num_kv * group, generator=generator)
    cache = LayerCache(num_kv, head)
    cache.append(keys, values, torch.arange(n))
    out = attend_and_score(queries, cache, 0.5, sinks=sinks)
    logits = torch.einsum("kgqd,knd->kgqn", queries.view(num_kv, group, n, head), keys) * 0.5
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    sink = sinks.view(num_kv, group, 1, 1).expand(-1, -1, n, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    assert (probs.sum(dim=-1) < 1).all()
    want = torch.einsum("kgqn,knd->kgqd", probs, values).reshape(num_kv * group, n, head)
    torch.testing.assert_close(out, want.transpose(0, 1).reshape(n, -1))
    torch.testing.assert_close(cache.scores, probs.sum(dim=(1, 2)))
