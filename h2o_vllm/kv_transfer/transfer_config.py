"""``--kv-transfer-config`` with H2O: which connector carries H2O's state, settled and checked
before the model loads (called from ``frontend.settings`` and ``frontend.conflicts``).

Pure logic over the config as given (a dict, or vLLM's ``KVTransferConfig``). The connectors
themselves are ``kv_transfer.connector.H2OStorageConnector`` and ``H2ONixlConnector``
(docs/kv-transfer.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The connectors that carry H2O's state, and vLLM's connectors whose settings they take as
#: they are (same roles, same ``shared_storage_path``, same ``kv_lease_duration``) and run in
#: their place.
H2O_CONNECTOR = "H2OStorageConnector"
H2O_NIXL_CONNECTOR = "H2ONixlConnector"
SETTLED_CONNECTORS = {"ExampleConnector": H2O_CONNECTOR, "NixlConnector": H2O_NIXL_CONNECTOR}
NIXL_INSTALL = "pip install 'h2o-vllm[nixl]'"


def nixl_missing() -> str | None:
    """Why NIXL cannot run here (its package does not import), or None."""
    try:
        from nixl._api import nixl_agent  # noqa: F401  (optional: the nixl extra; probed here)
    except Exception as e:  # ImportError, or a native library that does not load
        return f"{type(e).__name__}: {e}"
    return None


def _field(kv_transfer: Any, name: str):
    return kv_transfer.get(name) if isinstance(kv_transfer, dict) else getattr(kv_transfer, name, None)


def check(kv_transfer: Any, way_out: str) -> None:
    """Refuse a connector that cannot carry H2O's state, naming the one that can."""
    name = _field(kv_transfer, "kv_connector")
    if name in ("NixlConnector", H2O_NIXL_CONNECTOR) and (missing := nixl_missing()) is not None:
        raise ValueError(
            f"--kv-transfer-config names {name}, and H2O's state travels over NIXL then, but the nixl "
            f"package does not import here ({missing}): {NIXL_INSTALL}, or use the shared-storage "
            'connector (\'{"kv_connector": "ExampleConnector", ...}\'), ' + way_out)
    if name not in (H2O_CONNECTOR, H2O_NIXL_CONNECTOR, *SETTLED_CONNECTORS):
        raise ValueError(
            f"the KV connector {name!r} (--kv-transfer-config) cannot be combined with H2O KV "
            "eviction: it saves and loads whole blocks by token position, and after H2O's "
            "compaction a block's slots hold each KV head's kept tokens, not a run of positions. "
            f"H2O's state (kept K/V, scores) travels through {H2O_NIXL_CONNECTOR} or {H2O_CONNECTOR}: pass "
            '--kv-transfer-config \'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\' (NIXL, with '
            'vLLM\'s disaggregation proxy) or \'{"kv_connector": "ExampleConnector", "kv_role": "kv_producer", '
            '"kv_connector_extra_config": {"shared_storage_path": "<a folder both engines see>"}}\' '
            f"(shared storage; kv_consumer on the decode side): H2O runs its own in their place, {way_out}")


def settle(args: Any) -> str | None:
    """Run H2O's connector where the user named one of ``SETTLED_CONNECTORS``; returns the
    one it runs, or None."""
    kv_transfer = getattr(args, "kv_transfer_config", None)
    ours = SETTLED_CONNECTORS.get(_field(kv_transfer, "kv_connector")) if kv_transfer is not None else None
    if ours is None:
        return None
    if isinstance(kv_transfer, dict):
        kv_transfer["kv_connector"] = ours
    else:
        kv_transfer.kv_connector = ours
    return ours


def check_model(model_config: Any, sliding_layers: Sequence[str], way_out: str) -> None:
    """H2O's connector moves the H2O layers' state; a hybrid model's sliding-window layers
    would need vLLM's own transfer beside it."""
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or ()
    if any(t in sliding_layers for t in layer_types):
        raise ValueError(
            f"{getattr(model_config, 'model', 'this model')}: a KV connector (--kv-transfer-config) "
            "cannot be combined with H2O KV eviction on a model with sliding-window layers: H2O's "
            f"connector moves the full-attention layers' kept KV only. Drop --kv-transfer-config, {way_out}")
