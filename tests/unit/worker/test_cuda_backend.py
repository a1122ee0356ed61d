"""worker.cuda.backend: the CUDA backend's registration and its CUDA-graph answer, without a GPU.
The backend's step runs in tests/unit/worker/test_step.py and, inside vLLM, in
tests/engine/test_cuda.py."""
from types import SimpleNamespace

import torch


def test_custom_backend_registered_on_cuda_only():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm import plugin
    from h2o_vllm.vllm_hooks.triton_on_cpu import CUDA_BACKEND
    from h2o_vllm.worker.cuda.backend import H2OTritonAttentionBackend
    saved = dict(registry._ATTN_OVERRIDES)
    try:
        registry._ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
        plugin._register_cuda_backend(CUDA_BACKEND, is_cuda=False)
        assert AttentionBackendEnum.CUSTOM not in registry._ATTN_OVERRIDES
        plugin._register_cuda_backend(CUDA_BACKEND, is_cuda=True)
        backend = AttentionBackendEnum.CUSTOM.get_class()
        assert backend is H2OTritonAttentionBackend
        assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
        # What CudaPlatform.get_attn_backend_cls does with a selected backend (Hopper, bf16).
        reasons = backend.validate_configuration(
            head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
            use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
            attn_type="decoder")
        assert reasons == []
    finally:
        registry._ATTN_OVERRIDES.clear()
        registry._ATTN_OVERRIDES.update(saved)


def test_builder_refuses_full_graphs_only_with_h2o():
    from vllm.v1.attention.backend import AttentionCGSupport

    from h2o_vllm.worker.cuda.backend import H2OTritonMetadataBuilder
    on = SimpleNamespace(additional_config={"h2o": {}})
    off = SimpleNamespace(additional_config={})
    assert H2OTritonMetadataBuilder.get_cudagraph_support(on, None) == AttentionCGSupport.NEVER
    assert H2OTritonMetadataBuilder.get_cudagraph_support(off, None) == AttentionCGSupport.ALWAYS


def test_impl_refuses_what_the_fused_attention_does_not_compute():
    """A layer H2O's fused attention cannot run (the engine-args checks refuse these first)
    fails loudly at construction instead of giving wrong outputs or scores."""
    import pytest
    from vllm.v1.attention.backend import AttentionType

    from h2o_vllm.worker.attention_backend import check_fusable
    from h2o_vllm.worker.cuda.backend import H2OTritonImpl
    plain = dict(alibi_slopes=None, sliding_window=(-1, -1), logits_soft_cap=0, sinks=None,
                 kv_cache_dtype="auto", attn_type=AttentionType.DECODER, num_heads=4)
    check_fusable(SimpleNamespace(**plain))
    check_fusable(SimpleNamespace(**{**plain, "kv_cache_dtype": "bfloat16", "logits_soft_cap": None}))
    check_fusable(SimpleNamespace(**{**plain, "logits_soft_cap": 30.0}))  # in the scores
    check_fusable(SimpleNamespace(**{**plain, "sinks": torch.zeros(4)}))  # so are sinks
    for fp8 in ("fp8", "fp8_e4m3"):  # per-tensor scales: read by the kernels
        check_fusable(SimpleNamespace(**{**plain, "kv_cache_dtype": fp8}))
    for change, words in ((dict(alibi_slopes=torch.ones(4)), "ALiBi"),
                          (dict(kv_cache_dtype="fp8_per_token_head"), "quantised KV cache"),
                          (dict(kv_cache_dtype="fp8_e5m2"), "quantised KV cache"),
                          (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type")):
        with pytest.raises(NotImplementedError, match=words):
            check_fusable(SimpleNamespace(**{**plain, **change}))
    # A hybrid model's sliding-window layers are left to vLLM (no H2O there), not refused.
    assert H2OTritonImpl.has_sliding_window(SimpleNamespace(sliding_window=(127, 0)))
    assert not H2OTritonImpl.has_sliding_window(SimpleNamespace(sliding_window=(-1, -1)))
