"""Import every module the GPU check's vLLM path loads, before any GPU call.

With the bundle, a missing dependency or a stand-in gap otherwise surfaces minutes later inside
an engine process; here it is one line per module. Run by ``gpu_check.sh`` (step ``imports``).
Importing ``vllm.platforms.cuda`` loads the ``_C`` stand-in under its real name; no CUDA context
is created.
"""
from __future__ import annotations

import importlib
import sys

MODULES = (
    "vllm", "vllm.envs", "vllm.config", "vllm.engine.arg_utils", "vllm.entrypoints.llm",
    "vllm._C_stable_libtorch", "vllm.vllm_flash_attn", "vllm._custom_ops", "vllm.platforms.cuda",
    "vllm.kernels.vllm_c", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
    "vllm.v1.core.sched.scheduler", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.triton_attn", "vllm.v1.attention.backends.fa_utils",
    "vllm.v1.sample.sampler", "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.dummy_loader", "vllm.benchmarks.throughput",
    "vllm.entrypoints.cli.benchmark.main", "vllm.entrypoints.cli.serve",
    "h2o_vllm.plugin", "h2o_vllm.frontend.cli", "h2o_vllm.worker.cuda", "h2o_vllm.vllm_shims.introspect",
)


def main(modules=MODULES, expect_cuda: bool = False) -> int:
    failed = 0
    for name in modules:
        try:
            importlib.import_module(name)
            print(f"ok   {name}")
        except Exception as e:  # noqa: BLE001 - each failure is reported, then the next tried
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    import torch
    ops = [op for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
           if not hasattr(torch.ops._C, op)]
    if ops:
        failed += 1
        print(f"FAIL torch.ops._C lacks {ops}: the stand-in did not register")
    # vLLM picks its platform through NVML (no CUDA context); a GPU machine must say CUDA.
    from vllm.platforms import current_platform
    print(f"platform: {type(current_platform).__name__}")
    if expect_cuda and not current_platform.is_cuda():
        failed += 1
        print("FAIL vLLM did not detect the CUDA platform (NVML?)")
    return 1 if failed else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    expect = "--expect-cuda" in args
    sys.exit(main([a for a in args if a != "--expect-cuda"] or MODULES, expect_cuda=expect))
