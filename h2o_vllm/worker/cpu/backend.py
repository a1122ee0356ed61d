"""H2OCPUAttentionBackend: vLLM's CPU attention with H2O's builder and impl.

Runs in the worker process; registered over ``CPU_ATTN`` in every process. With H2O off (no
``h2o`` key in ``additional_config``) the builder and impl do exactly what the stock ones do.
With H2O on, rows with several queries (prompts, prefill chunks) are attended by H2O's torch
attention, whose probabilities also give their scores (``prefill.py``); vLLM's kernel attends
the decode rows alone, and their scores are recomputed (``scores.py``), a row's queries
together when its scores are next needed (``deferred.py``).

An fp8 cache is the exception: vLLM's kernel attends every row, the prompt rows included, and
H2O's torch pass only scores them. vLLM's CPU writer truncates each K/V it stores to e4m3, so
an attention output that differs from the kernel's in its last bits (torch's and the kernel's
sums round differently) becomes, wherever the next layer's K/V sits at an e4m3 boundary, a
whole e4m3 step in that layer's cache, and grows layer by layer (issue 57; docs/semantics.md,
"FP8 KV cache"). The kernel over the batch as built is what stock vLLM runs, so a request
nothing is evicted from gets stock vLLM's fp8 cache and tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata, CPUAttentionMetadataBuilder)

from h2o_vllm.config import FP8_KV_CACHE_DTYPES
from h2o_vllm.vllm_shims.cpu_attention import decode_rows_metadata, use_readable_isa
from h2o_vllm.worker.attention_backend import H2OBuilderMixin, H2OImplMixin, announce_backend, check_fusable
from h2o_vllm.worker.cpu.deferred import DeferredDecode, PendingBook, PendingQueries
from h2o_vllm.worker.cpu.ops import CPUOps
from h2o_vllm.worker.step import H2OStep


def kernel_attends_every_row(kv_cache_dtype: str) -> bool:
    """Whether vLLM's kernel attends the prompt rows too (an fp8 cache; see above), H2O's torch
    pass only scoring them."""
    return kv_cache_dtype in FP8_KV_CACHE_DTYPES


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
    # vLLM's metadata of the decode rows alone, on a step that also has rows with several
    # queries (else None: vLLM's kernel runs the batch as built, or not at all; an fp8 cache:
    # always None, the kernel runs the batch as built).
    decode: CPUAttentionMetadata | None = None
    # Which decode queries wait and which rows' waiting queries are scored (deferred.py);
    # None: every decode query is scored in its own step.
    deferred: DeferredDecode | None = None


class H2OCPUMetadataBuilder(H2OBuilderMixin, CPUAttentionMetadataBuilder):
    ops = CPUOps()
    metadata_cls = H2OCPUAttentionMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.book = PendingBook(self.block_size)
        if self.h2o is not None:
            isa = use_readable_isa(self, layer_names)
            how = (f"vLLM's CPU attention (ISA {isa}) for every row of the fp8 cache, H2O's torch scores"
                   if kernel_attends_every_row(self.kv_cache_dtype) else
                   f"vLLM's CPU attention (ISA {isa}) for decode rows, H2O's torch attention and scores "
                   "for prefill rows")
            announce_backend("H2OCPUAttentionBackend", how, vllm_config)

    def device_fields(self, cm, step: H2OStep) -> dict:
        fields = {"deferred": self.book.decide(step)}
        if (step.decode_rows is not None and step.prefill_rows is not None
                and not kernel_attends_every_row(self.kv_cache_dtype)):
            fields["decode"] = self.stock_build(decode_rows_metadata(cm, step.decode_rows, step.decode_tokens))
        return fields


class H2OCPUImpl(H2OImplMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's CPU writer stores every fp8 cache it takes as e4m3 (bytes).
        fp8 = self.kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self.ops = CPUOps(torch.float8_e4m3fn if fp8 else None)
        self.kernel_attends_every_row = kernel_attends_every_row(self.kv_cache_dtype)
        if self.h2o is not None:
            check_fusable(self)
            self.fuses_scores = True
            self.pending = PendingQueries()

    def has_sliding_window(self) -> bool:
        return self.sliding_window not in (-1, None)

    def _fused_attention(self, layer, step, query, kv_cache, views, scores, attn_metadata,
                         output, output_scale, output_block_scale) -> None:
        num_tokens = attn_metadata.num_actual_tokens
        out = output[:num_tokens].view(num_tokens, self.num_heads, self.head_size)
        if step.prefill_rows is None or self.kernel_attends_every_row:
            # vLLM's kernel over the batch as built (decode rows only, or an fp8 cache)
            self.stock_forward(layer, query, kv_cache, attn_metadata, output, output_scale,
                               output_block_scale)
        elif step.decode_rows is not None:
            tokens = step.decode_tokens
            decode_out = torch.empty_like(out[tokens])
            self.stock_forward(layer, query[tokens], kv_cache, attn_metadata.decode, decode_out,
                               output_scale, output_block_scale)
            out[tokens] = decode_out
        prefill_out = None if self.kernel_attends_every_row else out  # None: scores only
        self.ops.attend(step, query, views, prefill_out, scores, self.scale, self.logits_soft_cap,
                        self.sinks, attn_metadata.deferred, self.pending)
