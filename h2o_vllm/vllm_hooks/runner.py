"""Hooks on the model runner: the per-step H2O plan, H2O KV-cache specs, row truncation.

Runs in the worker process. The wrappers only read the runner's batch and apply what the named
functions of ``h2o_vllm.worker.plan`` and ``h2o_vllm.scheduler.spec`` decide.
"""
from __future__ import annotations

import torch

from h2o_vllm.vllm_hooks.seam import _h2o_of, _wrap, logger


def install_runner_hook() -> None:
    """Give builders each row's H2O plan; truncate rows when compaction fires; H2O specs."""
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
          _build_attention_metadata_wrapper)
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec",
          _get_kv_cache_spec_wrapper)
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states", _update_states_wrapper)


def _update_states_wrapper(original):
    """Keep the step's prefix-cache orders and void requests for the plan; first give the
    rows that compacted into fresh blocks last step those blocks (not earlier: on the CPU the
    runner's block table is the kernels' tensor, which that step was still reading)."""
    def _update_states(self, scheduler_output):
        if _h2o_of(self) is not None:
            from h2o_vllm.prefix import ATTRIBUTE
            _rewrite_rows(self)
            self._h2o_orders = getattr(scheduler_output, ATTRIBUTE, None)
            self._h2o_void = void_request_ids(scheduler_output)
        return original(self, scheduler_output)
    return _update_states


def void_request_ids(scheduler_output) -> set[str]:
    """Requests whose KV cache is gone or rebuilt as of this step: finished (or aborted),
    preempted, resumed from preemption (``StepPlan.void_ids``)."""
    return (set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
            | set(scheduler_output.scheduled_cached_reqs.resumed_req_ids))


def _get_kv_cache_spec_wrapper(original):
    def get_kv_cache_spec(self):
        from h2o_vllm.scheduler.spec import h2o_specs
        return h2o_specs(original(self), _h2o_of(self))
    return get_kv_cache_spec


def _build_attention_metadata_wrapper(original):
    def _build_attention_metadata(self, *args, **kwargs):
        scheduled = kwargs.get("num_scheduled_tokens")
        # Dummy and profiling runs pass no scheduled tokens: no request, no plan.
        if _h2o_of(self) is None or scheduled is None:
            return original(self, *args, **kwargs)
        from h2o_vllm.worker import plan as step_plan
        plan = _plan_batch(self, kwargs["num_reqs"] if "num_reqs" in kwargs else args[1], scheduled)
        with step_plan.current_plan(plan):
            result = original(self, *args, **kwargs)
        _truncate_rows(self, plan)
        step_plan.record_compactions(plan)
        return result
    return _build_attention_metadata


def _h2o_groups(runner) -> list[tuple[int, int]]:
    """(KV-cache group id, block size) of each H2O group of the runner."""
    from h2o_vllm.scheduler.spec import H2OAttentionSpec
    return [(i, g.kv_cache_spec.block_size) for i, g in enumerate(runner.kv_cache_config.kv_cache_groups)
            if isinstance(g.kv_cache_spec, H2OAttentionSpec)]


def _budgets(runner):
    """The runner's ``RequestBudgets`` (one KV block size: the default interval)."""
    budgets = runner.__dict__.get("_h2o_budgets")
    if budgets is None:
        from h2o_vllm.budgets import RequestBudgets
        sizes = {size for _, size in _h2o_groups(runner)}
        if len(sizes) != 1:
            raise RuntimeError(f"h2o-vllm expects one H2O KV-cache block size, found {sorted(sizes)}")
        budgets = runner._h2o_budgets = RequestBudgets(_h2o_of(runner), sizes.pop())
    return budgets


def _plan_batch(runner, num_reqs: int, scheduled: dict[str, int]):
    from h2o_vllm.worker.plan import plan_batch
    batch, requests = runner.input_batch, runner.requests
    req_ids = batch.req_ids[:num_reqs]

    def extra_args_of(req_id: str):
        params = requests[req_id].sampling_params
        return params.extra_args if params is not None else None
    return plan_batch(
        _budgets(runner), req_ids,
        num_computed=torch.from_numpy(batch.num_computed_tokens_cpu[:num_reqs]).to(torch.int64),
        prompt_lens=torch.from_numpy(batch.num_prompt_tokens[:num_reqs]).to(torch.int64),
        query_lens=torch.tensor([scheduled[r] for r in req_ids], dtype=torch.int64),
        extra_args_of=extra_args_of, live_request_ids=requests.keys(),
        orders=runner.__dict__.get("_h2o_orders"), void_ids=runner.__dict__.get("_h2o_void", ()))


def compacted_rows(runner, plan, req_ids):
    """(KV-cache group id, row, blocks kept, fresh blocks or None) of each row this step
    compacts, for either runner's truncation (``req_ids``: the batch's, by row). A row that
    compacts into fresh blocks is remembered for the next step's rewrite (``_h2o_rewrites``)."""
    from h2o_vllm.worker.plan import rows_to_truncate
    for group_id, block_size in _h2o_groups(runner):
        for row, keep, fresh in rows_to_truncate(plan, block_size):
            if fresh is not None:
                runner.__dict__.setdefault("_h2o_rewrites", {})[req_ids[row]] = (group_id, fresh)
            logger.debug("h2o: request %s compacted from %d to %d KV tokens", req_ids[row],
                         int(plan.kv_seq_lens[row]), int(plan.kv_lens_after[row]))
            yield group_id, row, keep, fresh


def _truncate_rows(runner, plan) -> None:
    """Drop the block-table entries past each compacted row's new KV length. The tensor
    entries stay until overwritten, so this step's kernels still read them."""
    batch = runner.input_batch
    for group_id, row, keep, fresh in compacted_rows(runner, plan, batch.req_ids):
        table, state = batch.block_table[group_id], runner.requests[batch.req_ids[row]]
        if table.num_blocks_per_row[row] > keep:
            table.num_blocks_per_row[row] = keep
            del state.block_ids[group_id][keep:]
        if fresh is not None:
            state.block_ids[group_id][:] = fresh


def _rewrite_rows(runner) -> None:
    """Block-table rows that compacted into fresh blocks in the last step become those blocks,
    as ``H2OManager.remove_skipped_blocks`` made them on the scheduler (the request states
    already hold them)."""
    rewrites = runner.__dict__.pop("_h2o_rewrites", None)
    if not rewrites:
        return
    batch = runner.input_batch
    for req_id, (group_id, fresh) in rewrites.items():
        row = batch.req_id_to_index.get(req_id)
        if row is not None:
            batch.block_table[group_id].add_row(list(fresh), row)
