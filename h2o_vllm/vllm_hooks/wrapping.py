"""How a hook replaces a vLLM attribute: once per process, marked, the original reachable
(``functools.wraps`` keeps ``__wrapped__``), a classmethod kept one."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from h2o_vllm.config import h2o_config
from h2o_vllm.vllm_shims.symbols import _require

_MARK = "_h2o_vllm_hook"


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
    return h2o_config(obj.vllm_config)
