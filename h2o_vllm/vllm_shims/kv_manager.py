"""The private member of vLLM's single-type KV-cache manager that ``H2OManager`` (its subclass,
``scheduler/manager.py``) needs, behind a named function.

Runs in the engine-core process. Why: a prefix-cache hit's blocks are shared, and H2O scores and
compacts in place, so each hit block must become a private copy of the request's own; vLLM has
the machinery (copy-on-write pairs, copied by the worker before the step) but reaches it only
through a private method. Upstream: a public copy-on-write call on the manager. Remove when
vLLM has one. The signature is recorded in ``tests/unit/vllm_hooks/test_vllm_hooks_contract.py``.
"""
from __future__ import annotations

from h2o_vllm.vllm_shims.symbols import _require

APPLY_COW = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager._apply_cow"


def redirect_to_copy(manager, request_id: str, index: int, source, copy) -> None:
    """Block ``index`` of the request (``source``, a hit) becomes ``copy``; vLLM copies
    ``source``'s K/V into it before the step runs."""
    _require(APPLY_COW)  # an unsupported vLLM fails here, naming the symbol
    manager._apply_cow(request_id, index, source, copy)
