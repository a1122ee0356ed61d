"""The CUDA path's ``DeviceOps``: Triton attention's cache layout and H2O's Triton kernels,
and ``attend``, the fused attention that replaces vLLM's attention and ``accumulate``.

Runs in the worker process (on the CPU too, under ``TRITON_INTERPRET=1``). Triton attention's
kv_cache is [num_blocks, num_kv_heads, block_size, 2 * head_size]; ``transpose(1, 2).split``
gives K and V as [num_blocks, block_size, num_kv_heads, head_size] views, the kernels' layout.
An fp8 cache (vLLM allocates it as bytes) is viewed as float8_e4m3fn, as vLLM's Triton backend
views it, and read with the layer's per-tensor scales (``read_scales``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from h2o_vllm import kernels  # launchers load lazily, with Triton (kernels.__init__)
from h2o_vllm.worker.kv_dtype import StoredKVReads
from h2o_vllm.worker.step import H2OStep
from h2o_vllm.worker.step_buffers import FreshTensors, StepBuffers


class TritonCacheViews(NamedTuple):
    keys: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_size]
    values: torch.Tensor


class FusedIndex(NamedTuple):
    """Per step, for the fused attention (kernels.attention): where each decode row's logits
    go in the scratch (-1: not a decode row), the scratch's length in keys, and the bound on
    the rows' key counts a split-KV decode is shaped by (``kernels.num_splits``; a
    graph-shaped step's is its width, so its launches keep one shape)."""
    decode_offsets: torch.Tensor  # [num_rows] int64, device
    num_decode_keys: int
    max_kv_len: int


class TritonOps(StoredKVReads):
    def __init__(self, head_size: int, fp8_dtype: torch.dtype | None = None) -> None:
        super().__init__(fp8_dtype)
        self.head_size = head_size

    def cache_views(self, kv_cache: torch.Tensor) -> TritonCacheViews:
        keys, values = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if self.fp8_dtype is not None:
            keys, values = keys.view(self.fp8_dtype), values.view(self.fp8_dtype)
        return TritonCacheViews(keys, values)

    def write_fp8(self, views: TritonCacheViews, key: torch.Tensor, value: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """K/V stored in an fp8 cache as a GPU stores them: ``x / scale`` in fp32, saturated,
        rounded to nearest even (``oracle.stored_kv``'s rule). Slots -1 (padding) are skipped."""
        live = slot_mapping >= 0
        slots = slot_mapping[live]
        block_size = views.keys.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        largest = torch.finfo(self.fp8_dtype).max
        for cache, x, scale in ((views.keys, key, self.k_scale), (views.values, value, self.v_scale)):
            x = x[: slot_mapping.shape[0]][live].view(-1, *cache.shape[2:])
            cache[blocks, offsets] = (x.float() / scale).clamp(-largest, largest).to(self.fp8_dtype)

    def step_index(self, step: H2OStep, block_size: int,
                   buffers: StepBuffers | None = None) -> FusedIndex:
        """Graph-shaped decode (``step.decode_width``): each row's logits take a range of that
        width, so the scratch's size and the offsets are the batch size's, not the lengths'."""
        buffers = buffers or FreshTensors(step.block_table.device)
        query_lens = step.plan.query_lens
        if step.decode_width:
            lens = torch.full_like(query_lens, step.decode_width)
        else:
            lens = step.plan.kv_seq_lens
        offsets, num_keys = kernels.decode_logit_offsets(query_lens, lens)
        max_kv_len = int(lens.max()) if lens.numel() else 0
        return FusedIndex(buffers.put("decode_offsets", offsets, reserve=buffers.rows), num_keys,
                          max_kv_len)

    def attend(self, step: H2OStep, query: torch.Tensor, views: TritonCacheViews,
               out: torch.Tensor, scores: torch.Tensor, scale: float,
               query_start_loc: torch.Tensor, softcap: float = 0.0,
               sink_logits: torch.Tensor | None = None) -> None:
        """The step's attention output into out and its scores into scores, from the same
        pass over K and V (kernels.h2o_attention); then, for rows with several queries, one
        more pass over their K with the log-sum-exp it returned. A decode-only step of few,
        long rows splits each row's keys over programs instead (kernels.h2o_split_decode,
        ``kernels.num_splits``), as vLLM's 3D kernel does. Replaces vLLM's
        unified_attention, the zeroing of the new slots' scores and accumulate.

        query, out: [>= num_tokens, num_q_heads, head_size]; query_start_loc: the batch's
        (vLLM's metadata, device int32, [>= num_rows + 1])."""
        index = step.device_index
        if index is None:  # a step made without kv_space_metadata (tests, benchmarks)
            index = self.step_index(step, views.keys.shape[1])
        num_rows = step.plan.query_lens.shape[0]
        num_tokens = int(step.plan.query_lens.sum())
        query = query[:num_tokens]
        weights, factors = step.query_weight, step.score_scale  # both None: paper H2O
        splits = kernels.num_splits(num_rows, views.keys.shape[2], index.max_kv_len)
        if step.prefill_rows is None and splits > 1:  # few, long decode rows: flash-decoding
            kernels.h2o_split_decode(
                query, views.keys, views.values, out[:num_tokens], step.block_table,
                step.kv_seq_lens, scale, scores, index.decode_offsets, index.num_decode_keys,
                num_splits=splits, max_kv_len=index.max_kv_len, query_weight=weights,
                score_scale=factors, softcap=softcap, sinks=sink_logits, k_scale=self.k_scale,
                v_scale=self.v_scale)
            return
        lse = kernels.h2o_attention(
            query, views.keys, views.values, out[:num_tokens], step.block_table,
            query_start_loc[:num_rows + 1], step.kv_seq_lens, scale, scores=scores,
            decode_offsets=index.decode_offsets, num_decode_keys=index.num_decode_keys,
            query_weight=weights, score_scale=factors, softcap=softcap, sinks=sink_logits,
            k_scale=self.k_scale, v_scale=self.v_scale)
        if step.prefill_rows is not None:
            tokens, rows = step.prefill_tokens, step.prefill_rows
            q, q_lse, w = ((query, lse, weights) if tokens is None
                           else (query[tokens], lse[tokens], _take(weights, tokens)))
            kernels.accumulate_prefill_scores_from_lse(
                q, views.keys, step.block_table[rows], step.prefill_query_start_loc,
                step.kv_seq_lens[rows], q_lse, scores, scale, max_kv_len=step.max_prefill_kv_len,
                query_weight=w, score_scale=_take(factors, rows), fresh_new_slots=True,
                first_scored=step.prefill_first_scored, softcap=softcap, k_scale=self.k_scale)

    def accumulate(self, step: H2OStep, query: torch.Tensor, views: TritonCacheViews,
                   scores: torch.Tensor, scale: float, softcap: float = 0.0,
                   sink_logits: torch.Tensor | None = None) -> None:
        """The unfused path (after vLLM's attention): the tested reference of attend."""
        weights, factors = step.query_weight, step.score_scale  # both None: paper H2O
        if step.decode_rows is not None:
            tokens, rows = step.decode_tokens, step.decode_rows
            kernels.accumulate_decode_scores(
                query[tokens], views.keys, step.block_table[rows], step.kv_seq_lens[rows],
                scores, scale, query_weight=_take(weights, tokens), score_scale=_take(factors, rows),
                softcap=softcap, sinks=sink_logits, k_scale=self.k_scale)
        if step.prefill_rows is not None:
            tokens, rows = step.prefill_tokens, step.prefill_rows
            q, w = (query, weights) if tokens is None else (query[tokens], _take(weights, tokens))
            kernels.accumulate_prefill_scores(
                q, views.keys, step.block_table[rows], step.prefill_query_start_loc,
                step.kv_seq_lens[rows], scores, scale,
                max_query_len=step.max_prefill_query_len, max_kv_len=step.max_prefill_kv_len,
                query_weight=w, score_scale=_take(factors, rows), first_scored=step.prefill_first_scored,
                softcap=softcap, sinks=sink_logits, k_scale=self.k_scale)

    def compact(self, views: TritonCacheViews, scores: torch.Tensor, block_table: torch.Tensor,
                rows: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor) -> None:
        kernels.compact_rows(views.keys, views.values, scores, block_table, rows, keep, targets)


def _take(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[index]
