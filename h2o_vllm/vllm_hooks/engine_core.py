"""Hooks on the scheduler: per-request budgets for H2OManager, tail blocks freed when the step
that compacts is scheduled, H2O metrics.

Runs in the engine-core process (and the stats-log hook in process 0).
"""
from __future__ import annotations

import logging
import os

from vllm.v1.request import RequestStatus

from h2o_vllm import metrics
from h2o_vllm.kv_transfer.connector import H2OConnector
from h2o_vllm.prefix_orders import ATTRIBUTE
from h2o_vllm.scheduler import prefix_hits, scheduling
from h2o_vllm.scheduler.manager import h2o_managers, whole_managers
from h2o_vllm.vllm_hooks.wrapping import _h2o_of, _wrap


def install_scheduler_hook() -> None:
    """Engine core: per-request budgets where ``H2OManager`` can read them, tails freed at the
    step boundary, admissions that leave room for running sequences, metrics."""
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.add_request", _add_request_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler._free_blocks", _free_blocks_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.schedule", _schedule_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead",
          _reserve_prefill_lookahead_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler._update_after_schedule", _update_after_schedule_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", _update_from_output_wrapper)
    _wrap("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", _allocate_slots_wrapper)
    _wrap("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
          _get_computed_blocks_wrapper)
    _wrap("vllm.v1.engine.core:EngineCore.preprocess_add_request", _preprocess_add_request_wrapper)


def _add_request_wrapper(original):
    def add_request(self, request):
        if _h2o_of(self) is not None:
            scheduling.add_request(h2o_managers(self.kv_cache_manager), request,
                               _transfer_prompt_len(self.connector, request))
        return original(self, request)
    return add_request


def _transfer_prompt_len(connector, request) -> int | None:
    """H2O's prompt length of a KV-transfer consumer's request (None: vLLM's)."""
    transfer = _transfer_of(connector)
    return transfer.prompt_len(request) if transfer is not None else None


def _transfer_of(connector):
    """The ``TransferScheduler`` behind H2O's connector, or None."""
    return connector.transfer if isinstance(connector, H2OConnector) else None


def _preprocess_add_request_wrapper(original):
    """vLLM's P/D protocol (the original prompt with the producer's ``kv_transfer_params``)
    turned into H2O's before vLLM builds the request (``TransferScheduler.continue_from_params``)."""
    def preprocess_add_request(self, request):
        transfer = _transfer_of(getattr(self.scheduler, "connector", None))
        if transfer is not None:
            request = transfer.continue_from_params(request)
        return original(self, request)
    return preprocess_add_request


def _free_blocks_wrapper(original):
    def _free_blocks(self, request):
        if _h2o_of(self) is not None:
            scheduling.finish_request(h2o_managers(self.kv_cache_manager), request.request_id)
        return original(self, request)
    return _free_blocks


def _reserve_prefill_lookahead_wrapper(original):
    """vLLM's last word on a request's tokens this step, for running and waiting requests
    alike (after the token budget, ``long_prefill_token_threshold`` and max_model_len): H2O
    then stops a prefill step at its request's next prefill-chunk end, and a speculative
    step's drafts before its next compaction."""
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = original(self, request, num_computed_tokens, num_new_tokens)
        if _h2o_of(self) is None or num_new_tokens == 0:
            return num_new_tokens
        return scheduling.limit_step(h2o_managers(self.kv_cache_manager), request,
                                       num_computed_tokens, num_new_tokens)
    return _reserve_prefill_lookahead


def _update_after_schedule_wrapper(original):
    """The step's output is built, its tokens not yet counted as computed (the async
    scheduler's override calls this first): H2O takes vLLM's padding off rows it would cut."""
    def _update_after_schedule(self, scheduler_output):
        if _h2o_of(self) is not None:
            scheduling.drop_padding(h2o_managers(self.kv_cache_manager), scheduler_output, self.requests)
        return original(self, scheduler_output)
    return _update_after_schedule


def _update_from_output_wrapper(original):
    def update_from_output(self, *args, **kwargs):
        if _h2o_of(self) is not None:  # before vLLM frees the requests that finished
            prefix_hits.commit_records(h2o_managers(self.kv_cache_manager))
        outputs = original(self, *args, **kwargs)
        if _h2o_of(self) is not None:
            scheduling.record_metrics(h2o_managers(self.kv_cache_manager), self.running)
            transfer = _transfer_of(self.connector)
            if transfer is not None:
                transfer.emit_first_tokens(outputs)
        return outputs
    return update_from_output


def _allocate_slots_wrapper(original):

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        managers = h2o_managers(self)
        if not managers:
            return original(self, request, num_new_tokens, *args, **kwargs)
        if prefix_hits.awaits_record(managers, request) and request.status == RequestStatus.WAITING:
            return None  # vLLM keeps it waiting: next step its longer hit is exact
        base = self.watermark_blocks
        step_end = (request.num_computed_tokens + num_new_tokens + kwargs.get("num_new_computed_tokens", 0)
                    + kwargs.get("num_external_computed_tokens", 0))
        self.watermark_blocks = scheduling.admission_watermark(managers, whole_managers(self), base, request,
                                                         num_new_tokens, step_end, self.max_model_len,
                                                         kwargs.get("num_lookahead_tokens", 0))
        try:
            return original(self, request, num_new_tokens, *args, **kwargs)
        finally:
            self.watermark_blocks = base
    return allocate_slots


def _schedule_wrapper(original):
    """The step's prefix-cache orders ride on its output (read before the cut: it hands the
    fresh blocks of a first compaction to the row); its compactions cut the block lists;
    metrics once its blocks are allocated."""
    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        if _h2o_of(self) is not None:
            managers = h2o_managers(self.kv_cache_manager)
            setattr(output, ATTRIBUTE, prefix_hits.step_orders(managers, output, self.requests))
            scheduling.cut_scheduled(managers, output, self.requests)
            scheduling.record_metrics(managers, self.running)
        return output
    return schedule


def _get_computed_blocks_wrapper(original):
    """A prefix-cache hit, cut back to what H2O can resume from exactly."""
    def get_computed_blocks(self, request):
        blocks, num_tokens, boundary = original(self, request)
        managers = h2o_managers(self)
        if not managers or not self.enable_caching:
            return blocks, num_tokens, boundary
        if len(managers) < len(self.coordinator.single_type_managers):
            return _hybrid_hit(self, managers, request, blocks, num_tokens, boundary)
        cut = _h2o_cut(self.coordinator, managers, request, blocks.blocks, num_tokens)
        if cut == num_tokens:
            return blocks, num_tokens, boundary
        return (self.create_kv_cache_blocks(tuple(g[:cut // m.block_size] for g, m in
                                                  zip(blocks.blocks, self.coordinator.single_type_managers))),
                cut, 0)
    return get_computed_blocks


def _h2o_cut(coordinator, managers, request, hit, num_tokens: int) -> int:
    """The longest part of a hit of ``num_tokens`` (``hit``: each group's blocks) that every
    H2O group can resume from exactly."""
    group_blocks = dict(zip(coordinator.single_type_managers, hit))
    return min(prefix_hits.cut_hit(m, request, num_tokens, group_blocks.get(m, ())) for m in managers)


def _hybrid_hit(kv_cache_manager, managers, request, blocks, num_tokens: int, boundary: int):
    """A hybrid model's hit, cut until H2O can resume from it exactly. A sliding-window group's
    hit holds real blocks only for the window before its end, so a shorter hit is not a slice:
    it is vLLM's own search again, capped at the cut (the hit only shrinks)."""
    coordinator = kv_cache_manager.coordinator
    hit = blocks.blocks
    while num_tokens:
        cut = _h2o_cut(coordinator, managers, request, hit, num_tokens)
        if cut == num_tokens:
            break
        hit, num_tokens, _ = coordinator.find_longest_cache_hit(request.block_hashes, cut)
    if hit is blocks.blocks:
        return blocks, num_tokens, boundary
    return kv_cache_manager.create_kv_cache_blocks(tuple(hit)), num_tokens, 0


def install_metrics_hooks() -> None:
    """Process 0: the periodic INFO line (the engine core records from the hooks above). API
    servers of ``--api-server-count`` > 1: H2O's collector beside every Prometheus
    multiprocess collector, since those registries are what /metrics serves there (vLLM's,
    and the one the instrumentator builds afresh for each scrape)."""
    _wrap("vllm.v1.metrics.loggers:LoggingStatLogger.log", _stats_log_wrapper)
    _wrap("prometheus_client.multiprocess:MultiProcessCollector.__init__", _multiprocess_wrapper)


RAY_COPY_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def share_env_with_ray_workers(name: str) -> None:
    """Adds ``name`` to ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``, the list of variables vLLM's Ray
    executor sends its workers (vllm/ray/ray_env.py ``get_env_vars_to_copy``): a Ray worker is
    started by its raylet, not by the process that set the variable."""
    listed = [v for v in os.environ.get(RAY_COPY_ENV, "").split(",") if v.strip()]
    if name not in listed:
        os.environ[RAY_COPY_ENV] = ",".join(listed + [name])


def _multiprocess_wrapper(original):
    def __init__(self, registry, path=None):
        original(self, registry, path)
        if registry is not None:
            metrics.register_collector(registry)
    return __init__


def _stats_log_wrapper(original):
    def log(self):
        original(self)
        if _h2o_of(self) is not None:
            line = metrics.summary_if_changed(self.__dict__)
            if line is not None:
                # Under "vllm.": vLLM's handler and format, beside its own stats line.
                logging.getLogger("vllm.h2o_vllm").info("%s", line)
    return log
