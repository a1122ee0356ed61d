"""H2OCPUAttentionBackend: vLLM's CPU attention with H2O's builder and impl.

Registered over ``CPU_ATTN`` in every process. With H2O off (no ``h2o`` key in
``additional_config``) the builder and impl do exactly what the stock ones do.
"""
from __future__ import annotations

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend


class H2OCPUAttentionBackend(CPUAttentionBackend):
    # The impl writes K/V itself, at KV-space slots only the H2O metadata knows.
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The stock kernels also run blocks of 16 (the "vec16" ISA); finer blocks let H2O
        # return memory at a finer grain. Stock vLLM only admits multiples of 32.
        return [MultipleOf(16)]

    @staticmethod
    def get_impl_cls():
        from h2o_vllm.worker.cpu.impl import H2OCPUImpl
        return H2OCPUImpl

    @staticmethod
    def get_builder_cls():
        from h2o_vllm.worker.cpu.builder import H2OCPUMetadataBuilder
        return H2OCPUMetadataBuilder
