"""CUDA-only engine settings for H2O: the backend and CUDA graphs.

Runs in the process that builds the engine config, from the engine-args hook
(``vllm_hooks.install_engine_args_hook``), only when H2O is on and the platform is CUDA.
``adjust_engine_args`` settles what the user left to vLLM's defaults (each change logged at
WARNING) and refuses what the user asked for explicitly and H2O cannot run with;
``check_vllm_config`` verifies the built config. vLLM's other defaults stand with H2O on:
its model runner (V2 on CUDA; V1 on the CPU unless ``VLLM_USE_V2_MODEL_RUNNER=1`` under
``H2O_VLLM_TRITON_ON_CPU``), each with its runner hook (``vllm_hooks.runner``,
``vllm_hooks.runner_v2``); and async scheduling, since H2O's scheduler accounts each step's
compaction when it schedules the step (``scheduler.scheduling.cut_scheduled``).

Why each setting:
- Backend: H2O's builder and impl live in ``H2OTritonAttentionBackend``, registered as
  ``AttentionBackendEnum.CUSTOM`` (plugin.py); vLLM only picks it when asked.
- CUDA graphs: the step plan changes in Python every step, so attention must stay out of
  graphs: PIECEWISE (attention is one of the splitting ops) or none (--enforce-eager).
"""
from __future__ import annotations

import logging
from typing import Any

from vllm.config import CompilationConfig
from vllm.config.attention import AttentionConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from h2o_vllm.config import FP8_KV_CACHE_DTYPES, TRITON_ON_CPU_SWITCH, triton_on_cpu_enabled
from h2o_vllm.vllm_shims.cpu_attention import reads_fp8

logger = logging.getLogger("h2o_vllm")

_OFF = "or turn H2O KV eviction off (drop --kv-eviction h2o / additional_config['h2o'])"


def _platform_is_cuda() -> bool:
    return current_platform.is_cuda()


def adjust_engine_args(args: Any, is_cuda: bool | None = None) -> None:
    """Before vLLM builds its config (``EngineArgs`` fields; the environment for the runner).
    The backend choice also applies to the CUDA path run on the CPU (``H2O_VLLM_TRITON_ON_CPU``)."""
    is_cuda = _platform_is_cuda() if is_cuda is None else is_cuda
    if is_cuda or triton_on_cpu_enabled():
        _choose_backend(args, "on CUDA" if is_cuda else f"with {TRITON_ON_CPU_SWITCH}=1")
    if not is_cuda:
        return
    if isinstance(args.compilation_config, dict):
        args.compilation_config = CompilationConfig(**args.compilation_config)
    mode = args.compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        _refuse_full_graphs(mode)
    if mode is None and not args.enforce_eager:
        logger.warning("h2o: CUDA graphs are piecewise (cudagraph_mode=PIECEWISE): attention "
                       "runs outside the graphs because H2O's step plan changes every step")
        args.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def _choose_backend(args: Any, where: str) -> None:
    # "auto" and None both leave the choice to vLLM; names are parsed as vLLM parses them.
    backend = AttentionConfig.validate_backend_before(args.attention_backend)
    if backend is None:
        backend = getattr(args.attention_config, "backend", None)
    if backend is None:
        logger.warning("h2o: using the H2O attention backend %s (vLLM's Triton attention with "
                       "H2O eviction), as --attention-backend CUSTOM would", where)
        args.attention_backend = AttentionBackendEnum.CUSTOM
    elif backend != AttentionBackendEnum.CUSTOM:
        raise ValueError(
            f"--attention-backend {getattr(backend, 'name', backend)} cannot be combined with H2O "
            f"KV eviction {where}: H2O runs on its own backend (vLLM's Triton attention with "
            f"H2O's scores and compaction). Pass --attention-backend CUSTOM or drop the flag, {_OFF}")


def check_vllm_config(vllm_config: Any, is_cuda: bool | None = None) -> None:
    """After vLLM built its config: graphs and cache dtype."""
    is_cuda = _platform_is_cuda() if is_cuda is None else is_cuda
    _check_cache_dtype(vllm_config, is_cuda or triton_on_cpu_enabled())
    if not is_cuda:
        return
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        _refuse_full_graphs(mode)
    attention_split = (compilation.splitting_ops_contain_attention()
                       or getattr(compilation, "use_inductor_graph_partition", False))
    if mode is not None and mode.has_piecewise_cudagraphs() and not attention_split:
        raise ValueError(
            "piecewise CUDA graphs without attention among the splitting ops cannot be combined "
            "with H2O KV eviction: attention would be captured in a graph. Leave "
            f"compilation_config.splitting_ops at its default, or pass --enforce-eager, {_OFF}")


def _check_cache_dtype(vllm_config: Any, cuda_path: bool) -> None:
    """fp8 (e4m3, per-tensor scales) where vLLM's attention reads it; every other quantised
    cache refused."""
    cache = vllm_config.cache_config
    cache_dtype = str(cache.cache_dtype)
    if cache_dtype in ("auto", "bfloat16", "float16", "float32"):
        return
    if cache_dtype not in FP8_KV_CACHE_DTYPES:
        why = ("H2O reads fp8 caches with per-tensor scales only (fp8 / fp8_e4m3): a per-token-head "
               "cache keeps each slot's scale inline, which compaction does not move, and "
               "fp8_e5m2 is untested")
        raise ValueError(f"--kv-cache-dtype {cache_dtype} cannot be combined with H2O KV eviction: "
                         f"{why}. Use --kv-cache-dtype fp8, {_OFF}")
    if not cuda_path:
        head_size = vllm_config.model_config.get_head_size()
        cpu_fp8_refusal(cache_dtype, cache.block_size, head_size, _cpu_reads_fp8())


def cpu_fp8_refusal(cache_dtype: str, block_size: int, head_size: int, isa_reads_fp8: bool) -> None:
    """Raise unless vLLM's CPU attention reads an fp8 cache for this model and block size: its
    ``vec`` ISA (blocks of a multiple of 32, head sizes a multiple of 32) on x86 with AVX-512 or
    AMX (``cpu_attn._get_attn_isa``). H2O's CPU backend reads the same layout
    (``worker/cpu/layout.py``). Checked here, before the model loads: vLLM itself would fail in
    its first forward."""
    needs = []
    if not isa_reads_fp8:
        needs.append("an x86 CPU with AVX-512 or AMX (vLLM's CPU attention reads fp8 only there; "
                     "this one has neither)")
    if head_size % 32:
        needs.append(f"a head size that is a multiple of 32 (this model's is {head_size})")
    if block_size % 32:
        needs.append(f"--block-size a multiple of 32 (got {block_size}; vLLM's fp8 CPU kernels "
                     "have no 16-token blocks)")
    if needs:
        raise ValueError(f"--kv-cache-dtype {cache_dtype} on the CPU backend needs "
                         f"{'; '.join(needs)}: vLLM's own requirements, which H2O keeps. "
                         "Drop --kv-cache-dtype or meet them")


def _cpu_reads_fp8() -> bool:
    return reads_fp8()


def _refuse_full_graphs(mode: Any) -> None:
    raise ValueError(
        f"cudagraph_mode={getattr(mode, 'name', mode)} cannot be combined with H2O KV eviction: a "
        "full CUDA graph would hold attention, whose per-step H2O plan (lengths, compactions) "
        "changes in Python every step. Use cudagraph_mode PIECEWISE (the H2O default) or "
        f"--enforce-eager, {_OFF}")
