"""The per-step H2O plan of one batch: every row's KV-space lengths before and after the step.

Runs in the worker process. The runner hook builds it once per step from the input batch
(request identity, prompt lengths, per-request budgets); the metadata builders and every
attention layer's impl read it, so everything per-step is computed here, once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_vllm.policy import live_kv_len


@dataclass(frozen=True)
class StepPlan:
    # All [num_reqs] int64 on CPU, one entry per row of the batch.
    query_lens: torch.Tensor
    kv_lens_before: torch.Tensor   # live KV tokens before this step's K/V are written
    kv_seq_lens: torch.Tensor      # keys each row attends over in this step
    kv_lens_after: torch.Tensor    # live KV tokens once this step's compaction is done
    heavy: torch.Tensor
    recent: torch.Tensor
    due: torch.Tensor              # bool: rows compacted at the end of this step
    query_starts: torch.Tensor     # first token of each row in the batch
    decode_rows: torch.Tensor      # rows with one query (scored together)
    prefill_rows: list[int]        # rows with several queries (scored one by one)
    due_rows: list[int]


def make_step_plan(num_computed: torch.Tensor, query_lens: torch.Tensor, prompt_lens: torch.Tensor,
                   heavy: torch.Tensor, recent: torch.Tensor, interval: torch.Tensor) -> StepPlan:
    """num_computed: logical tokens already in the cache per row (vLLM's num_computed_tokens)."""
    budget = heavy + recent
    before = live_kv_len(num_computed, prompt_lens, budget, interval)
    after = live_kv_len(num_computed + query_lens, prompt_lens, budget, interval)
    seq_lens = before + query_lens
    due = after < seq_lens
    return StepPlan(query_lens=query_lens, kv_lens_before=before, kv_seq_lens=seq_lens,
                    kv_lens_after=after, heavy=heavy, recent=recent, due=due,
                    query_starts=torch.cumsum(query_lens, 0) - query_lens,
                    decode_rows=(query_lens == 1).nonzero().flatten(),
                    prefill_rows=(query_lens > 1).nonzero().flatten().tolist(),
                    due_rows=due.nonzero().flatten().tolist())


def kv_slot_mapping(plan: StepPlan, block_table: torch.Tensor, num_tokens: int,
                    block_size: int) -> torch.Tensor:
    """Cache slot of each scheduled token (int64 [num_tokens], on block_table's device): row
    r's j-th new token goes to KV position kv_lens_before[r] + j. Padding tokens get -1
    (vLLM's PAD_SLOT_ID)."""
    device = block_table.device
    rows = torch.repeat_interleave(torch.arange(plan.query_lens.shape[0]), plan.query_lens)
    kv_pos = plan.kv_lens_before[rows] + torch.arange(rows.shape[0]) - plan.query_starts[rows]
    rows, kv_pos = rows.to(device, non_blocking=True), kv_pos.to(device, non_blocking=True)
    blocks = block_table[rows, kv_pos // block_size].to(torch.int64)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    slots[: rows.shape[0]] = blocks * block_size + kv_pos % block_size
    return slots


_current: StepPlan | None = None


def set_current(plan: StepPlan | None) -> None:
    global _current
    _current = plan


def current() -> StepPlan | None:
    """The plan of the batch being built; None outside a real step (profiling, warm-up)."""
    return _current
