"""Engine settings that keep vLLM off the compiled code the bundle leaves out.

Used wherever the GPU check builds an engine from the bundle: the pytest plugin
(``pytest_bundle``), the load check (``load``) and the throughput commands (``cli_flags``), so
both sides of every comparison run the same way. /work/shared/design/gpu-device.md records how
these were found. Standard library only.
"""
from __future__ import annotations

import copy
import json
import sys

# FlashInfer's sampler and the V2 model runner need compiled extensions the bundle lacks (H2O
# runs on either runner; an installed vLLM runs its defaults, V2 included: docs/cuda.md).
# Spawned engine cores: a test process has often touched CUDA before it starts an engine, and a
# forked child cannot re-initialise CUDA (the first H200 run failed that way).
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
       "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
# Eager: CUDA graphs need ``weak_ref_tensor`` from the compiled extension. custom_ops "none":
# every CustomOp runs its forward_native. ir_op_priority: vLLM's native RMS norms first (the
# stand-in's ``_C`` bodies are only the fallback).
ENGINE = {
    "enforce_eager": True,
    "compilation_config": {"custom_ops": ["none"]},
    "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
}


def apply(kwargs: dict) -> dict:
    """``vllm.LLM`` keyword arguments with the bundle's settings imposed (others kept)."""
    out = dict(kwargs)
    out["enforce_eager"] = True
    compilation = copy.deepcopy(out.get("compilation_config") or {})
    if not isinstance(compilation, dict):  # a CompilationConfig object
        compilation.custom_ops = ["none"]
    else:
        compilation["custom_ops"] = ["none"]
    out["compilation_config"] = compilation
    out.setdefault("ir_op_priority", copy.deepcopy(ENGINE["ir_op_priority"]))
    return out


def cli_flags() -> list[str]:
    """The same settings as ``vllm serve`` / ``vllm bench`` flags."""
    return ["--enforce-eager",
            "--compilation-config", json.dumps(ENGINE["compilation_config"]),
            "--ir-op-priority", json.dumps(ENGINE["ir_op_priority"])]


if __name__ == "__main__":
    # ``env``: shell exports for gpu_check.sh; ``flags``: one CLI flag per line.
    what = sys.argv[1] if len(sys.argv) > 1 else "env"
    lines = [f"export {k}={v}" for k, v in ENV.items()] if what == "env" else cli_flags()
    print("\n".join(lines))
