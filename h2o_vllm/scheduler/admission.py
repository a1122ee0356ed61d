"""What an H2O manager keeps free when vLLM admits a request: the room its running sequences
will grow into over their next interval, in its own KV-cache group and in the full-attention
groups H2O leaves whole (a drafter's), so that an admission never makes vLLM preempt.

A mixin of ``H2OManager`` (it reads the manager's block lists, budgets and loads); vLLM's
admission watermark is raised by these claims in ``scheduler.scheduling.admission_watermark``.
"""
from __future__ import annotations

from typing import NamedTuple

from vllm.utils.math_utils import cdiv

from h2o_vllm.policy import kv_len_after, peak_kv_len, prefill_peak_kv_len


class Admitted(NamedTuple):
    """What an admitted request may claim, recorded when it is admitted."""
    peak: int       # blocks its H2O group holds at most
    prefill: int    # blocks its prefill holds at most
    horizon: int    # tokens it grows by between two checks (an interval or a chunk), drafts' too
    length: int     # tokens of its whole sequence, drafts' too: what a whole group holds at most


def _growth(held: int, limit: int, horizon: int) -> int:
    """Blocks a sequence holding ``held`` adds over the next ``horizon`` blocks, up to ``limit``."""
    return max(0, min(limit, held + horizon) - held)


class AdmissionClaims:
    def admission_headroom(self, request, num_new_tokens: int, max_model_len: int, lookahead: int = 0) -> int:
        """Free blocks to keep beyond what admitting ``request`` allocates now (vLLM adds it to
        its admission watermark): what each running sequence claims over its next interval of
        tokens, and what the newcomer claims after its prefill step, less that prefill.

        Why an interval: an H2O sequence compacts every interval, so that is all it can grow
        before it gives blocks back (its peak, ``peak_kv_len``, is small and known). Keeping
        that room stops admissions from taking the blocks running sequences are about to
        need, which vLLM would reclaim by preempting one: a recompute of its whole logical
        sequence, to free two or three blocks. A sequence whose budget exceeds its length
        never compacts; for it the same horizon keeps one interval, about as optimistic as
        stock vLLM's admission. ``lookahead``: the slots vLLM allocates past every step for
        drafts (speculative decoding), on top of each of these.
        """
        rid, prompt_len = request.request_id, self.prompt_len_of(request)
        budget = self.budgets.resolve(rid, prompt_len)
        max_len = min(prompt_len + request.max_tokens, max_model_len)
        peak = cdiv(peak_kv_len(prompt_len, max_len, budget) + lookahead, self.block_size)
        # A chunked prompt grows a chunk between checks, as a decoding sequence does an interval.
        horizon = max(budget.interval, budget.prefill_chunk or 0) + lookahead
        # A recompute prefills its outputs too; a chunked prompt never holds more than its peak.
        prefill = cdiv(prefill_peak_kv_len(request.num_tokens, prompt_len, budget), self.block_size)
        computed = request.num_computed_tokens
        if rid in self.loaded:  # its prompt arrives compacted: it prefills nothing
            prefill = cdiv(self.loaded[rid] + request.num_tokens - prompt_len, self.block_size)
            computed = self.loaded[rid]
        self._admitted[rid] = Admitted(peak, prefill, horizon, max_len + lookahead)
        reserve = sum(self._next_interval_claim(other, len(blocks))
                      for other, blocks in self.req_to_blocks.items() if other != rid)
        allocating = cdiv(computed + num_new_tokens + lookahead, self.block_size)
        if allocating < prefill:  # a chunked prefill claims the rest while others grow
            return prefill - allocating + reserve
        after = cdiv(kv_len_after(request.num_tokens, prompt_len, budget), self.block_size)
        return max(0, min(peak, after + cdiv(horizon, self.block_size)) + reserve - allocating)

    def whole_group_headroom(self, group, request, step_end: int) -> int:
        """What ``group``, a KV-cache group H2O leaves whole (a drafter's layers), claims beyond
        this allocation when ``request`` is being admitted (after ``admission_headroom``, which
        records its horizon): each running sequence's growth over its next interval, and the
        newcomer's from the end of this step (``step_end`` tokens) to an interval past its
        prefill, each up to its whole length.

        Why: the whole group's blocks come from the pool H2O's groups compact into, so an
        admission that leaves room for H2O's growth alone still takes the blocks a drafter's
        cache needs next, and vLLM preempts. The horizon is H2O's, one interval: a whole
        sequence never gives blocks back, so reserving its full length would admit fewer
        sequences than stock vLLM; one interval keeps admission as optimistic as stock's is
        for a sequence that never compacts.
        """
        size = group.block_size  # a drafter's own: vLLM sizes each group's blocks to one page
        reserve = 0
        for other, blocks in group.req_to_blocks.items():
            if other != request.request_id and other in self._admitted:
                claim = self._admitted[other]
                reserve += _growth(len(blocks), cdiv(claim.length, size), cdiv(claim.horizon, size))
        claim = self._admitted[request.request_id]
        after = min(cdiv(claim.length, size), cdiv(request.num_tokens, size) + cdiv(claim.horizon, size))
        return reserve + max(0, after - cdiv(step_end, size))

    def _next_interval_claim(self, request_id: str, held: int) -> int:
        claim = self._admitted.get(request_id)
        if claim is None:
            return 0
        # Until its first compaction a sequence may still claim the rest of its prefill.
        limit = claim.peak if self.num_evicted.get(request_id, 0) else max(claim.peak, claim.prefill)
        return _growth(held, limit, cdiv(claim.horizon, self.block_size))
