"""H2OTritonAttentionBackend: vLLM's Triton attention (CUDA) with H2O's builder and impl.

Runs in the worker process. Registered as ``AttentionBackendEnum.CUSTOM`` on CUDA (plugin.py)
and selected with ``--attention-backend CUSTOM`` (``h2o_vllm.frontend.cuda_config`` picks it
when H2O is on and no backend was named). With H2O off everything is the stock Triton
backend's, except that forward writes K/V itself (same slots, same kernel). With H2O on,
attention and score accumulation run as one fused kernel of this project's
(``H2OTritonImpl._fused_attention``; vLLM's ``unified_attention`` is not called).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadata,
                                                    TritonAttentionMetadataBuilder)

from h2o_vllm.config import FP8_KV_CACHE_DTYPES, h2o_config
from h2o_vllm.worker.attention_backend import H2OBuilderMixin, H2OImplMixin, announce_backend, check_fusable
from h2o_vllm.worker.cuda.drafts import DraftBook, DraftStep, HeldQueries
from h2o_vllm.worker.cuda.ops import TritonOps
from h2o_vllm.worker.step import H2OStep


class H2OTritonAttentionBackend(TritonAttentionBackend):
    # The impl writes K/V itself, at KV-space slots only the H2O metadata knows.
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        # The attention layer maps the name back to the enum member (AttentionBackendEnum[name]):
        # CUSTOM resolves to this class, TRITON_ATTN would resolve to the stock one.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return H2OTritonImpl

    @staticmethod
    def get_builder_cls():
        return H2OTritonMetadataBuilder


@dataclass
class H2OTritonAttentionMetadata(TritonAttentionMetadata):
    # None when H2O is off or outside a real step (profiling, graph capture): stock behaviour.
    h2o: H2OStep | None = None
    # Speculative decoding: the queries held from the last step to score, and this step's to
    # hold (drafts.py); None without any.
    drafts: DraftStep | None = None


class H2OTritonMetadataBuilder(H2OBuilderMixin, TritonAttentionMetadataBuilder):
    metadata_cls = H2OTritonAttentionMetadata
    graph_decode = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.ops = TritonOps(kv_cache_spec.head_size)
        self.draft_book = DraftBook()
        if self.h2o is not None:
            how = "interpreted on the CPU" if torch.device(device).type == "cpu" else "compiled"
            announce_backend("H2OTritonAttentionBackend", f"H2O's fused Triton attention and "
                             f"score kernels and its compaction kernel, {how}", vllm_config)

    def device_fields(self, cm, step: H2OStep) -> dict:
        return {"drafts": self.draft_book.decide(step)}

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The plan changes every step in Python (row lengths, due rows): no full CUDA graph may
        # hold attention. vLLM then downgrades FULL_AND_PIECEWISE to PIECEWISE (attention runs
        # eagerly between the graphs); h2o_vllm.frontend.cuda_config already asks for that up front.
        if h2o_config(vllm_config) is not None:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)


class H2OTritonImpl(H2OImplMixin, TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fp8 = self.kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self.ops = TritonOps(self.head_size, self.fp8_dtype if fp8 else None)
        if self.h2o is not None:
            check_fusable(self)
            self.fuses_scores = True
            self.held = HeldQueries()

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """vLLM's write, except an fp8 cache on the CPU (the Triton interpreter): vLLM's Triton
        writer refuses fp8 off an SM89+ GPU ("needs native fp8e4nv"), so torch stores here what
        a GPU's conversion stores (round to nearest even, saturated)."""
        if self.ops.fp8_dtype is None or kv_cache.device.type != "cpu":
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.ops.write_fp8(self._views_of(kv_cache), key, value, slot_mapping)  # scales: forward's

    def has_sliding_window(self) -> bool:
        return tuple(self.sliding_window) != (-1, -1)

    def _fused_attention(self, layer, step, query, kv_cache, views, scores, attn_metadata,
                         output, output_scale, output_block_scale) -> None:
        # Replaces unified_attention and the score pass: one kernel reads K and V once for
        # both (h2o_vllm.kernels.attention; docs/cuda.md, "Fused attention").
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("H2O's fused attention does not quantise its output")
        if attn_metadata.causal is not True or attn_metadata.mm_prefix_range_tensor is not None:
            raise NotImplementedError("H2O's fused attention is causal only (no per-sequence "
                                      "causality, no bidirectional multimodal prefixes)")
        if attn_metadata.drafts is not None:  # before this step's scores: they come after
            self.held.apply(attn_metadata.drafts, step, query, views.keys, scores, self.scale,
                            self.logits_soft_cap, self.sinks, k_scale=self.ops.k_scale)
        self.ops.attend(step, query, views, output, scores, self.scale,
                        attn_metadata.query_start_loc, self.logits_soft_cap, self.sinks)

    def fused_rope_kvcache_supported(self) -> bool:
        return False if self.h2o is not None else super().fused_rope_kvcache_supported()
