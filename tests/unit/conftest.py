"""Unit tier: no engine runs here, so Triton may run interpreted on the CPU.

TRITON_INTERPRET is read when a ``@triton.jit`` kernel is defined (module import), so it is
set before any test module imports ``h2o_vllm.kernels``; without a GPU nothing else could
run them. Engine tiers must not inherit it: vLLM would then believe Triton runs on the CPU.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
