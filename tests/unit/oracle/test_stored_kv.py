"""The oracle's fp8 KV storage: what vLLM's fp8 cache (e4m3, per-tensor scales) gives back."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import FP8_E4M3, H2OOracle, StoredKV
from h2o_vllm.oracle.stored_kv import through


def test_an_unquantised_cache_gives_back_what_was_computed():
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    rk, rv = StoredKV().round(k, v)
    assert rk is k and rv is v


@pytest.mark.parametrize("x, stored", [
    (1.0625, 1.0),      # halfway between 1.0 and 1.125 (3 mantissa bits): to the even one
    (1.1875, 1.25),     # halfway between 1.125 and 1.25: to the even one
    (1.07, 1.125),
    (-3.3, -3.25),
    (1000.0, 448.0),    # saturated at e4m3's largest finite value, as the GPU's satfinite
    (-1e6, -448.0),
    (2.0 ** -9, 2.0 ** -9),  # the smallest subnormal
])
def test_fp8_e4m3_rounds_to_nearest_even_and_saturates(x, stored):
    assert through(torch.tensor([x]), torch.float8_e4m3fn, 1.0).item() == stored


@pytest.mark.parametrize("x, stored", [
    (1.0625, 1.0),      # vLLM's CPU writer truncates: halfway goes toward zero too
    (1.24, 1.125),
    (-3.3, -3.25),
    (-3.45, -3.25),
    (0.999, 0.9375),
    (1000.0, 448.0),    # saturated
    (-1e6, -448.0),
    (2.0 ** -9, 2.0 ** -9),  # the smallest subnormal
    (1.9 * 2.0 ** -10, 0.0),  # below it: zero
])
def test_fp8_e4m3_on_the_cpu_rounds_toward_zero_and_saturates(x, stored):
    assert through(torch.tensor([x]), torch.float8_e4m3fn, 1.0, toward_zero=True).item() == stored


def test_the_scale_divides_before_the_cast_and_multiplies_after():
    x = torch.tensor([4.25, 1000.0])
    # k: 1.0625 -> 1.0 (a tie, to even); 250 -> 256 (steps of 16 there); times 4
    # v: 8.5 -> 8 (a tie, to even); 2000 -> 448 (saturated); times 0.5
    k, v = StoredKV(torch.float8_e4m3fn, k_scale=4.0, v_scale=0.5).round(x, x)
    assert k.tolist() == [4.0, 1024.0] and v.tolist() == [4.0, 224.0]


def test_the_oracle_attends_over_and_keeps_fp8_rounded_keys_and_values():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    prompts = [torch.randint(0, 64, (40,)).tolist()]
    budget = H2OConfig(heavy_tokens=8, recent_tokens=8, interval=4)
    fp8 = H2OOracle(model, budget, stored_kv=FP8_E4M3)
    tokens = fp8.generate(prompts, 12)
    for layer in fp8.last_states[0].layers:
        assert torch.equal(through(layer.keys, torch.float8_e4m3fn, 1.0), layer.keys)
        assert torch.equal(through(layer.values, torch.float8_e4m3fn, 1.0), layer.values)
    plain = H2OOracle(model, budget)
    assert plain.generate(prompts, 12) != tokens or not torch.equal(
        plain.last_states[0].layers[0].keys, fp8.last_states[0].layers[0].keys)
