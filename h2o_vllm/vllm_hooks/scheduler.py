"""Hooks on the scheduler: per-request budgets for H2OManager, tail blocks freed at the step
boundary, H2O metrics.

Runs in the engine-core process (and the stats-log hook in process 0).
"""
from __future__ import annotations

import logging

from h2o_vllm.vllm_hooks.seam import _h2o_of, _wrap


def install_scheduler_hook() -> None:
    """Engine core: per-request budgets where ``H2OManager`` can read them, tails freed at the
    step boundary, admissions that leave room for running sequences, metrics."""
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.add_request", _add_request_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler._free_blocks", _free_blocks_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.schedule", _schedule_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", _update_from_output_wrapper)
    _wrap("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", _allocate_slots_wrapper)


def _add_request_wrapper(original):
    def add_request(self, request):
        config = _h2o_of(self)
        if config is not None and request.sampling_params is not None:
            from h2o_vllm.config import request_config
            from h2o_vllm.scheduler import requests
            request_h2o = request_config(config, request.sampling_params.extra_args)
            if request_h2o is not config:
                requests.record(request.request_id, request_h2o)
        return original(self, request)
    return add_request


def _free_blocks_wrapper(original):
    def _free_blocks(self, request):
        from h2o_vllm.scheduler import requests
        requests.forget(request.request_id)
        return original(self, request)
    return _free_blocks


def _update_from_output_wrapper(original):
    """Free every running request's compacted tail as soon as its step is processed.

    vLLM frees skipped blocks lazily, in ``allocate_slots``, one request at a time while it
    walks the running queue; a request earlier in the queue that needs a block then preempts
    the newest one, the very prompt whose compaction was about to free most of the pool.
    Same call, same processed-token basis, only earlier. (Alone it took one overload run from
    50 preemptions to 46; the admission headroom below took it to 0.)
    """
    def update_from_output(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        if _h2o_of(self) is not None:
            manager = self.kv_cache_manager
            for request in self.running:
                manager.remove_skipped_blocks(
                    request.request_id, max(0, request.num_computed_tokens - request.num_in_flight_tokens),
                    num_prompt_tokens=request.num_prompt_tokens)
            _record_metrics(self)
        return outputs
    return update_from_output


def install_metrics_hooks() -> None:
    """Process 0: the periodic INFO line (the engine core records from the hooks above)."""
    _wrap("vllm.v1.metrics.loggers:LoggingStatLogger.log", _stats_log_wrapper)


def _h2o_managers(scheduler) -> list:
    return _h2o_managers_of(scheduler.kv_cache_manager)


def _h2o_managers_of(kv_cache_manager) -> list:
    from h2o_vllm.scheduler.manager import H2OManager
    managers = kv_cache_manager.__dict__.get("_h2o_managers")
    if managers is None:
        managers = kv_cache_manager._h2o_managers = [
            m for m in kv_cache_manager.coordinator.single_type_managers if isinstance(m, H2OManager)]
    return managers


def _allocate_slots_wrapper(original):
    """Admissions (waiting or preempted requests) leave room for the running H2O sequences'
    growth: vLLM's own admission watermark, raised by ``H2OManager.admission_headroom`` for
    this one call."""
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        from vllm.v1.request import RequestStatus
        managers = _h2o_managers_of(self)
        if not managers or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return original(self, request, num_new_tokens, *args, **kwargs)
        base = self.watermark_blocks  # the user's --watermark
        self.watermark_blocks = base + sum(m.admission_headroom(request, num_new_tokens, self.max_model_len)
                                           for m in managers)
        try:
            return original(self, request, num_new_tokens, *args, **kwargs)
        finally:
            self.watermark_blocks = base
    return allocate_slots


def _record_metrics(scheduler) -> None:
    managers = _h2o_managers(scheduler)
    if managers:
        from h2o_vllm import metrics
        evicted = managers[0].num_evicted
        live = sum(r.num_computed_tokens - evicted.get(r.request_id, 0) for r in scheduler.running)
        metrics.recorder().set(freed_blocks=sum(m.num_freed_blocks for m in managers),
                               live_kv_tokens=live)


def _schedule_wrapper(original):
    """Metrics once the step's blocks are allocated."""
    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        if _h2o_of(self) is not None:
            _record_metrics(self)
        return output
    return schedule


def _stats_log_wrapper(original):
    def log(self):
        original(self)
        if _h2o_of(self) is not None:
            from h2o_vllm import metrics
            totals = metrics.read_totals()
            # Like vLLM's own line: at INFO while something changes, silent when idle.
            if totals != getattr(self, "_h2o_last_totals", None):
                self._h2o_last_totals = totals
                # Under "vllm.": vLLM's handler and format, beside its own stats line.
                logging.getLogger("vllm.h2o_vllm").info("%s", metrics.summary_line(totals))
    return log

