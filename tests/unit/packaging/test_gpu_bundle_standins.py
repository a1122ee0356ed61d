"""The GPU bundle's ``_C`` stand-in: its torch bodies against vLLM's own reference implementations,
called through ``torch.ops`` with the CUDA build's schemas (registered under a test namespace:
``_C`` belongs to the CPU build here)."""
import importlib.util
from pathlib import Path

import pytest
import torch

STANDIN = Path(__file__).parents[3] / "packaging" / "gpu_bundle" / "standins" / "_C_stable_libtorch.py"


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("gpu_bundle_c_standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    library = module.register("h2o_gpu_bundle_test")
    yield torch.ops.h2o_gpu_bundle_test
    del library


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_match_vllm_native(ops, dtype):
    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    weight = torch.randn(64, dtype=dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm.impls["native"].impl_fn(x, weight, 1e-6))
    want_out, want_residual = fused_add_rms_norm.impls["native"].impl_fn(x, residual, weight, 1e-6)
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)  # in place
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(x, want_out)


def test_silu_and_mul_matches_vllm_native(ops):
    from vllm.model_executor.layers.activation import SiluAndMul
    x = torch.randn(7, 2 * 48)
    out = torch.empty(7, 48)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, SiluAndMul.forward_native(x))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_embedding_matches_vllm_native(ops, is_neox, rotary_dim):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    head, heads, kv_heads, tokens, max_pos = 32, 4, 2, 9, 128
    # RoPE's cos/sin table, plain formula: rows [cos | sin] per position.
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (tokens,))
    # q and k as views of one qkv tensor, as the attention layer passes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head)
    query, key, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    q0, k0 = query.clone(), key.clone()
    want_q, want_k = RotaryEmbedding.forward_static(positions, q0.clone(), k0.clone(), head,
                                                    rotary_dim, cache, is_neox)
    ops.rotary_embedding(positions, query, key, head, cache, is_neox)
    torch.testing.assert_close(query, want_q)
    torch.testing.assert_close(key, want_k)
    # inverse=True undoes the rotation; key may be None.
    ops.rotary_embedding(positions, query, None, head, cache, is_neox, 0, True)
    ops.rotary_embedding(positions, key, None, head, cache, is_neox, 0, True)
    torch.testing.assert_close(query, q0)
    torch.testing.assert_close(key, k0)


def test_repetition_penalties_match_vllm_torch_version(ops):
    from vllm._custom_ops import apply_repetition_penalties_torch
    logits = torch.randn(3, 50)
    prompt, output = torch.rand(3, 50) < 0.2, torch.rand(3, 50) < 0.2
    penalties = torch.tensor([1.0, 1.3, 2.0])
    want = logits.clone()
    apply_repetition_penalties_torch(want, prompt, output, penalties)
    ops.apply_repetition_penalties_(logits, prompt, output, penalties)
    torch.testing.assert_close(logits, want)


def test_capability_queries_say_unsupported(ops):
    assert ops.cutlass_scaled_mm_supports_fp8(90) is False
    assert ops.cutlass_group_gemm_supported(90) is False
