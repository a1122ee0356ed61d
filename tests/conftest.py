"""Run-wide fixtures: the model directories every test tier shares, each built once per run.

Without a GPU the Triton kernels can only run interpreted. TRITON_INTERPRET is read when a
``@triton.jit`` kernel is defined (module import), so it is set here, before any tier's test
module imports ``h2o_vllm.kernels``. vLLM's CPU engines ignore it (its Triton check still
finds no CPU backend), so the engine tiers run as they would without it.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from h2o_vllm.tools import models


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Tiny random GQA Llama with peaky attention (fp32, ~1 s to build): exactness tests."""
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, cached across runs in $H2O_VLLM_CACHE (~20 s on the first run)."""
    return models.smollm2_dir()


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M (hybrid sliding-window), cached like SmolLM2 (~2.3 min on the first run)."""
    return models.gemma3_dir()
