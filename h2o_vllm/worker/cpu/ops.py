"""The CPU's ``DeviceOps``: its cache layout, torch attention and scores, torch compaction.

Runs in the worker process. Keys are read in the cache's own layout (``layout.py``); the
decode rows' key blocks are indexed once per step (``DecodeIndex``), by the first layer that
scores them at once, and every later layer reuses it.
Rows with several queries get their attention and scores from one softmax (``prefill.py``);
decode rows keep vLLM's kernel, and their probabilities are recomputed (``scores.py``), in
the engine a row's queries together when its scores are next needed (``deferred.py``).
Compaction is the kernels' plain-torch twin, which takes strided views as they are.
An fp8 cache (``worker.kv_dtype``) is read as ``fp8 * scale`` without dequantising it: the key
scale folds into the query's softmax scale and the value scale into the output, a multiply per
query instead of one per cached element; compaction moves the fp8 elements as they are.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from h2o_vllm.kernels import torch_ops
from h2o_vllm.worker.cpu.deferred import DeferredDecode, PendingQueries
from h2o_vllm.worker.cpu.layout import CacheViews, cache_views
from h2o_vllm.worker.cpu.prefill import prefill_attention
from h2o_vllm.worker.cpu.scores import DecodeIndex, accumulate_decode_scores_at, decode_index
from h2o_vllm.worker.kv_dtype import StoredKVReads
from h2o_vllm.worker.step import H2OStep, zero_new_slots


class CPUOps(StoredKVReads):
    def cache_views(self, kv_cache: torch.Tensor) -> CacheViews:
        return cache_views(kv_cache, self.fp8_dtype)

    def step_index(self, step: H2OStep, block_size: int, buffers=None) -> Callable[[], DecodeIndex] | None:
        """The decode rows' ``DecodeIndex``, built by the first layer that asks: on a step whose
        decode queries all wait (``deferred.py``) no layer does. (No graph replays the CPU's
        steps: fresh tensors, whatever ``buffers``.)"""
        if step.decode_rows is None:
            return None
        rows = step.decode_rows
        return functools.cache(lambda: decode_index(step.block_table[rows], step.plan.kv_seq_lens[rows],
                                                    block_size, weighted=step.score_scale is not None))

    def attend(self, step: H2OStep, query: torch.Tensor, views: CacheViews, out: torch.Tensor | None,
               scores: torch.Tensor, scale: float, softcap: float = 0.0,
               sink_logits: torch.Tensor | None = None, deferred: DeferredDecode | None = None,
               pending: PendingQueries | None = None) -> None:
        """The prefill rows' attention output into ``out`` and the step's scores (new slots
        zeroed first), after vLLM's kernel has attended the decode rows alone. Replaces the
        zeroing and ``accumulate`` in ``update_scores_and_compact``. With ``deferred`` (and
        the layer's ``pending``), decode queries wait and rows' waiting queries are scored
        as it decides. query, out: [>= num_tokens, num_q_heads, head_size]; out None: the
        scores alone, vLLM's kernel having attended every row (an fp8 cache, ``backend.py``)."""
        zero_new_slots(step, scores)
        scale *= self.k_scale
        if deferred is not None:
            pending.apply(deferred, query, views.key_blocks, scores, scale, softcap, sink_logits)
        if deferred is None or deferred.immediate:
            self._decode_scores(step, query, views, scores, scale, softcap, sink_logits)
        self._prefill_rows(step, query, views, scores, scale, out, softcap, sink_logits)

    def accumulate(self, step: H2OStep, query: torch.Tensor, views: CacheViews,
                   scores: torch.Tensor, scale: float, softcap: float = 0.0,
                   sink_logits: torch.Tensor | None = None) -> None:
        scale *= self.k_scale
        self._decode_scores(step, query, views, scores, scale, softcap, sink_logits)
        self._prefill_rows(step, query, views, scores, scale, None, softcap, sink_logits)

    def _decode_scores(self, step: H2OStep, query, views: CacheViews, scores, scale: float,
                       softcap: float, sink_logits: torch.Tensor | None) -> None:
        if step.device_index is None:
            return
        weights, factors = step.query_weight, step.score_scale  # both None: paper H2O
        tokens, rows = step.decode_tokens, step.decode_rows
        accumulate_decode_scores_at(query[tokens], views.key_blocks, scores, step.device_index(), scale,
                                    None if weights is None else weights[tokens],
                                    None if factors is None else factors[rows], softcap, sink_logits)

    def _prefill_rows(self, step: H2OStep, query, views: CacheViews, scores, scale: float,
                      out: torch.Tensor | None, softcap: float, sink_logits: torch.Tensor | None) -> None:
        """Scores of the rows with several queries, and their attention output unless out is
        None (``scale``: the key scale folded in)."""
        if step.prefill_rows is None:
            return
        plan, weights, factors = step.plan, step.query_weight, step.score_scale
        firsts = None if step.prefill_first_scored is None else step.prefill_first_scored.tolist()
        for i, row in enumerate(step.prefill_rows.tolist()):
            start, q_len = int(plan.query_starts[row]), int(plan.query_lens[row])
            tokens = slice(start, start + q_len)
            prefill_attention(query[tokens], views.key_blocks, views.values, scores,
                              step.block_table[row], int(plan.kv_seq_lens[row]), scale,
                              None if out is None else out[tokens],
                              None if weights is None else weights[tokens],
                              None if factors is None else factors[row],
                              0 if firsts is None else firsts[i], softcap, sink_logits, self.v_scale)

    def compact(self, views: CacheViews, scores: torch.Tensor, block_table: torch.Tensor,
                rows: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor) -> None:
        torch_ops.compact_rows(views.keys, views.values, scores, block_table, rows, keep, targets)
