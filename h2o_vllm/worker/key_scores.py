"""The score of a due pass's live slots read from the cache (``StepPlan.key_scorers``:
docs/semantics.md, "KeyDiff", "Expected Attention"), for both devices.

Runs in the worker process, called by ``worker.step.update_scores_and_compact`` at a
compaction, after the layer's attention. Gathers what the scorer reads as the pass's ``live``
scores are gathered (its blocks and offsets, padded to the pass's width): the keys, and for a
scorer that reads queries, the values and each row's last queries of this step, then calls the
scorer with the pass's live mask, so that the padding changes no live slot's score.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from h2o_vllm.score_modes import QueryContext
from h2o_vllm.score_modes.rotary import Rotary
from h2o_vllm.worker.due_pass import DuePass

if TYPE_CHECKING:  # step imports this module
    from h2o_vllm.worker.step import DeviceOps, H2OStep


def key_scores(due: DuePass, ops: DeviceOps, views: Any, step: H2OStep, query: torch.Tensor,
               scale: float, rotary: Rotary | None) -> torch.Tensor:
    """[R, Hkv, width] fp32: the pass's key score of each live slot, from the keys (and
    values) the attention read. query: [>= num_tokens, num_q_heads, head_size], after RoPE."""
    scorer = due.key_scorer
    keys = ops.read_keys(views.keys[due.blocks, due.offsets[None, :]]).transpose(1, 2)  # [R, Hkv, width, d]
    if not scorer.query_window:
        return scorer.scores(keys, live=due.live[:, None, :])
    if rotary is None:
        raise RuntimeError(f"h2o.score {scorer.name!r} needs the model's RoPE, which this model's "
                           "config does not give (it should have been refused before the model loaded)")
    values = ops.read_values(views.values[due.blocks, due.offsets[None, :]]).transpose(1, 2)
    num_kv_heads = keys.shape[1]
    plan = step.plan
    out = []
    # One row at a time: rows of a pass differ in their number of queries.
    for i, row in enumerate(due.host_rows):
        end = int(plan.query_starts[row] + plan.query_lens[row])
        start = max(int(plan.query_starts[row]), end - scorer.query_window)
        q = query[start:end].to(torch.float32)                         # [n, Hq, d]
        q = q.reshape(end - start, num_kv_heads, -1, q.shape[-1]).permute(1, 2, 0, 3)  # [Hkv, g, n, d]
        context = QueryContext(values=values[i], queries=q, scale=scale, rotate=rotary.cos_sin)
        out.append(scorer.scores(keys[i], context, live=due.live[i][None, :]))
    return torch.stack(out)
