"""The H2O step sequence both model runners share (V1: ``runner_v1``, V2: ``runner_v2``).

Runs in the worker process. Each runner's hooks supply only what differs between them: how a
batch is read (``BatchRows``) and how a block-table row is cut or rewritten; the order of a
step is written here once:

1. ``begin_step`` (the runner's request update, before vLLM's): last step's fresh-block rows
   are rewritten; the step's prefix-cache orders, void requests and speculative drafts go to
   the ``RunnerState``.
2. ``RunnerState.plan``: the batch's ``StepPlan``.
3. The plan reaches the metadata builders for the one build of this batch
   (``worker.building``: for the extent of that build, nothing kept on the builders); they turn
   it into the ``H2OStep`` every layer reads from its attention metadata.
4. ``finish_step``: compacted rows truncated, compactions counted.

The ``RunnerState`` is the runner's one piece of H2O state (attribute ``h2o_state``, made on
the runner's first real step by ``runner_state``).
"""
from __future__ import annotations

from collections.abc import Callable

from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.kv_transfer.connector import transfer_orders
from h2o_vllm.prefix_orders import ATTRIBUTE
from h2o_vllm.spec import h2o_specs, is_h2o_spec
from h2o_vllm.vllm_hooks.wrapping import _h2o_of
from h2o_vllm.vllm_shims.symbols import logger
from h2o_vllm.worker.plan import record_compactions
from h2o_vllm.worker.runner_state import RunnerState

#: The one attribute H2O adds to vLLM's model runner: its ``RunnerState``.
STATE_ATTRIBUTE = "h2o_state"


def runner_state(runner):
    """The runner's ``RunnerState``, made on first use; None with H2O off."""
    config = _h2o_of(runner)
    if config is None:
        return None
    state = runner.__dict__.get(STATE_ATTRIBUTE)
    if state is None:
        groups = _h2o_groups(runner)
        sizes = {g.kv_cache_spec.block_size for _, g in groups}
        if len(sizes) != 1:  # one block size: the default interval
            raise RuntimeError(f"h2o-vllm expects one H2O KV-cache block size, found {sorted(sizes)}")
        state = RunnerState(budgets=RequestBudgets(config, sizes.pop()),
                            groups=tuple((i, g.kv_cache_spec.block_size) for i, g in groups),
                            layer_groups={name: i for i, g in groups for name in g.layer_names})
        setattr(runner, STATE_ATTRIBUTE, state)
    return state


def _h2o_groups(runner) -> list:
    """(KV-cache group id, vLLM's KVCacheGroupSpec) of each H2O group of the runner."""
    return [(i, g) for i, g in enumerate(runner.kv_cache_config.kv_cache_groups)
            if is_h2o_spec(g.kv_cache_spec)]


def void_request_ids(scheduler_output) -> set[str]:
    """Requests whose KV cache is gone or rebuilt as of this step: finished (or aborted),
    preempted, resumed from preemption (``StepPlan.void_ids``)."""
    return (set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
            | set(scheduler_output.scheduled_cached_reqs.resumed_req_ids))


def transferred_prompt_lens(scheduler_output) -> dict[str, int]:
    """KV transfer: this step's requests whose H2O prompt is shorter than vLLM's
    (``TransferOrders.prompt_lens``; H2O's connector metadata)."""
    orders = transfer_orders(scheduler_output)
    return orders.prompt_lens if orders is not None else {}


def scheduled_drafts(scheduler_output) -> dict[str, int]:
    """Speculative decoding: each request's draft tokens in this step (``StepPlan.draft_lens``)."""
    return {r: len(t) for r, t in (scheduler_output.scheduled_spec_decode_tokens or {}).items() if t}


def begin_step(state, scheduler_output,
               rewrite_row: Callable[[str, int, list[int]], None]) -> None:
    """Step 1: give rows that compacted into fresh blocks last step those blocks
    (``rewrite_row(request, group id, blocks)``), then keep this step's scheduler inputs."""
    due = state.begin_step(getattr(scheduler_output, ATTRIBUTE, None), void_request_ids(scheduler_output),
                           scheduled_drafts(scheduler_output), transferred_prompt_lens(scheduler_output),
                           [(new.req_id, new.prompt_len, new.sampling_params)
                            for new in scheduler_output.scheduled_new_reqs])
    for (req_id, group_id), fresh in due.items():
        rewrite_row(req_id, group_id, fresh)


def finish_step(state, plan, truncate_row: Callable[[int, int, int, list[int] | None], None]) -> None:
    """Step 4: ``truncate_row(group id, row, blocks kept, fresh blocks or None)`` for each row
    this step compacts; count the step's compactions."""
    for group_id, row, keep, fresh in state.compacted_rows(plan):
        logger.debug("h2o: request %s compacted from %d to %d KV tokens", plan.req_ids[row],
                     int(plan.kv_seq_lens[row]), int(plan.kv_lens_after[row]))
        truncate_row(group_id, row, keep, fresh)
    record_compactions(plan)


def _get_kv_cache_spec_wrapper(original):
    """Full-attention specs become ``H2OAttentionSpec`` (both runners), except a speculative
    drafter's own layers."""
    def get_kv_cache_spec(self):
        return h2o_specs(original(self), _h2o_of(self), drafter_layer_names(self))
    return get_kv_cache_spec


def drafter_layer_names(runner) -> frozenset[str]:
    """The attention layers of the runner's speculative drafter (a draft model's, EAGLE's, MTP
    layers'; none for n-gram), known once vLLM has loaded the drafter, before it asks for the
    specs: V1's ``drafter._draft_attn_layer_names``, V2's ``speculator.draft_attn_layer_names``."""
    names = getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", None)
    if names is None:
        names = getattr(getattr(runner, "speculator", None), "draft_attn_layer_names", None)
    return frozenset(names or ())
