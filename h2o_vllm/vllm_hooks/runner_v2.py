"""Hooks on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``): the same three jobs as the V1
hooks in ``runner.py`` (each step's plan to the builders, compacted rows truncated, H2O
KV-cache specs), at V2's seams.

Runs in the worker process. V2 keeps its per-request state in ``RequestState`` (prompt
lengths, computed-token counts, by slot) and its block tables in ``BlockTables`` (rows by
slot, a block count per KV-cache group and slot); a batch row maps to its slot through
``InputBatch.idx_mapping_np``. The metadata builders are the same as on V1
(``CommonAttentionMetadata``), so everything after the plan is shared.

- ``add_requests``: each new request's budget is resolved from its sampling params (V2 keeps
  no per-request params the plan could read later).
- ``update_requests``: the step's prefix-cache orders are kept for the plan; rows that
  compacted into fresh blocks last step become those blocks before vLLM appends the next ones.
- ``prepare_attn`` (the runner's: block tables and slot mappings gathered for the step): the
  step's plan is made from the ``InputBatch`` and armed for the builders; the compacted rows'
  block counts drop to what the compaction leaves (the gathered tables this step reads are
  copies, so the step still reads every block).
- ``DefaultModelState.prepare_attn`` (builds the step's attention metadata): runs with the
  armed plan current, as V1's ``_build_attention_metadata`` does.
"""
from __future__ import annotations

import torch

from h2o_vllm.vllm_hooks.runner import (_budgets, _get_kv_cache_spec_wrapper, compacted_rows,
                                       void_request_ids)
from h2o_vllm.vllm_hooks.seam import _h2o_of, _wrap


def install_runner_v2_hook() -> None:
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.get_kv_cache_spec", _get_kv_cache_spec_wrapper)
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests", _add_requests_wrapper)
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.update_requests", _update_requests_wrapper)
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_attn", _prepare_attn_wrapper)
    _wrap("vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn",
          _model_state_prepare_attn_wrapper)


def _add_requests_wrapper(original):
    def add_requests(self, scheduler_output):
        if _h2o_of(self) is not None:
            budgets = _budgets(self)
            for new in scheduler_output.scheduled_new_reqs:
                params = new.sampling_params
                budgets.resolve(new.req_id, new.prompt_len, params.extra_args if params else None)
        return original(self, scheduler_output)
    return add_requests


def _update_requests_wrapper(original):
    def update_requests(self, scheduler_output):
        if _h2o_of(self) is not None:
            from h2o_vllm.prefix import ATTRIBUTE
            _rewrite_rows(self)
            self._h2o_orders = getattr(scheduler_output, ATTRIBUTE, None)
            self._h2o_void = void_request_ids(scheduler_output)
        return original(self, scheduler_output)
    return update_requests


def _prepare_attn_wrapper(original):
    def prepare_attn(self, input_batch):
        result = original(self, input_batch)
        if _h2o_of(self) is not None:
            from h2o_vllm.worker import plan as step_plan
            plan = _plan_batch(self, input_batch)
            step_plan.arm(input_batch, plan)
            _truncate_rows(self, plan, input_batch)
            step_plan.record_compactions(plan)
        return result
    return prepare_attn


def _model_state_prepare_attn_wrapper(original):
    def prepare_attn(self, input_batch, *args, **kwargs):
        from h2o_vllm.worker import plan as step_plan
        plan = step_plan.take_armed(input_batch)  # None on dummy, profiling and capture runs
        if plan is None:
            return original(self, input_batch, *args, **kwargs)
        with step_plan.current_plan(plan):
            return original(self, input_batch, *args, **kwargs)
    return prepare_attn


def _plan_batch(runner, input_batch):
    from h2o_vllm.worker.plan import plan_batch
    n = input_batch.num_reqs
    slots = input_batch.idx_mapping_np[:n]
    states = runner.req_states
    return plan_batch(
        _budgets(runner), input_batch.req_ids[:n],
        num_computed=torch.from_numpy(input_batch.num_computed_tokens_np[:n]).to(torch.int64),
        prompt_lens=torch.from_numpy(states.prompt_len.np[slots]).to(torch.int64),
        query_lens=torch.from_numpy(input_batch.num_scheduled_tokens[:n]).to(torch.int64),
        extra_args_of=lambda req_id: None,  # resolved in add_requests
        live_request_ids=states.req_id_to_index.keys(),
        orders=runner.__dict__.get("_h2o_orders"), void_ids=runner.__dict__.get("_h2o_void", ()))


def _truncate_rows(runner, plan, input_batch) -> None:
    """Drop the block-table entries past each compacted row's new KV length (its block count);
    a row that compacted into fresh blocks becomes them at the next step (``_rewrite_rows``)."""
    num_blocks = runner.block_tables.num_blocks.np
    for group_id, row, keep, _ in compacted_rows(runner, plan, input_batch.req_ids):
        slot = int(input_batch.idx_mapping_np[row])
        num_blocks[group_id, slot] = min(int(num_blocks[group_id, slot]), keep)


def _rewrite_rows(runner) -> None:
    """Rows that compacted into fresh blocks last step become those blocks, as
    ``H2OManager.cut_scheduled`` made them on the scheduler; staged, so they land with the
    step's other block-table writes, before vLLM appends the step's new blocks after them."""
    rewrites = runner.__dict__.pop("_h2o_rewrites", None)
    if not rewrites:
        return
    tables = runner.block_tables
    for req_id, (group_id, fresh) in rewrites.items():
        slot = runner.req_states.req_id_to_index.get(req_id)
        if slot is not None:
            tables.block_tables[group_id].stage_write(slot, 0, list(fresh))
            tables.num_blocks.np[group_id, slot] = len(fresh)
