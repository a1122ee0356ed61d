"""H2OCPUAttentionBackend: vLLM's CPU attention with H2O's builder and impl.

Runs in the worker process; registered over ``CPU_ATTN`` in every process. With H2O off (no
``h2o`` key in ``additional_config``) the builder and impl do exactly what the stock ones do.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata, CPUAttentionMetadataBuilder)

from h2o_vllm.vllm_hooks.cpu_attention import use_readable_isa
from h2o_vllm.worker.core import H2OBuilderMixin, H2OImplMixin, announce_backend
from h2o_vllm.worker.cpu.ops import CPUOps
from h2o_vllm.worker.step import H2OStep


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
        return H2OCPUImpl

    @staticmethod
    def get_builder_cls():
        return H2OCPUMetadataBuilder


@dataclass
class H2OCPUAttentionMetadata(CPUAttentionMetadata):
    # None when H2O is off or outside a real step: the impl then behaves as stock vLLM.
    h2o: H2OStep | None = None


class H2OCPUMetadataBuilder(H2OBuilderMixin, CPUAttentionMetadataBuilder):
    ops = CPUOps()
    metadata_cls = H2OCPUAttentionMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.h2o is not None:
            isa = use_readable_isa(self, layer_names)
            announce_backend("H2OCPUAttentionBackend", f"vLLM's CPU attention, ISA {isa}, "
                             "with H2O's torch scores and compaction")


class H2OCPUImpl(H2OImplMixin, CPUAttentionBackendImpl):
    ops = CPUOps()
