"""Hooks on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``): the shared step sequence
(``runner``) at V2's seams.

Runs in the worker process. V2 keeps its per-request state in ``RequestState`` (prompt
lengths, computed-token counts, by slot) and its block tables in ``BlockTables`` (rows by
slot, a block count per KV-cache group and slot); a batch row maps to its slot through
``InputBatch.idx_mapping_np``. The metadata builders are the same as on V1.

- ``update_requests``: ``begin_step`` (new requests' budgets resolved, as on V1); rewritten rows are staged, so they land with the step's
  other block-table writes, before vLLM appends the step's new blocks after them.
- ``prepare_attn`` (the runner's: block tables and slot mappings gathered for the step): the
  step's plan is made from the ``InputBatch`` and held for that batch (``worker.building.hold``);
  ``finish_step`` cuts the compacted rows' block counts (the gathered tables this step reads
  are copies, so the step still reads every block).
- ``DefaultModelState.prepare_attn`` (builds the step's attention metadata): the builders build
  with the plan held for this very batch (``worker.building.building_held``), as V1's do in
  ``_build_attention_metadata``.
"""
from __future__ import annotations

import torch

from h2o_vllm.vllm_hooks.runner import _get_kv_cache_spec_wrapper, begin_step, finish_step, runner_state
from h2o_vllm.vllm_hooks.wrapping import _wrap
from h2o_vllm.worker.building import building_held, hold
from h2o_vllm.worker.runner_state import BatchRows


def install_runner_v2_hook() -> None:
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.get_kv_cache_spec", _get_kv_cache_spec_wrapper)
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.update_requests", _update_requests_wrapper)
    _wrap("vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_attn", _prepare_attn_wrapper)
    _wrap("vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn",
          _model_state_prepare_attn_wrapper)


def _update_requests_wrapper(original):
    def update_requests(self, scheduler_output):
        state = runner_state(self)
        if state is not None:
            begin_step(state, scheduler_output, lambda *row: _rewrite_row(self, *row))
        return original(self, scheduler_output)
    return update_requests


def _prepare_attn_wrapper(original):
    def prepare_attn(self, input_batch):
        result = original(self, input_batch)
        state = runner_state(self)
        if state is not None:
            plan = state.plan(_batch_rows(self, input_batch))
            hold(input_batch, plan, state.layer_groups)
            finish_step(state, plan, lambda *row: _truncate_row(self, input_batch, *row))
        return result
    return prepare_attn


def _model_state_prepare_attn_wrapper(original):
    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
                     *args, **kwargs):
        with building_held(input_batch):  # no plan on dummy, profiling and capture runs
            return original(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                            attn_groups, *args, **kwargs)
    return prepare_attn


def _batch_rows(runner, input_batch):
    n = input_batch.num_reqs
    slots = input_batch.idx_mapping_np[:n]
    states = runner.req_states
    return BatchRows(
        req_ids=input_batch.req_ids[:n],
        num_computed=_num_computed(runner, input_batch),
        prompt_lens=torch.from_numpy(states.prompt_len.np[slots]).to(torch.int64),
        query_lens=torch.from_numpy(input_batch.num_scheduled_tokens[:n]).to(torch.int64),
        live_request_ids=states.req_id_to_index.keys())


def _num_computed(runner, input_batch) -> torch.Tensor:
    """Each row's computed tokens before this step. Under async scheduling with drafts, V2's
    host counts take the previous step's drafts as accepted (an optimistic mirror) and only
    the device holds the verified count: H2O's plan reads it there, waiting for the previous
    step's work."""
    n = input_batch.num_reqs
    if runner.speculator is not None and runner.vllm_config.scheduler_config.async_scheduling:
        return runner.req_states.num_computed_tokens.gpu[input_batch.idx_mapping[:n]].to("cpu", torch.int64)
    return torch.from_numpy(input_batch.num_computed_tokens_np[:n]).to(torch.int64)


def _truncate_row(runner, input_batch, group_id: int, row: int, keep: int, fresh) -> None:
    """A compacted row's block count drops to its new KV length's; a row that compacted into
    fresh blocks becomes them at the next step (``_rewrite_row``)."""
    num_blocks = runner.block_tables.num_blocks.np
    slot = int(input_batch.idx_mapping_np[row])
    num_blocks[group_id, slot] = min(int(num_blocks[group_id, slot]), keep)


def _rewrite_row(runner, req_id: str, group_id: int, fresh: list[int]) -> None:
    """Staged: lands with the step's other block-table writes, before vLLM appends the step's
    new blocks after it (as ``H2OManager.cut_scheduled`` made the row on the scheduler)."""
    slot = runner.req_states.req_id_to_index.get(req_id)
    if slot is not None:
        tables = runner.block_tables
        tables.block_tables[group_id].stage_write(slot, 0, list(fresh))
        tables.num_blocks.np[group_id, slot] = len(fresh)
