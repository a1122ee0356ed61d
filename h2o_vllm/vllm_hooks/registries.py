"""H2O's entries in vLLM's registries: the KV-cache spec and the KV connectors (every process)."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from h2o_vllm.kv_transfer.transfer_config import H2O_CONNECTOR, H2O_NIXL_CONNECTOR
from h2o_vllm.scheduler.manager import H2OManager
from h2o_vllm.spec import H2OAttentionSpec


def register_kv_cache_spec() -> None:
    KVCacheSpecRegistry._ensure_registered()
    # Its own base: H2O layers share a KV-cache group only with H2O layers, so a drafter's
    # full-attention layers (left whole) get groups and block tables of their own.
    KVCacheSpecRegistry.register(H2OAttentionSpec, H2OManager, uniform_type_base_spec=H2OAttentionSpec)


def register_kv_connector() -> None:
    """H2O's connectors by name in vLLM's connector registry."""
    for name, module in ((H2O_CONNECTOR, "h2o_vllm.kv_transfer.connector"),
                         (H2O_NIXL_CONNECTOR, "h2o_vllm.kv_transfer.nixl_connector")):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
