"""The CUDA path's ``DeviceOps``: Triton attention's cache layout and H2O's Triton kernels.

Runs in the worker process (on the CPU too, under ``TRITON_INTERPRET=1``). Triton attention's
kv_cache is [num_blocks, num_kv_heads, block_size, 2 * head_size]; ``transpose(1, 2).split``
gives K and V as [num_blocks, block_size, num_kv_heads, head_size] views, the kernels' layout.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from h2o_vllm.worker.step import H2OStep


class TritonCacheViews(NamedTuple):
    keys: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_size]
    values: torch.Tensor


class TritonOps:
    def __init__(self, head_size: int) -> None:
        self.head_size = head_size

    def cache_views(self, kv_cache: torch.Tensor) -> TritonCacheViews:
        return TritonCacheViews(*kv_cache.transpose(1, 2).split(self.head_size, dim=-1))

    def step_index(self, step: H2OStep, block_size: int) -> None:
        return None

    def accumulate(self, step: H2OStep, query: torch.Tensor, views: TritonCacheViews,
                   scores: torch.Tensor, scale: float) -> None:
        from h2o_vllm import kernels
        weights, factors = step.query_weight, step.score_scale  # both None: paper H2O
        if step.decode_rows is not None:
            tokens, rows = step.decode_tokens, step.decode_rows
            kernels.accumulate_decode_scores(
                query[tokens], views.keys, step.block_table[rows], step.kv_seq_lens[rows],
                scores, scale, query_weight=_take(weights, tokens), score_scale=_take(factors, rows))
        if step.prefill_rows is not None:
            tokens, rows = step.prefill_tokens, step.prefill_rows
            q, w = (query, weights) if tokens is None else (query[tokens], _take(weights, tokens))
            kernels.accumulate_prefill_scores(
                q, views.keys, step.block_table[rows], step.prefill_query_start_loc,
                step.kv_seq_lens[rows], scores, scale,
                max_query_len=step.max_prefill_query_len, max_kv_len=step.max_prefill_kv_len,
                query_weight=w, score_scale=_take(factors, rows))

    def compact(self, views: TritonCacheViews, scores: torch.Tensor, block_table: torch.Tensor,
                rows: torch.Tensor, keep: torch.Tensor) -> None:
        from h2o_vllm import kernels
        kernels.compact_rows(views.keys, views.values, scores, block_table, rows, keep)


def _take(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[index]
