"""H2OTritonAttentionBackend: vLLM's Triton attention (CUDA) with H2O's builder and impl.

Runs in the worker process. Registered as ``AttentionBackendEnum.CUSTOM`` on CUDA (plugin.py) and
selected with ``--attention-backend CUSTOM`` (``h2o_vllm.frontend.cuda_config`` picks it when H2O is on and
no backend was named). Triton attention keeps the plainest paged layout: its kv_cache arrives as
[num_blocks, num_kv_heads, block_size, 2 * head_size] and ``transpose(1, 2).split(head_size)``
gives K and V as [num_blocks, block_size, num_kv_heads, head_size] views, the layout of
``h2o_vllm.kernels``. With H2O off (no ``h2o`` key in ``additional_config``) everything is the
stock Triton backend's, except that forward writes K/V itself (same slots, same kernel).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadata,
                                                    TritonAttentionMetadataBuilder)

from h2o_vllm import metrics
from h2o_vllm.config import config_from_additional
from h2o_vllm.worker import announce_backend
from h2o_vllm.worker import plan as step_plan
from h2o_vllm.worker.cuda_step import (CudaStep, kv_slot_mapping, make_cuda_step,
                                       update_scores_and_compact)


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
    h2o: CudaStep | None = None


class H2OTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.h2o = config_from_additional(vllm_config.additional_config)
        if self.h2o is not None:
            how = "interpreted on the CPU" if torch.device(device).type == "cpu" else "compiled"
            announce_backend("H2OTritonAttentionBackend", f"vLLM's Triton attention with H2O's "
                             f"Triton score and compaction kernels, {how}")

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The plan changes every step in Python (row lengths, due rows): no full CUDA graph may
        # hold attention. vLLM then downgrades FULL_AND_PIECEWISE to PIECEWISE (attention runs
        # eagerly between the graphs); h2o_vllm.frontend.cuda_config already asks for that up front.
        if config_from_additional(vllm_config.additional_config) is not None:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> H2OTritonAttentionMetadata:
        cm = common_attn_metadata
        plan = step_plan.current() if self.h2o is not None else None
        step = None
        if plan is not None:
            cm, step = h2o_common_metadata(cm, plan, self.block_size)
        metadata = super().build(common_prefix_len, cm, fast_build)
        return H2OTritonAttentionMetadata(**{f.name: getattr(metadata, f.name)
                                             for f in dataclasses.fields(metadata)}, h2o=step)


def h2o_common_metadata(cm: CommonAttentionMetadata, plan: step_plan.StepPlan,
                        block_size: int) -> tuple[CommonAttentionMetadata, CudaStep]:
    """The stock metadata moved into KV space: seq_lens (the kernel's key counts) and
    slot_mapping (where K/V are written) from the plan; RoPE positions stay logical."""
    num_rows = plan.query_lens.shape[0]
    kv_seq_lens = plan.kv_seq_lens
    seq_lens = cm.seq_lens.clone()  # may be padded past num_rows: padding keeps vLLM's values
    seq_lens[:num_rows] = kv_seq_lens.to(seq_lens.dtype).to(seq_lens.device, non_blocking=True)
    slots = kv_slot_mapping(plan, cm.block_table_tensor, cm.slot_mapping, block_size)
    cm = dataclasses.replace(cm, seq_lens=seq_lens, max_seq_len=int(kv_seq_lens.max()),
                             slot_mapping=slots)
    return cm, make_cuda_step(plan, cm.block_table_tensor, slots, block_size)


class H2OTritonImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.h2o = config_from_additional(get_current_vllm_config().additional_config)
        # scores: [num_blocks, num_kv_heads, block_size] fp32, KV-space; allocated on first use
        # because the cache size is only known once vLLM has profiled memory.
        self.scores: torch.Tensor | None = None
        self._mass = _DeferredMass()

    def fused_rope_kvcache_supported(self) -> bool:
        return False if self.h2o is not None else super().fused_rope_kvcache_supported()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling run
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            num_tokens = attn_metadata.slot_mapping.shape[0]
            self.do_kv_cache_update(layer, key[:num_tokens], value[:num_tokens], kv_cache,
                                    attn_metadata.slot_mapping)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        step = getattr(attn_metadata, "h2o", None)
        if step is not None and self.kv_sharing_target_layer_name is None:
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            num_blocks, block_size, num_kv_heads, _ = key_cache.shape
            if self.scores is None or self.scores.shape[0] != num_blocks:
                self.scores = torch.zeros(num_blocks, num_kv_heads, block_size,
                                          dtype=torch.float32, device=key_cache.device)
            mass = update_scores_and_compact(step, query, key_cache, value_cache, self.scores,
                                             attn_metadata.block_table, self.scale)
            if step.due:
                self._mass.push(mass)
        return output


class _DeferredMass:
    """Attention mass of compacted rows for the metrics, read without stalling the GPU: copied
    to pinned memory behind an event, recorded once the event has passed (CPU: at once)."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, object]] = []

    def push(self, mass: torch.Tensor) -> None:
        if mass.device.type != "cuda":
            self._record(mass)
            return
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(mass, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))
        while self._pending and self._pending[0][1].query():
            self._record(self._pending.pop(0)[0])

    @staticmethod
    def _record(mass: torch.Tensor) -> None:
        total, kept = mass.tolist()
        metrics.recorder().add(evicted_attention_mass=total - kept, attention_mass=total)
