"""The attention-backend parts both devices share: the metadata builder's step and the impl's
forward, written once as mixins placed before vLLM's own classes.

Runs in the worker process. A device's builder and impl are ``class X(H2OBuilderMixin,
<vLLM builder>)`` and ``class Y(H2OImplMixin, <vLLM impl>)`` plus its ``DeviceOps``: with H2O
off (no ``h2o`` key in ``additional_config``) both are vLLM's own, except that forward writes
K/V itself (same slots, same kernel).
"""
from __future__ import annotations

import dataclasses

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType

from h2o_vllm.config import FP8_KV_CACHE_DTYPES, h2o_config
from h2o_vllm.score_modes.rotary import rotary_or_none
from h2o_vllm.spec import is_h2o_spec
from h2o_vllm.worker.building import plan_for
from h2o_vllm.worker.decode_graph import graph_width
from h2o_vllm.worker.step import (DeferredMass, DeviceOps, H2OStep, kv_space_metadata, prepare_scores,
                                  scoring_step, update_scores_and_compact)
from h2o_vllm.worker.step_buffers import StepBuffers

def announce_backend(backend: str, how: str, vllm_config) -> None:
    """One INFO line per worker process naming the H2O attention backend it runs, and the
    model runner and scheduling it runs under, so that H2O is never on unseen (vLLM's
    handlers print the ``vllm.`` loggers; its ``info_once`` keeps the line to one)."""
    runner = "V2" if vllm_config.use_v2_model_runner else "V1"
    scheduling = "async" if vllm_config.scheduler_config.async_scheduling else "sync"
    init_logger("vllm.h2o_vllm").info_once(
        "h2o: attention backend %s (%s); vLLM model runner %s, %s scheduling", backend, how,
        runner, scheduling)


def with_step(metadata_cls, metadata, step: H2OStep | None, **device_fields):
    """vLLM's metadata as the device's H2O subclass (its ``h2o`` field: the step or None)."""
    return metadata_cls(**{f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)},
                        h2o=step, **device_fields)


def check_fusable(impl) -> None:
    """H2O's attention computes causal softmax attention (soft-capped where the model caps,
    with the model's sink logits where it has them) over an unquantised cache or an fp8 one with
    per-tensor scales (``worker.kv_dtype``); a layer (``impl``, vLLM's attention impl) with
    anything else would get wrong outputs or scores. The engine-args checks
    (h2o_vllm.frontend.conflicts, cuda_config) refuse these before the model loads; this is the
    backstop for a layer that slips through. (Sliding-window layers never get here:
    ``H2OImplMixin`` leaves them to vLLM.)"""
    quantised_cache = (is_quantized_kv_cache(impl.kv_cache_dtype)
                       and impl.kv_cache_dtype not in FP8_KV_CACHE_DTYPES)
    unsupported = {
        "ALiBi": impl.alibi_slopes is not None,
        f"quantised KV cache {impl.kv_cache_dtype}": quantised_cache,
        f"attention type {impl.attn_type}": impl.attn_type != AttentionType.DECODER,
    }
    found = [what for what, bad in unsupported.items() if bad]
    if found:
        raise NotImplementedError(f"H2O's fused attention does not support {', '.join(found)}"
                                  f" (layer with {impl.num_heads} heads): turn H2O off")


class H2OBuilderMixin:
    """``build``: the plan of the build in progress (``worker.building``) gives vLLM's builder
    its KV-space seq_lens and slot_mapping, and the step's ``H2OStep`` rides on the metadata
    every layer receives. The step's device tensors live in the builder's ``StepBuffers``."""
    ops: DeviceOps
    metadata_cls: type
    #: Whether decode steps may run graph-shaped (``worker.decode_graph``): the CUDA path's.
    graph_decode = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # A hybrid model's sliding-window groups and a drafter's layers keep vLLM's own
        # metadata: only H2O's groups (h2o_specs) get a plan.
        self.h2o = h2o_config(vllm_config) if is_h2o_spec(kv_cache_spec) else None
        scheduler = vllm_config.scheduler_config
        self.step_buffers = StepBuffers(device, rows=scheduler.max_num_seqs,
                                        tokens=scheduler.max_num_batched_tokens)
        self.graph_width = (graph_width(vllm_config, self.h2o, kv_cache_spec.block_size)
                            if self.graph_decode and self.h2o is not None else None)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        cm, step = common_attn_metadata, None
        plan = plan_for(self.layer_names) if self.h2o is not None else None
        if plan is not None:
            cm, step = kv_space_metadata(cm, plan, self.block_size, self.ops, self.layer_names[-1],
                                         self.step_buffers, self.graph_width)
        metadata = super().build(common_prefix_len, cm, fast_build)
        return with_step(self.metadata_cls, metadata, step,
                         **(self.device_fields(cm, step) if step is not None else {}))

    def device_fields(self, cm, step: H2OStep) -> dict:
        """Fields of the device's metadata subclass besides ``h2o``, built once per step."""
        return {}

    def stock_build(self, cm):
        """vLLM's own builder over ``cm`` (no H2O step)."""
        return super().build(0, cm)


class H2OImplMixin:
    """``forward``: write K/V at the KV-space slots -> vLLM's attention -> scores and compaction."""
    ops: DeviceOps

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A sliding-window layer (hybrid models) is vLLM's: its window already bounds its cache.
        vllm_config = get_current_vllm_config()
        self.h2o = None if self.has_sliding_window() else h2o_config(vllm_config)
        # The model's RoPE, for a request whose score moves queries ahead (score 'expected');
        # None where the model's cannot be (such a request is refused before it is queued).
        self.rotary = None if self.h2o is None else rotary_or_none(vllm_config.model_config)
        # scores: [num_blocks, num_kv_heads, block_size] fp32, KV-space; allocated on first use
        # because the cache size is only known once vLLM has profiled memory.
        self.scores: torch.Tensor | None = None
        self.records: torch.Tensor | None = None  # prefix caching: score records, same layout
        self._views: tuple[torch.Tensor, object] | None = None  # (kv_cache, its views)
        self._mass = DeferredMass()  # used by a group's last layer only (H2OStep.last_layer)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = self._forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)
        step = getattr(attn_metadata, "h2o", None)
        if step is not None and step.mass is not None and layer.layer_name == step.last_layer:
            self._mass.push(step.mass)  # every layer of the group has added its mass
        return output

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                 output_scale, output_block_scale):
        if attn_metadata is None:  # profiling and warm-up runs: vLLM's own answer
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        self.ops.read_scales(layer)
        owns_cache = self.kv_sharing_target_layer_name is None
        if owns_cache and key is not None and value is not None:
            num_tokens = attn_metadata.slot_mapping.shape[0]
            self.do_kv_cache_update(layer, key[:num_tokens], value[:num_tokens], kv_cache,
                                    attn_metadata.slot_mapping)
        step = getattr(attn_metadata, "h2o", None)
        if step is None or not owns_cache:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        views = self._views_of(kv_cache)
        scores = self._scores_like(views)
        if step.prefix is not None and self.records is None:
            self.records = torch.zeros_like(scores)
        if self.fuses_scores:
            prepare_scores(step, scores, self.records)  # what the fused pass adds to
            self._fused_attention(layer, scoring_step(step), query, kv_cache, views, scores,
                                  attn_metadata, output, output_scale, output_block_scale)
        else:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
        update_scores_and_compact(step, self.ops, query, views, scores, self.scale, self.records,
                                  accumulated=self.fuses_scores, softcap=self.logits_soft_cap,
                                  sink_logits=self.sinks, rotary=self.rotary)
        return output

    def has_sliding_window(self) -> bool:
        """Whether vLLM gave this layer a sliding window (each device stores it its own way)."""
        raise NotImplementedError

    #: Whether ``_fused_attention`` replaces vLLM's attention and the score pass (CUDA: one
    #: kernel; CPU: vLLM's kernel for the decode rows only, H2O's for the rest); else vLLM's
    #: attention runs, then the device's accumulate.
    fuses_scores = False

    def _fused_attention(self, layer, step: H2OStep, query, kv_cache, views, scores,
                         attn_metadata, output, output_scale, output_block_scale) -> None:
        """Attention output and this step's scores in one pass (``step``: what to score)."""
        raise NotImplementedError

    def stock_forward(self, layer, query, kv_cache, attn_metadata, output, output_scale=None,
                      output_block_scale=None):
        """vLLM's own attention over ``attn_metadata`` (K/V already written)."""
        return super().forward(layer, query, None, None, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def cache_state(self, kv_cache: torch.Tensor):
        """(the device's views of ``kv_cache``, this layer's score buffer): what KV transfer
        reads and writes (``kv_transfer.save_load``)."""
        views = self._views_of(kv_cache)
        return views, self._scores_like(views)

    def _views_of(self, kv_cache: torch.Tensor):
        """The device's views of this layer's cache, made once: the runner hands every step the
        same tensor, and a layer's handful of view ops cost as much as a decode row's scores."""
        if self._views is None or self._views[0] is not kv_cache:
            self._views = (kv_cache, self.ops.cache_views(kv_cache))
        return self._views[1]

    def _scores_like(self, views) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, _ = views.keys.shape
        if self.scores is None or self.scores.shape[0] != num_blocks:
            self.records = None
            self.scores = torch.zeros(num_blocks, num_kv_heads, block_size, dtype=torch.float32,
                                      device=views.keys.device)
        return self.scores
