"""H2OManager: counts a request's blocks in KV space and frees tail blocks after compaction.

Runs in the engine-core process. It never hears from the workers: it evaluates the same
``kv_len_after`` they do, on the same inputs, at the step boundary after their compaction.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.policy import kv_len_after, peak_kv_len
from h2o_vllm.scheduler.spec import H2OAttentionSpec

logger = logging.getLogger("h2o_vllm")


class H2OManager(FullAttentionManager):
    # Compaction rewrites block contents: no block may ever be found by its token hash.
    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec: H2OAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        # Filled as requests are added (scheduler.step.add_request); a request the scheduler
        # never announced runs with the engine's budget.
        self.budgets = RequestBudgets(kv_cache_spec.h2o, kv_cache_spec.block_size)
        # Logical tokens no longer in KV space, per running request:
        # kv-space length = logical length - num_evicted.
        self.num_evicted: dict[str, int] = {}
        self.num_freed_blocks = 0
        self._admitted: dict[str, tuple[int, int, int]] = {}  # (peak, prefill, interval) in blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return
        budget = self.budgets.resolve(request_id, num_prompt_tokens)
        kv_len = kv_len_after(processed_computed_tokens, num_prompt_tokens, budget)
        self.num_evicted[request_id] = processed_computed_tokens - kv_len
        blocks = self.req_to_blocks.get(request_id)
        num_keep = cdiv(kv_len, self.block_size)
        if not blocks or len(blocks) <= num_keep:
            return
        tail = blocks[num_keep:]
        del blocks[num_keep:]
        # Reverse order, as vLLM frees a finished request: tail blocks leave first.
        self.block_pool.free_blocks(reversed(tail))
        self.num_freed_blocks += len(tail)
        logger.debug("h2o: request %s at %d tokens keeps %d in KV space (%d evicted), freed %d "
                     "blocks, holds %d", request_id, processed_computed_tokens, kv_len,
                     self.num_evicted[request_id], len(tail), len(blocks))

    def admission_headroom(self, request, num_new_tokens: int, max_model_len: int) -> int:
        """Free blocks to keep beyond what admitting ``request`` allocates now (vLLM adds it to
        its admission watermark): what each running sequence claims over its next interval of
        tokens, and what the newcomer claims after its prefill step, less that prefill.

        Why an interval: an H2O sequence compacts every interval, so that is all it can grow
        before it gives blocks back (its peak, ``peak_kv_len``, is small and known). Keeping
        that room stops admissions from taking the blocks running sequences are about to
        need, which vLLM would reclaim by preempting one: a recompute of its whole logical
        sequence, to free two or three blocks. A sequence whose budget exceeds its length
        never compacts; for it the same horizon keeps one interval, about as optimistic as
        stock vLLM's admission.
        """
        rid, prompt_len = request.request_id, request.num_prompt_tokens
        budget = self.budgets.resolve(rid, prompt_len)
        max_len = min(prompt_len + request.max_tokens, max_model_len)
        peak = cdiv(peak_kv_len(prompt_len, max_len, budget), self.block_size)
        horizon = cdiv(budget.interval, self.block_size)
        prefill = cdiv(request.num_tokens, self.block_size)  # a recompute prefills its outputs too
        self._admitted[rid] = (peak, prefill, horizon)
        reserve = sum(self._next_interval_claim(other, len(blocks))
                      for other, blocks in self.req_to_blocks.items() if other != rid)
        allocating = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if allocating < prefill:  # a chunked prefill claims the rest while others grow
            return prefill - allocating + reserve
        after = cdiv(kv_len_after(request.num_tokens, prompt_len, budget), self.block_size)
        return max(0, min(peak, after + horizon) + reserve - allocating)

    def _next_interval_claim(self, request_id: str, held: int) -> int:
        peak, prefill, horizon = self._admitted.get(request_id, (0, 0, 0))
        # Until its first compaction a sequence may still claim the rest of its prefill.
        limit = peak if self.num_evicted.get(request_id, 0) else max(peak, prefill)
        return max(0, min(limit, held + horizon) - held)

    def _kv_tokens(self, request_id: str, num_tokens: int) -> int:
        return num_tokens - self.num_evicted.get(request_id, 0)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._kv_tokens(request_id, num_tokens),
                                                  *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        return super().allocate_new_blocks(request_id, self._kv_tokens(request_id, num_tokens),
                                           self._kv_tokens(request_id, num_tokens_main_model))

    def pop_blocks_for_free(self, request_id: str):
        self.num_evicted.pop(request_id, None)
        self._admitted.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids: list[int],
                               *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        return

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence, *args,
                                  **kwargs) -> None:
        assert not new_computed_blocks, "H2O requests never get prefix-cache hits"
