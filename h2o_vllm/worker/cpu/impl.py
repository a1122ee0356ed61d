"""H2OCPUImpl: write K/V in KV space -> stock paged kernel -> accumulate scores -> compact.

Runs in the worker process, once per attention layer per step (ARCHITECTURE.md, "Step order").
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from h2o_vllm import metrics
from h2o_vllm.config import config_from_additional
from h2o_vllm.worker.cpu.builder import H2OCPUAttentionMetadata
from h2o_vllm.worker.cpu.compact import compact_row, row_slots
from h2o_vllm.worker.cpu.layout import cache_views
from h2o_vllm.worker.cpu.scores import accumulate_decode_scores_at, accumulate_prefill_scores


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
        by_slot = self.scores.permute(0, 2, 1)  # [num_blocks, block_size, num_kv_heads]

        # A slot's score starts when its K/V is written (slots are reused across requests).
        by_slot[md.written] = 0.0

        if md.decode is not None:
            accumulate_decode_scores_at(query[plan.query_starts[plan.decode_rows]], views.key_blocks,
                                        self.scores, md.decode, self.scale)
        for row in plan.prefill_rows:
            start, q_len = int(plan.query_starts[row]), int(plan.query_lens[row])
            accumulate_prefill_scores(query[start:start + q_len], views.key_blocks, self.scores,
                                      md.block_table[row], int(plan.kv_seq_lens[row]), self.scale)
        for row in plan.due_rows:
            kv_len, target = int(plan.kv_seq_lens[row]), int(plan.kv_lens_after[row])
            blocks, offsets = row_slots(md.block_table[row], kv_len, block_size)
            mass = float(by_slot[blocks, offsets].sum())
            compact_row(views.keys, views.values, by_slot, md.block_table[row], kv_len,
                        target, int(plan.heavy[row]))
            kept = float(by_slot[blocks[:target], offsets[:target]].sum())
            metrics.recorder().add(evicted_attention_mass=mass - kept, attention_mass=mass)
