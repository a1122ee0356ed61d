"""Hooks on the model runner: the per-step H2O plan, H2O KV-cache specs, row truncation.

Runs in the worker process.
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


def _get_kv_cache_spec_wrapper(original):
    def get_kv_cache_spec(self):
        specs = original(self)
        config = _h2o_of(self)
        if config is None:
            return specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from h2o_vllm.scheduler.spec import H2OAttentionSpec
        return {name: H2OAttentionSpec.from_full(spec, config) if type(spec) is FullAttentionSpec else spec
                for name, spec in specs.items()}
    return get_kv_cache_spec


def _build_attention_metadata_wrapper(original):
    def _build_attention_metadata(self, *args, **kwargs):
        config = _h2o_of(self)
        scheduled = kwargs.get("num_scheduled_tokens")
        # Dummy and profiling runs pass no scheduled tokens: no request, no plan.
        if config is None or scheduled is None:
            return original(self, *args, **kwargs)
        from h2o_vllm.worker import plan as step_plan
        num_reqs = kwargs["num_reqs"] if "num_reqs" in kwargs else args[1]
        plan = _step_plan(self, config, num_reqs, scheduled)
        step_plan.set_current(plan)
        try:
            result = original(self, *args, **kwargs)
        finally:
            step_plan.set_current(None)
        _truncate_compacted_rows(self, plan)
        _record_compactions(plan)
        return result
    return _build_attention_metadata


def _h2o_block_size(runner) -> int:
    from h2o_vllm.scheduler.spec import H2OAttentionSpec
    sizes = {g.kv_cache_spec.block_size for g in runner.kv_cache_config.kv_cache_groups
             if isinstance(g.kv_cache_spec, H2OAttentionSpec)}
    if len(sizes) != 1:
        raise RuntimeError(f"h2o-vllm expects one H2O KV-cache block size, found {sorted(sizes)}")
    return sizes.pop()


def _row_budget(runner, config, req_id: str, block_size: int) -> tuple[int, int, int]:
    """(heavy, recent, interval) of one request, cached for its lifetime in the batch."""
    cache: dict = runner.__dict__.setdefault("_h2o_row_budgets", {})
    budget = cache.get(req_id)
    if budget is None:
        from h2o_vllm.config import request_config
        state = runner.requests[req_id]
        params = state.sampling_params
        h2o = request_config(config, params.extra_args if params is not None else None)
        heavy, recent = h2o.budget(state.num_prompt_tokens)
        budget = cache[req_id] = (heavy, recent, h2o.resolved_interval(block_size))
        if len(cache) > 4 * max(len(runner.requests), 64):
            for gone in set(cache) - set(runner.requests):
                del cache[gone]
    return budget


def _step_plan(runner, config, num_reqs: int, scheduled: dict[str, int]):
    from h2o_vllm.worker.plan import make_step_plan
    batch = runner.input_batch
    block_size = _h2o_block_size(runner)
    req_ids = batch.req_ids[:num_reqs]
    budgets = torch.tensor([_row_budget(runner, config, r, block_size) for r in req_ids],
                           dtype=torch.int64).view(-1, 3)
    return make_step_plan(
        num_computed=torch.from_numpy(batch.num_computed_tokens_cpu[:num_reqs]).to(torch.int64),
        query_lens=torch.tensor([scheduled[r] for r in req_ids], dtype=torch.int64),
        prompt_lens=torch.from_numpy(batch.num_prompt_tokens[:num_reqs]).to(torch.int64),
        heavy=budgets[:, 0], recent=budgets[:, 1], interval=budgets[:, 2])


def _truncate_compacted_rows(runner, plan) -> None:
    """Drop the block-table entries past each compacted row's new KV length, as the
    scheduler's ``H2OManager.remove_skipped_blocks`` will at the next schedule. The tensor
    entries stay until overwritten, so this step's kernels still read them."""
    from vllm.utils.math_utils import cdiv

    from h2o_vllm.scheduler.spec import H2OAttentionSpec
    due = plan.due.nonzero().flatten().tolist()
    if not due:
        return
    batch = runner.input_batch
    for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, H2OAttentionSpec):
            continue
        table = batch.block_table[group_id]
        for row in due:
            keep = cdiv(int(plan.kv_lens_after[row]), group.kv_cache_spec.block_size)
            if table.num_blocks_per_row[row] > keep:
                table.num_blocks_per_row[row] = keep
                del runner.requests[batch.req_ids[row]].block_ids[group_id][keep:]
    for row in due:
        logger.debug("h2o: request %s compacted from %d to %d KV tokens", batch.req_ids[row],
                     int(plan.kv_seq_lens[row]), int(plan.kv_lens_after[row]))


def _counts_once() -> bool:
    """Whether this worker counts per-request events (the first TP and PP rank)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        return get_tp_group().rank_in_group == 0 and get_pp_group().is_first_rank
    except (AssertionError, RuntimeError):  # no distributed state (unit tests)
        return True


def _record_compactions(plan) -> None:
    """Tokens evicted and compactions of this step, from the plan the impl executes."""
    due = plan.due
    if not bool(due.any()) or not _counts_once():
        return
    from h2o_vllm import metrics
    evicted = int((plan.kv_seq_lens[due] - plan.kv_lens_after[due]).sum())
    metrics.recorder().add(evicted_tokens=evicted, compactions=int(due.sum()))

