"""Stand-in for ``vllm/vllm_flash_attn/__init__.py`` in the GPU bundle.

Why it exists: the bundle drops vLLM's compiled FlashAttention extensions (``_vllm_fa2_C``,
``_vllm_fa3_C``; 480 MiB unpacked) and vLLM's own ``__init__`` raises ImportError when both are
missing. ``vllm.v1.attention.backends.fa_utils`` imports this package on every CUDA machine,
Triton attention included, so that raise would stop the engine. This version re-exports the same
names from ``flash_attn_interface`` (which imports without the extensions and records why they
are unavailable) and does not raise: vLLM then sees FlashAttention as unsupported and the stock
baseline runs on Triton attention (``attention_backend="TRITON_ATTN"``).
"""
from vllm.vllm_flash_attn.flash_attn_interface import (  # noqa: F401
    FA2_AVAILABLE,
    FA3_AVAILABLE,
    compile_flash_attn_varlen_func_from_specs,
    fa_version_unsupported_reason,
    flash_attn_varlen_func,
    get_scheduler_metadata,
    is_fa_version_supported,
)

__all__ = [
    "compile_flash_attn_varlen_func_from_specs",
    "fa_version_unsupported_reason",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "is_fa_version_supported",
]
