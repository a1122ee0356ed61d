"""The CPU's ``DeviceOps``: its cache layout, torch score accumulation, torch compaction.

Runs in the worker process. Keys are read in the cache's own layout (``layout.py``); the
decode rows' key blocks are indexed once per step (``DecodeIndex``) and every layer reuses it.
Compaction is the kernels' plain-torch twin, which takes strided views as they are.
"""
from __future__ import annotations

import torch

from h2o_vllm.kernels import twins
from h2o_vllm.worker.cpu.layout import CacheViews, cache_views
from h2o_vllm.worker.cpu.scores import (DecodeIndex, accumulate_decode_scores_at,
                                        accumulate_prefill_scores, decode_index)
from h2o_vllm.worker.step import H2OStep


class CPUOps:
    def cache_views(self, kv_cache: torch.Tensor) -> CacheViews:
        return cache_views(kv_cache)

    def step_index(self, step: H2OStep, block_size: int) -> DecodeIndex | None:
        if step.decode_rows is None:
            return None
        rows = step.decode_rows
        return decode_index(step.block_table[rows], step.plan.kv_seq_lens[rows], block_size,
                            weighted=step.score_scale is not None)

    def accumulate(self, step: H2OStep, query: torch.Tensor, views: CacheViews,
                   scores: torch.Tensor, scale: float) -> None:
        weights, factors = step.query_weight, step.score_scale  # both None: paper H2O
        if step.device_index is not None:
            tokens, rows = step.decode_tokens, step.decode_rows
            accumulate_decode_scores_at(query[tokens], views.key_blocks, scores,
                                        step.device_index, scale,
                                        None if weights is None else weights[tokens],
                                        None if factors is None else factors[rows])
        if step.prefill_rows is None:
            return
        plan = step.plan
        for row in step.prefill_rows.tolist():
            start, q_len = int(plan.query_starts[row]), int(plan.query_lens[row])
            accumulate_prefill_scores(query[start:start + q_len], views.key_blocks, scores,
                                      step.block_table[row], int(plan.kv_seq_lens[row]), scale,
                                      None if weights is None else weights[start:start + q_len],
                                      None if factors is None else factors[row])

    def compact(self, views: CacheViews, scores: torch.Tensor, block_table: torch.Tensor,
                rows: torch.Tensor, keep: torch.Tensor) -> None:
        twins.compact_rows(views.keys, views.values, scores, block_table, rows, keep)
