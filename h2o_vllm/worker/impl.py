"""H2OCPUImpl: write K/V in KV space -> stock paged kernel -> accumulate scores -> compact.

Runs in the worker process, once per attention layer per step (ARCHITECTURE.md, "Step order").
"""
from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from h2o_vllm import metrics
from h2o_vllm.config import config_from_additional
from h2o_vllm.worker.builder import H2OCPUAttentionMetadata
from h2o_vllm.worker.compact import compact_row
from h2o_vllm.worker.layout import cache_views
from h2o_vllm.worker.scores import accumulate_decode_scores, accumulate_prefill_scores, row_slots


class H2OCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.h2o = config_from_additional(get_current_vllm_config().additional_config)
        # scores: [num_blocks, num_kv_heads, block_size] fp32, KV-space; allocated on first use
        # because the cache size is only known once vLLM has profiled memory.
        self.scores: torch.Tensor | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: H2OCPUAttentionMetadata | None,
                output, output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # warm-up
            return output
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        if attn_metadata.plan is not None and self.kv_sharing_target_layer_name is None:
            self._update_scores_and_compact(query, kv_cache, attn_metadata)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        num_tokens = slot_mapping.shape[0]
        super().do_kv_cache_update(layer, key[:num_tokens], value[:num_tokens], kv_cache, slot_mapping)

    def _update_scores_and_compact(self, query: torch.Tensor, kv_cache: torch.Tensor,
                                   md: H2OCPUAttentionMetadata) -> None:
        plan = md.plan
        views = cache_views(kv_cache)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        if self.scores is None or self.scores.shape[0] != num_blocks:
            self.scores = torch.zeros(num_blocks, num_kv_heads, block_size, dtype=torch.float32)
        scores = self.scores.permute(0, 2, 1)  # [num_blocks, block_size, num_kv_heads]

        # A slot's score starts when its K/V is written (slots are reused across requests).
        new = md.slot_mapping[md.slot_mapping >= 0]
        scores[new // block_size, new % block_size] = 0.0

        num_rows = plan.query_lens.shape[0]
        kv_seq_lens = plan.kv_seq_lens
        starts = md.query_start_loc[:num_rows].long()
        decode = (plan.query_lens == 1).nonzero().flatten()
        if decode.numel():
            accumulate_decode_scores(query[starts[decode]], views.keys, scores,
                                     md.block_table[decode], kv_seq_lens[decode], self.scale)
        for row in (plan.query_lens > 1).nonzero().flatten().tolist():
            start, q_len = int(starts[row]), int(plan.query_lens[row])
            accumulate_prefill_scores(query[start:start + q_len], views.keys, scores,
                                      md.block_table[row], int(kv_seq_lens[row]), self.scale)
        for row in plan.due.nonzero().flatten().tolist():
            kv_len, target = int(kv_seq_lens[row]), int(plan.kv_lens_after[row])
            blocks, offsets = row_slots(md.block_table[row], kv_len, block_size)
            mass = float(scores[blocks, offsets].sum())
            compact_row(views.keys, views.values, scores, md.block_table[row], kv_len,
                        target, int(plan.heavy[row]))
            kept = float(scores[blocks[:target], offsets[:target]].sum())
            metrics.recorder().add(evicted_attention_mass=mass - kept, attention_mass=mass)
