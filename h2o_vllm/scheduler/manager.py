"""H2OManager: counts a request's blocks in KV space and frees tail blocks after compaction.

Runs in the engine-core process. It never hears from the workers: it evaluates the same
``kv_len_after`` they do, on the same inputs, at the step boundary after their compaction.

With prefix caching on, no block the prefix cache indexes or another request holds is ever
rewritten: a hit is copied into blocks of the request's own (vLLM's copy-on-write pairs), the
request's first compaction writes what it keeps into fresh blocks (``fresh_blocks``) and lets
its prompt blocks go back to the cache, and only prompt blocks written before that compaction
are ever cached (docs/prefix-caching.md).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.policy import kv_len_after, prefill_peak_kv_len
from h2o_vllm.scheduler.admission import Admitted, AdmissionClaims
from h2o_vllm.scheduler.records import Record, ScoreRecords
from h2o_vllm.spec import H2OAttentionSpec
from h2o_vllm.vllm_shims.kv_manager import redirect_to_copy

logger = logging.getLogger("h2o_vllm")


class H2OManager(AdmissionClaims, FullAttentionManager):
    # Hits are whole blocks: a partial-block hit would need its scores split mid-block.
    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec: H2OAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        # Filled as requests are added (scheduler.scheduling.add_request); a request the scheduler
        # never announced runs with the engine's budget.
        self.budgets = RequestBudgets(kv_cache_spec.h2o, kv_cache_spec.block_size)
        self.prompt_lens: dict[str, int] = {}
        # Logical tokens no longer in KV space, per running request:
        # kv-space length = logical length - num_evicted.
        self.num_evicted: dict[str, int] = {}
        self.num_freed_blocks = 0
        self._admitted: dict[str, Admitted] = {}  # what each admitted request may claim
        # Prefix caching (None when it is off): score records, and this step's orders.
        self.records = ScoreRecords(self.block_pool.num_gpu_blocks) if self.enable_caching else None
        self.hit_records: dict[str, Record | None] = {}  # request -> record of its cut hit
        self.longest_match: dict[str, int] = {}          # request -> blocks matched before the cut
        self.pending_records: dict[str, list[Record]] = {}
        self.fresh: dict[str, list] = {}                 # request -> its first compaction's blocks
        self.step_score_inits: list[tuple[int, int]] = []  # (copy block, record slot or -1)
        self.step_written: list[Record] = []   # records this step writes
        self.step_fresh: set[str] = set()      # requests whose fresh blocks came this step
        self.step_cached: set[int] = set()     # blocks first cached while scheduling this step
        self.awaiting: set[str] = set()        # waiting requests a record being written will serve
        self.waited: set[str] = set()          # requests that have waited for one already
        # KV transfer (kv_transfer.transfer_scheduler): requests whose prompt's state a connector loads,
        # -> the KV positions it loads.
        self.loaded: dict[str, int] = {}

    def prompt_len_of(self, request) -> int:
        """H2O's prompt length of ``request``: vLLM's, except for a KV-transfer consumer's
        request, which continues the producer's shorter prompt (``kv_transfer.transfer_scheduler``)."""
        return self.prompt_lens.get(request.request_id, request.num_prompt_tokens)

    def load(self, request_id: str, prompt_len: int, kv_len: int) -> None:
        """A connector loads ``request_id``'s prompt state: ``kv_len`` live positions for a
        ``prompt_len``-token prompt, so the request holds KV space for those, not the prompt."""
        self.loaded[request_id] = kv_len
        self.num_evicted[request_id] = prompt_len - kv_len

    def unload(self, request_id: str) -> None:
        """A load matched earlier is off (the request computes its prompt itself)."""
        if self.loaded.pop(request_id, None) is not None:
            self.num_evicted.pop(request_id, None)

    def live_block_ids(self, request_id: str, kv_len: int) -> list[int]:
        """The blocks that hold KV positions ``[0, kv_len)`` once the step being scheduled has
        run: its first compaction's fresh blocks if it has them, else the list's head."""
        blocks = self.fresh.get(request_id) or self.req_to_blocks.get(request_id, [])
        return [b.block_id for b in blocks[:cdiv(kv_len, self.block_size)]]

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int, *args, **kwargs) -> None:
        # vLLM counts blocks for the loaded prompt's tokens; H2O loads its live KV positions.
        evicted = self.num_evicted.get(request_id, 0)
        super().allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                  num_external_computed_tokens - evicted, *args, **kwargs)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """vLLM's own calls (processed-token basis) find nothing to do: H2O cuts a request's
        blocks when it schedules the step that compacts them (``cut_scheduled``)."""

    def cut_scheduled(self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int) -> None:
        """Right after ``schedule`` has counted a step's tokens (``num_computed_tokens``, vLLM's
        optimistic count): the request's blocks become what the step's compaction leaves,
        and the tail goes back to the pool at once.

        Why at schedule time: the workers truncate their block-table row while they run the
        step, and under async scheduling the next step is scheduled before this one's output
        is processed; block lists cut any later would disagree with the workers' by then.
        Why the tail may be freed before the step has run: a block handed out again is first
        written by a later step, which runs after this one (one CUDA stream; one worker
        thread on the CPU), as vLLM relies on when it frees a finished request's blocks.
        """
        budget = self.budgets.resolve(request_id, num_prompt_tokens)
        kv_len = kv_len_after(num_computed_tokens, num_prompt_tokens, budget)
        evicted, previous = num_computed_tokens - kv_len, self.num_evicted.get(request_id, 0)
        self.num_evicted[request_id] = evicted
        if evicted == previous:
            return  # nothing compacted since the last cut
        blocks = self.req_to_blocks.get(request_id)
        num_keep = cdiv(kv_len, self.block_size)
        fresh = self.fresh.pop(request_id, None)
        if fresh is not None:  # the first compaction writes into these: the row becomes them
            tail, blocks[:] = blocks[::-1], fresh
            self.block_pool.free_blocks(tail)
            self.num_freed_blocks += len(tail) - len(fresh)
            return
        if not blocks or len(blocks) <= num_keep:
            return
        tail = blocks[num_keep:]
        del blocks[num_keep:]
        # Reverse order, as vLLM frees a finished request: tail blocks leave first.
        self.block_pool.free_blocks(reversed(tail))
        self.num_freed_blocks += len(tail)
        logger.debug("h2o: request %s at %d tokens keeps %d in KV space (%d evicted), freed %d "
                     "blocks, holds %d", request_id, num_computed_tokens, kv_len, evicted,
                     len(tail), len(blocks))

    def _kv_tokens(self, request_id: str, num_tokens: int) -> int:
        return num_tokens - self.num_evicted.get(request_id, 0)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   *args, apply_admission_cap: bool = False, **kwargs) -> int:
        kv_tokens = self._kv_tokens(request_id, num_tokens)
        if apply_admission_cap:
            # vLLM checks that a request's whole sequence fits before admitting it
            # (scheduler_reserve_full_isl), as it caps sliding-window requests at their peak:
            # H2O caps at the request's peak too (its prompt, unless chunked).
            kv_tokens = min(kv_tokens, self._prefill_peak(request_id, num_tokens))
        blocks = super().get_num_blocks_to_allocate(request_id, kv_tokens, new_computed_blocks,
                                                    *args, apply_admission_cap=apply_admission_cap,
                                                    **kwargs)
        if self.records is not None:
            # A hit is copied into blocks of the request's own; a first compaction writes into
            # fresh blocks.
            blocks += len(new_computed_blocks) + self._fresh_count(request_id, num_tokens)
        return blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        new = super().allocate_new_blocks(request_id, self._kv_tokens(request_id, num_tokens),
                                          self._kv_tokens(request_id, num_tokens_main_model))
        if self.records is not None and request_id not in self.fresh:
            count = self._fresh_count(request_id, num_tokens_main_model)
            if count:
                self.fresh[request_id] = self.block_pool.get_new_blocks(count)
                self.step_fresh.add(request_id)
        return new

    def step_shortened(self, request_id: str, num_tokens: int) -> None:
        """The step just allocated for ends at ``num_tokens`` logical tokens after all
        (``scheduling.drop_padding``): fresh blocks sized for the longer step are sized anew, and
        what that leaves over goes back to the pool."""
        if request_id not in self.step_fresh:
            return
        fresh = self.fresh.pop(request_id)
        count = self._fresh_count(request_id, num_tokens)
        if count:
            self.fresh[request_id] = fresh[:count]
        else:
            self.step_fresh.discard(request_id)
        self.block_pool.free_blocks(fresh[count:])

    def _prefill_peak(self, request_id: str, num_tokens: int) -> int:
        prompt_len = self.prompt_lens.get(request_id)
        if prompt_len is None:
            return num_tokens
        return prefill_peak_kv_len(num_tokens, prompt_len, self.budgets.resolve(request_id, prompt_len))

    def _fresh_count(self, request_id: str, num_tokens: int) -> int:
        """Blocks the first compaction needs when it comes in the step that ends at
        ``num_tokens`` logical tokens (0 when it does not)."""
        if self.num_evicted.get(request_id, 0) or request_id in self.fresh:
            return 0
        prompt_len = self.prompt_lens.get(request_id)
        if prompt_len is None:
            return 0
        budget = self.budgets.resolve(request_id, prompt_len)
        kv_len = kv_len_after(num_tokens, prompt_len, budget)
        return cdiv(kv_len, self.block_size) if kv_len < num_tokens else 0

    def pop_blocks_for_free(self, request_id: str):
        self.num_evicted.pop(request_id, None)
        self.loaded.pop(request_id, None)
        self._admitted.pop(request_id, None)
        self.forget_prefix_state(request_id)
        fresh = self.fresh.pop(request_id, [])
        return super().pop_blocks_for_free(request_id) + fresh

    def forget_prefix_state(self, request_id: str) -> None:
        """A request that stops (finishes, aborts, is preempted) drops the records it has not
        written yet; a preempted one plans again when it is admitted again."""
        self.hit_records.pop(request_id, None)
        self.longest_match.pop(request_id, None)
        self.awaiting.discard(request_id)
        self.waited.discard(request_id)
        for record in self.pending_records.pop(request_id, ()):
            self.records.drop(record)

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # Only blocks of the prompt, and only before the first compaction: past it the row is
        # in KV space, where a block no longer holds the tokens its hash names.
        rid = request.request_id
        if self.num_evicted.get(rid, 0) or rid in self.loaded:  # a loaded prompt has no score records
            return
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, min(num_tokens, self.prompt_len_of(request)), *args, **kwargs)
        # Hashed now, computed by the step being scheduled: not a hit before that step has run
        # (vLLM copies a hit before the step, from blocks that must already hold their K/V).
        new = self.req_to_blocks.get(rid, [])[before:self.num_cached_block.get(rid, 0)]
        self.step_cached.update(block.block_id for block in new)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence, *args,
                                  **kwargs) -> None:
        """vLLM adds the hit's blocks to the request; each is then redirected to a block of the
        request's own, copied by vLLM before the step runs (its copy-on-write pairs), with its
        scores from the hit's record: the request scores and compacts only blocks it owns."""
        super().add_local_computed_blocks(request_id, new_computed_blocks, *args, **kwargs)
        blocks = self.req_to_blocks[request_id]
        hit = list(blocks)
        copies = self.block_pool.get_new_blocks(len(hit))
        record = self.hit_records.get(request_id)
        for j, (source, copy) in enumerate(zip(hit, copies)):
            redirect_to_copy(self, request_id, j, source, copy)
            self.step_score_inits.append((copy.block_id, record.slots[j] if record else -1))


def h2o_managers(kv_cache_manager) -> list[H2OManager]:
    """The H2O managers of a ``KVCacheManager``, one per H2O KV-cache group, in group order."""
    return [m for m in kv_cache_manager.coordinator.single_type_managers if isinstance(m, H2OManager)]


def whole_managers(kv_cache_manager) -> list[FullAttentionManager]:
    """The full-attention groups H2O leaves whole (a drafter's layers): they grow with every
    token. (Exactly vLLM's class: H2O's managers derive from it, and the managers vLLM derives
    from it, like the sliding windows' and Mamba's, are left to vLLM's own admission.)"""
    return [m for m in kv_cache_manager.coordinator.single_type_managers if type(m) is FullAttentionManager]
