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
    from h2o_vllm.worker.cuda.backend import H2OTritonAttentionBackend
    saved = dict(registry._ATTN_OVERRIDES)
    try:
        registry._ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
        plugin._register_cuda_backend(is_cuda=False)
        assert AttentionBackendEnum.CUSTOM not in registry._ATTN_OVERRIDES
        plugin._register_cuda_backend(is_cuda=True)
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
