"""The per-step H2O plan of one batch: every row's KV-space lengths before and after the step.

Runs in the worker process. The runner hook builds it from the input batch (request
identity, prompt lengths, per-request budgets), the metadata builder and the impl read it.
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
    kv_lens_after: torch.Tensor    # live KV tokens once this step's compaction is done
    heavy: torch.Tensor
    recent: torch.Tensor

    @property
    def kv_seq_lens(self) -> torch.Tensor:
        """Keys each row attends over in this step (logical seq_lens, in KV space)."""
        return self.kv_lens_before + self.query_lens

    @property
    def due(self) -> torch.Tensor:
        """Rows whose cache is compacted at the end of this step."""
        return self.kv_lens_after < self.kv_seq_lens


def make_step_plan(num_computed: torch.Tensor, query_lens: torch.Tensor, prompt_lens: torch.Tensor,
                   heavy: torch.Tensor, recent: torch.Tensor, interval: torch.Tensor) -> StepPlan:
    """num_computed: logical tokens already in the cache per row (vLLM's num_computed_tokens)."""
    budget = heavy + recent
    before = live_kv_len(num_computed, prompt_lens, budget, interval)
    after = live_kv_len(num_computed + query_lens, prompt_lens, budget, interval)
    return StepPlan(query_lens=query_lens, kv_lens_before=before, kv_lens_after=after,
                    heavy=heavy, recent=recent)


_current: StepPlan | None = None


def set_current(plan: StepPlan | None) -> None:
    global _current
    _current = plan


def current() -> StepPlan | None:
    """The plan of the batch being built; None outside a real step (profiling, warm-up)."""
    return _current
