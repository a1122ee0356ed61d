"""Run-wide fixtures: the model directories every test tier shares, each built once per run."""

from pathlib import Path

import pytest

from h2o_vllm import models


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Tiny random GQA Llama with peaky attention (fp32, ~1 s to build): exactness tests."""
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, cached across runs in $H2O_VLLM_CACHE (~20 s on the first run)."""
    return models.smollm2_dir()
