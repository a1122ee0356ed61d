"""Hooks on vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``; the CPU runner
inherits it): the shared step sequence (``runner``) at V1's seams.

Runs in the worker process. V1 keeps each request's state (sampling params, block ids) in
``runner.requests`` and its batch in ``runner.input_batch`` (rows, computed-token counts,
prompt lengths, a block table per KV-cache group).
"""
from __future__ import annotations

import copy

import torch

from h2o_vllm.vllm_hooks.runner import _get_kv_cache_spec_wrapper, begin_step, finish_step, runner_state
from h2o_vllm.vllm_hooks.wrapping import _wrap
from h2o_vllm.worker.building import building
from h2o_vllm.worker.runner_state import BatchRows


def install_runner_hook() -> None:
    """Give builders each row's H2O plan; truncate rows when compaction fires; H2O specs."""
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
          _build_attention_metadata_wrapper)
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec",
          _get_kv_cache_spec_wrapper)
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states", _update_states_wrapper)


def _update_states_wrapper(original):
    def _update_states(self, scheduler_output):
        state = runner_state(self)
        if state is not None:
            begin_step(state, scheduler_output, lambda *row: _rewrite_row(self, *row))
        return original(self, scheduler_output)
    return _update_states


def _build_attention_metadata_wrapper(original):
    def _build_attention_metadata(self, *args, **kwargs):
        scheduled = kwargs.get("num_scheduled_tokens")
        # Dummy and profiling runs pass no scheduled tokens: no request, no plan.
        state = runner_state(self) if scheduled is not None else None
        if state is None:
            return original(self, *args, **kwargs)
        plan = state.plan(_batch_rows(self, kwargs["num_reqs"] if "num_reqs" in kwargs else args[1],
                                      scheduled))
        with building(plan, state.layer_groups):
            attn_metadata, drafter_cm = original(self, *args, **kwargs)
        finish_step(state, plan, lambda *row: _truncate_row(self, *row))
        return attn_metadata, _drafters_own_group(self, drafter_cm, kwargs.get("slot_mappings"))
    return _build_attention_metadata


def _drafters_own_group(runner, cm, slot_mappings):
    """The metadata a draft model proposes with, on its own KV-cache group's block table and
    slot mapping. vLLM 0.32 hands it group 0's (it expects a draft model's layers to share the
    target's group; only the proposers it lists get their own): with H2O the drafter's layers
    are a group of their own, and group 0's are H2O's, compacted."""
    group = getattr(getattr(runner, "drafter", None), "kv_cache_gid", -1)
    if cm is None or group <= 0 or not slot_mappings:
        return cm
    own = copy.copy(cm)
    own.block_table_tensor = runner.input_batch.block_table[group].get_device_tensor(cm.num_reqs)
    own.slot_mapping = slot_mappings[group][:cm.num_actual_tokens]
    return own


def _batch_rows(runner, num_reqs: int, scheduled: dict[str, int]):
    batch, requests = runner.input_batch, runner.requests
    req_ids = batch.req_ids[:num_reqs]

    num_computed = torch.from_numpy(batch.num_computed_tokens_cpu[:num_reqs]).to(torch.int64)
    if runner.use_async_spec_decode and batch.prev_req_id_to_index:
        num_computed -= torch.tensor(unverified_drafts(
            req_ids, batch.prev_req_id_to_index, runner.prev_num_draft_tokens.np,
            runner._get_valid_sampled_token_count()), dtype=torch.int64)
    return BatchRows(
        req_ids=req_ids,
        num_computed=num_computed,
        prompt_lens=torch.from_numpy(batch.num_prompt_tokens[:num_reqs]).to(torch.int64),
        query_lens=torch.tensor([scheduled[r] for r in req_ids], dtype=torch.int64),
        live_request_ids=requests.keys())


def unverified_drafts(req_ids, prev_rows: dict[str, int], drafted, sampled: list[int]) -> list[int]:
    """Async scheduling with drafts: how far each row's computed-token count is ahead of its
    cache. vLLM counts the previous step's drafts as accepted and corrects the count on the
    device before the forward, on the host only after it; H2O's plan needs the true count
    now. ``drafted``: the previous step's drafts by its row (``prev_num_draft_tokens``);
    ``sampled``: tokens it kept by that row, drafts accepted plus one (vLLM copies them to the
    host right after sampling: waiting for them leaves the drafter's passes overlapping)."""
    ahead = [0] * len(req_ids)
    if not sampled:
        return ahead
    for row, req_id in enumerate(req_ids):
        prev = prev_rows.get(req_id)
        if prev is not None and drafted[prev]:
            ahead[row] = int(drafted[prev]) - (sampled[prev] - 1)
    return ahead


def _truncate_row(runner, group_id: int, row: int, keep: int, fresh: list[int] | None) -> None:
    """Drop the block-table entries past a compacted row's new KV length. The tensor entries
    stay until overwritten, so this step's kernels still read them."""
    batch = runner.input_batch
    table, state = batch.block_table[group_id], runner.requests[batch.req_ids[row]]
    if table.num_blocks_per_row[row] > keep:
        table.num_blocks_per_row[row] = keep
        del state.block_ids[group_id][keep:]
    if fresh is not None:
        state.block_ids[group_id][:] = fresh


def _rewrite_row(runner, req_id: str, group_id: int, fresh: list[int]) -> None:
    """A block-table row that compacted into fresh blocks last step becomes those blocks, as
    ``H2OManager.remove_skipped_blocks`` made them on the scheduler (the request state already
    holds them)."""
    batch = runner.input_batch
    row = batch.req_id_to_index.get(req_id)
    if row is not None:
        batch.block_table[group_id].add_row(list(fresh), row)
