"""H2O's KV connector: vLLM's connector API (``--kv-transfer-config``) carrying H2O's state.

Both sides are thin: the scheduler's calls go to ``scheduler.transfer.TransferScheduler``, the
worker's to ``worker.transfer``. Users keep vLLM's flag and connector name:
``{"kv_connector": "ExampleConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
"kv_connector_extra_config": {"shared_storage_path": ...}}`` runs this class in its place
(``frontend.kv_transfer_config.settle``); its name is ``H2OStorageConnector``.
Why a connector of our own and not a wrapper of vLLM's: a stock connector moves whole blocks
by token position, and after compaction position ``t`` of a block is no token in particular;
what must travel (live K/V per head, their scores) is H2O's, and so is when (after the
prompt's compaction).
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.logger import init_logger

from h2o_vllm.config import h2o_config
from h2o_vllm.frontend.kv_transfer_config import H2O_CONNECTOR
from h2o_vllm.kv_store import KVStore
from h2o_vllm.transfer_orders import TransferOrders

logger = init_logger("vllm.h2o_vllm")

NAME = H2O_CONNECTOR


class H2OConnectorMetadata(KVConnectorMetadata):
    def __init__(self, orders: TransferOrders) -> None:
        self.orders = orders


def transfer_orders(scheduler_output) -> TransferOrders | None:
    """The step's ``TransferOrders``, if H2O's connector sent any (the runner hooks read the
    prompt lengths from here before vLLM binds the metadata to the connector)."""
    meta = getattr(scheduler_output, "kv_connector_metadata", None)
    return meta.orders if isinstance(meta, H2OConnectorMetadata) else None


class H2OStorageConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = h2o_config(vllm_config)
        if config is None:
            raise ValueError(f"{NAME} carries H2O's KV state: turn H2O on (--kv-eviction h2o), or "
                             "use vLLM's ExampleConnector without H2O")
        transfer = self._kv_transfer_config
        self.store = KVStore(transfer.get_from_extra_config("shared_storage_path", "/tmp"))
        self.requests: dict[str, Any] = {}
        self.transfer = None
        if role == KVConnectorRole.SCHEDULER:
            from h2o_vllm.scheduler.transfer import TransferScheduler
            self.transfer = TransferScheduler(
                self.store, config, vllm_config.cache_config.block_size,
                vllm_config.parallel_config.tensor_parallel_size,
                produces=transfer.is_kv_producer, consumes=transfer.is_kv_consumer)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saved within the step: nothing is in flight when a request is preempted

    # Scheduler side.

    def _manager(self):
        from h2o_vllm.vllm_hooks.engine_core import _h2o_managers
        managers = _h2o_managers(self._kv_cache_manager)
        if len(managers) != 1:
            raise RuntimeError(f"{NAME} moves one H2O KV-cache group, found {len(managers)}")
        return managers[0]

    def _group(self) -> int:
        return self._kv_cache_manager.coordinator.single_type_managers.index(self._manager())

    def on_new_request(self, request) -> None:
        self.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.transfer.matched(request, num_computed_tokens, self._manager()), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.transfer.allocated(request, blocks.get_block_ids()[self._group()], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return H2OConnectorMetadata(self.transfer.orders(scheduler_output, self.requests, self._manager()))

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        return False, self.transfer.finished(request)

    # Worker side.

    def _layers(self):
        """(name, impl, kv_cache) of each H2O attention layer (read from the config, not the
        forward context: Model Runner V2 saves after it has closed)."""
        for name, layer in self._vllm_config.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if getattr(impl, "h2o", None) is not None and hasattr(impl, "cache_state"):
                yield name, impl, layer.kv_cache

    def start_load_kv(self, forward_context, **kwargs) -> None:
        orders = self._get_connector_metadata().orders
        if orders.loads:
            from h2o_vllm.worker import transfer
            transfer.load(orders, self._layers(), self.store, _rank())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # every layer is saved at once, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        orders = self._get_connector_metadata().orders
        if orders.saves:
            from h2o_vllm.worker import transfer
            transfer.save(orders, self._layers(), self.store, _rank())


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()
