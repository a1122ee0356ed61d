"""Every touch of vLLM internals, and the vLLM versions it was written against.

Manifest (each hook: target, why, upstream stand-in, remove when); the hooks live in the
module of the process they run in: ``engine_args`` and ``request_validation`` (process 0),
``engine_core`` (the scheduler's process), ``runner`` (the step sequence both runners share),
``runner_v1``, ``runner_v2`` and ``cpu_attention`` (worker). A wrapper only reads vLLM's objects
and applies what a named function outside this package decides (``worker.runner_state``,
``worker.plan``, ``scheduler.scheduling``, ``spec``, ``frontend.settings``,
``frontend.requests``, ``metrics``); ``seam`` holds the lookup, wrapping and version-guard
helpers every hook module uses. Two modules touch vLLM's private objects without wrapping
anything: ``kv_manager`` (``H2OManager``'s call into vLLM's copy-on-write) and ``introspect``
(read-only lookups the benchmarks, tools and tests make into a running engine: its scheduler,
block pool, preemption count).

- ``install_runner_hook`` wraps ``GPUModelRunner._build_attention_metadata``
  (vllm/v1/worker/gpu_model_runner.py; the CPU runner inherits it).
  Why: vLLM 0.32's V1 runner gives attention builders no request identity or prompt length,
  and a block-table row only grows. The hook reads the batch and passes it to
  ``worker.plan.plan_batch`` (per row: the request's ``Budget``, KV-space lengths); the plan
  reaches the builders for the extent of the one build (``worker.building``) and the
  layers through the attention metadata; the hook truncates the rows
  ``worker.plan.rows_to_truncate`` names, in step with ``H2OManager`` freeing their tail blocks
  at the next schedule. Per-runner state (budgets, orders, rewrites) is one
  ``worker.runner_state.RunnerState``, the attribute ``h2o_state`` on vLLM's runner.
  Upstream: patches/0001-attn-metadata-request-context.patch. Remove when every supported
  vLLM passes request context to builders.
- ``install_runner_v2_hook`` (module ``runner_v2``) does the same on Model Runner V2
  (vllm/v1/worker/gpu/model_runner.py, the CUDA default; on the CPU with
  ``VLLM_USE_V2_MODEL_RUNNER=1`` under ``H2O_VLLM_TRITON_ON_CPU``): it wraps
  ``GPUModelRunner.update_requests`` (new requests' budgets, resolved once from their sampling
  params as on V1; prefix-cache orders; rows that compacted into fresh blocks rewritten
  with ``BlockTables.block_tables[g].stage_write`` and ``num_blocks``), ``prepare_attn`` (the
  step plan from the ``InputBatch`` and ``RequestState.prompt_len``, held for that batch;
  compacted rows' ``BlockTables.num_blocks`` cut) and ``get_kv_cache_spec``, and
  ``DefaultModelState.prepare_attn`` (the builders build with the plan held for that batch).
  Why and upstream: as for V1. Remove with the V1 hook.
- ``install_runner_hook`` also wraps ``GPUModelRunner.get_kv_cache_spec``.
  Why: ``AttentionBackend.customize_spec`` is a classmethod without the config, so it cannot
  tell whether H2O is on; the runner can. Full-attention specs become ``H2OAttentionSpec``
  (``spec.h2o_specs``).
- ``install_scheduler_hook`` wraps ``Scheduler.add_request`` / ``Scheduler._free_blocks``.
  Why: a single-type KV-cache manager only sees request ids, not per-request budgets
  (``SamplingParams.extra_args``): ``scheduler.scheduling.add_request`` resolves each request's
  ``Budget`` into the managers' ``RequestBudgets``, ``finish_request`` drops it. Remove when
  managers receive the request.
- ``install_scheduler_hook`` also wraps ``Scheduler.schedule``: once vLLM has counted the
  step's tokens, each scheduled request's block list is cut to what the step's compaction
  leaves and the tail is freed (``scheduler.scheduling.cut_scheduled``); ``H2OManager`` ignores
  vLLM's own ``remove_skipped_blocks`` calls (processed-token basis). Why: the workers truncate
  their rows while they run the step, and under async scheduling the next step is scheduled
  before this one's output is processed; vLLM also frees skipped blocks lazily in
  ``allocate_slots``, so a freshly compacted prompt would still hold its whole prompt's blocks
  when an earlier request in the queue preempts it. Remove when vLLM lets a manager free
  blocks at schedule time.
- ``install_scheduler_hook`` also wraps ``Scheduler._reserve_prefill_lookahead``, the last
  adjustment vLLM makes to a request's tokens for a step (running and waiting requests both
  pass through it, after the token budget and ``long_prefill_token_threshold``): with
  ``prefill_chunk`` the step is cut at the request's next prefill-chunk end
  (``scheduler.scheduling.limit_step``); so are a speculative step's drafts, before the
  request's next compaction. Why: vLLM has no per-request chunk alignment
  (``long_prefill_token_threshold`` is engine-wide and not aligned to positions); the
  cadence checks chunk ends, which must not depend on the batch. Upstream: a per-request
  prefill chunk limit in the scheduler. Remove when vLLM has one.
- ``install_scheduler_hook`` also wraps ``Scheduler._update_after_schedule``, the end of
  ``schedule`` (the step's output built, its tokens not yet counted as computed): under
  speculative decoding vLLM pads a request admitted with one token left (a prefix-cache hit
  or a KV-connector load up to its last token) with dummy drafts, always rejected, and
  asserts the padded row whole, so ``limit_step`` leaves it; where a compaction would fall
  among the dummies the hook takes them off (``scheduler.scheduling.drop_padding``) and the row
  runs its one token alone, as vLLM runs a row it does not pad. Why: a step with drafts must
  not compact (docs/semantics.md, "Speculative decoding"). Upstream: padding a row only where
  the scheduler's step limit leaves room. Remove when vLLM pads no admitted row, or asks.
- ``install_scheduler_hook`` also wraps ``KVCacheManager.allocate_slots``: for an admission
  (request WAITING or PREEMPTED) it raises ``watermark_blocks``, vLLM's admission headroom, to
  ``scheduler.scheduling.admission_watermark`` for that one call (its keyword arguments give the
  step's end and the draft slots, ``num_lookahead_tokens``). Why: H2O sequences have a known, small
  peak; vLLM admits greedily and preempts (recomputes) when running sequences then cannot grow.
  Upstream: a per-spec admission reserve hook in the KV-cache manager.
- Prefix caching (docs/prefix-caching.md): ``install_scheduler_hook`` also wraps
  ``KVCacheManager.get_computed_blocks``, cutting a hit back to the longest boundary H2O can
  resume exactly (``scheduler.prefix_hits.cut_hit``), and the ``schedule`` / ``update_from_output``
  hooks above carry the step's ``PrefixOrders`` on ``SchedulerOutput`` (attribute
  ``h2o_prefix``) and commit the score records a step wrote. ``install_runner_hook`` also
  wraps ``GPUModelRunner._update_states`` to take those orders and to give the rows that
  compacted into fresh blocks those blocks before vLLM appends the next ones.
  ``H2OManager.add_local_computed_blocks`` calls vLLM's private ``_apply_cow`` (through
  ``vllm_shims.kv_manager.redirect_to_copy``) so that vLLM
  copies each hit block into one of the request's own before the step.
  Why: vLLM has no hook for a KV-cache manager to veto part of a hit, to send per-step data
  to the workers, or to remap a request's blocks. Upstream: a manager-level hit filter and a
  plugin payload on SchedulerOutput. Remove when vLLM has them.
- ``vllm_shims.cpu_attention.use_readable_isa`` (called by ``H2OCPUMetadataBuilder``) sets
  the CPU builder's ``isa`` and calls its private ``_set_isa_to_layers``.
  Why: H2O reads K back in the ``vec``/``vec16`` layouts only; vLLM may pick AMX.
  Remove when vLLM exposes a readable K view of every CPU layout.
- ``install_engine_args_hook`` wraps ``EngineArgs.create_engine_config``
  (vllm/engine/arg_utils.py), in the process that builds the engine config.
  Why: the H2O config must be validated and
  conflicting settings refused before any model weight loads (``frontend.settings``:
  ``settle_engine_args`` before vLLM builds its config, ``check_engine_config`` after).
  Not an upstream candidate: it is plugin policy.
- ``register_kv_cache_spec`` calls the private ``KVCacheSpecRegistry._ensure_registered``.
  Why: registering first would otherwise leave vLLM's built-in specs unregistered.
- ``install_cli_flags_hook`` wraps ``EngineArgs.add_cli_args`` (vllm/engine/arg_utils.py) and
  the ``parse_known_args`` of each parser it fills.
  Why: vLLM has no plugin group for engine flags. The wrapper adds the "H2O KV eviction"
  group (``h2o_vllm.frontend.flags``) to every engine parser (``vllm serve``, the API server,
  ``vllm bench throughput``) and folds the flags into ``--additional-config`` right after
  parsing, so a bad flag is an argparse error (exit 2) before anything loads.
  Upstream: none (plugin-defined flags would need a vLLM plugin group). Remove when vLLM
  lets plugins contribute engine arguments.
- ``install_request_validation_hook`` wraps ``InputProcessor._validate_params``
  (vllm/v1/engine/input_processor.py), in process 0.
  Why: per-request budgets (``extra_args`` / ``vllm_xargs``) must be refused before the
  request is queued: ``ValueError`` -> HTTP 400 in the server, raised by ``LLM.generate``.
  Upstream: none needed while SamplingParams has no extension point for extra_args checks.
- ``install_request_validation_hook`` also wraps ``InputProcessor.process_inputs`` (process 0).
  Why: only the processed request has its prompt's length and resolved ``max_tokens``; a
  request that could never fit the KV pool (``frontend.requests.check_request_fits``, with
  ``max_model_len`` above the pool) is refused there instead of waiting forever.
- ``install_request_validation_hook`` also wraps ``OpenAIServingCompletion.create_completion``,
  ``OpenAIServingChat.create_chat_completion`` and ``OpenAIServingResponses.create_responses``
  (vllm/entrypoints/openai/*/serving.py), in API-server processes only (a top-level process 0,
  or one named ``ApiServer_<i>``).
  Why: the input processor runs inside the engine client's ``generate``, which a streaming
  response iterates only after its HTTP 200 is sent, so a bad streaming request became an SSE
  error event. The wrapper checks ``vllm_xargs`` first; its ``VLLMValidationError`` reaches
  vLLM's exception handler as HTTP 400, streaming or not. Upstream: a validation hook for
  ``extra_args`` run before the serving layer starts a response. Remove when vLLM has one.
- Metrics: ``install_scheduler_hook`` also wraps ``Scheduler.schedule`` and records from it
  and from the ``update_from_output`` hook above (engine core: freed blocks, live KV tokens
  read from the H2O managers); ``install_metrics_hooks`` wraps ``LoggingStatLogger.log``
  (process 0: one INFO line beside vLLM's periodic stats) and prometheus_client's
  ``MultiProcessCollector.__init__``: with ``--api-server-count`` > 1 each API server serves
  multiprocess registries of its own (vLLM's, and one the instrumentator builds for each
  scrape), which get H2O's collector too. ``share_env_with_ray_workers`` lists the metrics
  directory's variable in ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``: Ray workers are no children of
  process 0, and vLLM's Ray executor sends them only the variables it knows. The worker side records
  in the runner hook above and in ``H2OCPUImpl``. Remove when vLLM's SchedulerStats carry
  plugin stats.
- KV transfer (docs/kv-transfer.md): ``register_kv_connector`` registers
  ``H2OStorageConnector`` and ``H2ONixlConnector`` (module ``connector``, ``KVConnectorBase_V1``
  subclasses: vLLM's
  public connector API, each method a call into ``kv_transfer.transfer_scheduler`` or ``kv_transfer.save_load``)
  with ``KVConnectorFactory``; it reads its own metadata through the base class's
  ``_get_connector_metadata`` and the attention layers from the compilation config's
  ``static_forward_context``. The scheduler hook's ``add_request`` asks it for a consumer
  request's H2O prompt length (``TransferScheduler.prompt_len``) before it resolves the budget,
  and the runner hooks read the step's prompt lengths from its metadata on
  ``SchedulerOutput.kv_connector_metadata`` (``runner.transferred_prompt_lens``) before they
  plan. ``H2OManager.allocate_external_computed_blocks`` overrides vLLM's allocation of a
  load (KV space, not the prompt). Why: vLLM's connectors move blocks by token position, and
  a consumer's request is the producer's continued (its prompt one token shorter for H2O).
  ``H2ONixlConnector`` also uses the base class's worker-to-scheduler channels
  (``get_handshake_metadata`` / ``set_xfer_handshake_metadata``: each rank's NIXL agent;
  ``build_connector_worker_meta`` / ``update_connector_output``: reads done, staging read) and
  answers a match of None while a state is being read (vLLM skips the request that step).
  Both declare ``SupportsHMA`` (``request_finished_all_groups``), so vLLM keeps its hybrid
  KV-cache manager beside them and a speculative drafter's layers keep groups of their own;
  they read those layers through the block-major views vLLM hands ``register_kv_caches``
  (module ``connector_groups`` says which groups are whole), and count on vLLM calling
  ``wait_for_save`` after the draft pass when speculation is on (the contract test holds both
  runners to it). Upstream: none needed for the connector itself; a way for a connector to tell the KV-cache
  manager how many slots a load fills would remove the override.
- ``install_triton_on_cpu`` (module ``triton_on_cpu``), only with ``H2O_VLLM_TRITON_ON_CPU=1``,
  in every process: imports vLLM's Triton attention op modules with the real ``triton`` /
  ``tl`` swapped into ``vllm.triton_utils`` (reloading any defined earlier with the
  placeholders, and rebinding the names other vLLM modules imported from them); wraps
  ``CpuPlatform.get_attn_backend_cls`` to honour ``CUSTOM`` and ``TRITON_ATTN``; wraps
  ``torch.cuda.get_device_capability`` to answer for a CPU device; wraps
  ``CpuPlatform.check_and_update_config`` to keep ``scheduler_config.async_scheduling`` as
  vLLM resolved it (its default, or ``--[no-]async-scheduling``); wraps Triton's
  ``InterpreterBuilder.create_splat`` to keep a splatted comparison boolean (the interpreter
  tags comparisons with their operands' type, so masks built that way, as in vLLM's V2 n-gram
  drafter, failed to load). Why: to run the CUDA path
  (``H2OTritonAttentionBackend``) inside vLLM's CPU engine with every Triton kernel
  interpreted, in CI without a GPU. Upstream: none (a test mode). Remove when vLLM's CPU
  build can run Triton attention itself.
"""
from __future__ import annotations

# One namespace for plugin.register() and the tests: each installer lives in the module of the
# process it runs in.
from h2o_vllm.vllm_hooks.engine_args import install_cli_flags_hook, install_engine_args_hook
from h2o_vllm.vllm_hooks.engine_core import install_metrics_hooks, install_scheduler_hook, share_env_with_ray_workers
from h2o_vllm.vllm_hooks.registries import register_kv_cache_spec, register_kv_connector
from h2o_vllm.vllm_hooks.request_validation import install_request_validation_hook
from h2o_vllm.vllm_hooks.runner_v1 import install_runner_hook
from h2o_vllm.vllm_hooks.runner_v2 import install_runner_v2_hook
from h2o_vllm.vllm_hooks.triton_on_cpu import install as install_triton_on_cpu
from h2o_vllm.vllm_hooks.wrapping import _MARK, _h2o_of, _wrap
from h2o_vllm.vllm_shims.symbols import SUPPORTED_VLLM, _require, check_vllm_version, logger

__all__ = ["SUPPORTED_VLLM", "_MARK", "_h2o_of", "_require", "_wrap", "check_vllm_version", "install_cli_flags_hook",
           "install_engine_args_hook", "install_metrics_hooks", "install_request_validation_hook",
           "install_runner_hook", "install_runner_v2_hook", "install_scheduler_hook", "install_triton_on_cpu",
           "logger", "register_kv_cache_spec", "register_kv_connector", "share_env_with_ray_workers"]
