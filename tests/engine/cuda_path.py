"""Where the CUDA-path engine tests run (imported by them): compiled on a GPU, else inside
vLLM's CPU engine with every Triton kernel interpreted (``H2O_VLLM_TRITON_ON_CPU=1`` with
``TRITON_INTERPRET=1``, set by the top conftest; docs/cuda.md says what that proves)."""
import os

import torch

from engines import V2_ENV
from h2o_vllm.vllm_hooks.triton_on_cpu import SWITCH

ON_GPU = torch.cuda.is_available()
CUDA_PATH_RUNS = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
if ON_GPU:
    # A fraction of the GPU: H2O's fp32 score buffers sit outside the KV memory vLLM budgets.
    DEVICE = dict(gpu_memory_utilization=0.3, num_gpu_blocks_override=512)
else:
    DEVICE = dict(env={SWITCH: "1", V2_ENV: "0"})
