"""The score of a due group's live slots read from the cache (``StepPlan.key_scorers``:
docs/semantics.md, "KeyDiff", "Expected Attention"), for both devices.

Runs in the worker process, called by ``worker.step.update_scores_and_compact`` at a
compaction, after the layer's attention. Gathers what the scorer reads as the step's ``live``
scores are gathered (the group's blocks and offsets): the keys, and for a scorer that reads
queries, the values and each row's last queries of this step, then calls the scorer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from h2o_vllm.score_modes import QueryContext
from h2o_vllm.score_modes.rotary import Rotary

if TYPE_CHECKING:  # step imports this module
    from h2o_vllm.worker.step import DeviceOps, DueGroup, H2OStep


def key_scores(group: DueGroup, ops: DeviceOps, views: Any, step: H2OStep, query: torch.Tensor,
               scale: float, rotary: Rotary | None) -> torch.Tensor:
    """[R, Hkv, kv_len] fp32: the group's key score of each live slot, from the keys (and
    values) the attention read. query: [>= num_tokens, num_q_heads, head_size], after RoPE."""
    scorer = group.key_scorer
    keys = ops.read_keys(views.keys[group.blocks, group.offsets[None, :]]).transpose(1, 2)  # [R, Hkv, kv_len, d]
    if not scorer.query_window:
        return scorer.scores(keys)
    if rotary is None:
        raise RuntimeError(f"h2o.score {scorer.name!r} needs the model's RoPE, which this model's "
                           "config does not give (it should have been refused before the model loaded)")
    values = ops.read_values(views.values[group.blocks, group.offsets[None, :]]).transpose(1, 2)
    num_kv_heads = keys.shape[1]
    plan = step.plan
    out = []
    # One row at a time: rows of a group share their kv_len, not their number of queries.
    for i, row in enumerate(group.rows.tolist()):
        end = int(plan.query_starts[row] + plan.query_lens[row])
        start = max(int(plan.query_starts[row]), end - scorer.query_window)
        q = query[start:end].to(torch.float32)                         # [n, Hq, d]
        q = q.reshape(end - start, num_kv_heads, -1, q.shape[-1]).permute(1, 2, 0, 3)  # [Hkv, g, n, d]
        context = QueryContext(values=values[i], queries=q, scale=scale, rotate=rotary.cos_sin)
        out.append(scorer.scores(keys[i], context))
    return torch.stack(out)
