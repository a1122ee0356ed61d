"""H2O's KV connectors: vLLM's connector API (``--kv-transfer-config``) carrying H2O's state.

Both sides are thin: the scheduler's calls go to ``kv_transfer.transfer_scheduler.TransferScheduler``, the
worker's to ``kv_transfer.save_load``; a connector only supplies its medium. Users keep vLLM's flag
and connector names (``kv_transfer.transfer_config.settle``):
``{"kv_connector": "ExampleConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
"kv_connector_extra_config": {"shared_storage_path": ...}}`` runs ``H2OStorageConnector``
(shared storage) in its place, ``{"kv_connector": "NixlConnector", "kv_role": "kv_both"}``
runs ``H2ONixlConnector`` (``kv_transfer.nixl_connector``: NIXL reads from the producer's memory).
Why a connector of our own and not a wrapper of vLLM's: a stock connector moves whole blocks
by token position, and after compaction position ``t`` of a block is no token in particular;
what must travel (live K/V per head, their scores) is H2O's, and so is when (after the
prompt's compaction). A speculative drafter's own layers (KV-cache groups H2O leaves whole)
travel beside it as the blocks that hold the prompt (``kv_transfer.save_load``).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
                                                               SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from h2o_vllm import metrics
from h2o_vllm.config import h2o_config
from h2o_vllm.kv_transfer import save_load
from h2o_vllm.kv_transfer.groups import by_pool_block, h2o_groups, whole_groups
from h2o_vllm.kv_transfer.orders import KVMove, TransferOrders
from h2o_vllm.kv_transfer.store import KVStore
from h2o_vllm.kv_transfer.transfer_config import H2O_CONNECTOR
from h2o_vllm.kv_transfer.transfer_scheduler import TransferScheduler, WholeGroup
from h2o_vllm.scheduler import scheduling
from h2o_vllm.scheduler.manager import h2o_managers

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


class H2OConnector(KVConnectorBase_V1, SupportsHMA):
    """What both of H2O's connectors share; a medium supplies ``_make_transfer`` (scheduler)
    and ``_write`` / ``_read`` (worker). ``SupportsHMA``: vLLM keeps its hybrid KV-cache
    manager on beside it, so a speculative drafter's layers keep KV-cache groups of their own
    (H2O leaves them whole) instead of failing to unify with H2O's."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = h2o_config(vllm_config)
        if config is None:
            raise ValueError(f"{type(self).__name__} carries H2O's KV state: turn H2O on (--kv-eviction h2o), "
                             "or use vLLM's own connector without H2O")
        self.requests: dict[str, Any] = {}
        self.transfer = None
        self.h2o_groups, self.whole_groups = h2o_groups(kv_cache_config), whole_groups(kv_cache_config)
        #: Each H2O layer's position among the H2O groups (its blocks in ``KVMove.block_ids``).
        self.h2o_group_of = {name: i for i, (_, group) in enumerate(self.h2o_groups) for name in group.layer_names}
        self.whole_caches: list[tuple[str, int, torch.Tensor]] = []  # worker: (name, group, blocks view)
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._kv_transfer_config
            self.transfer = self._make_transfer(config, dict(
                block_size=vllm_config.cache_config.block_size,
                world_size=vllm_config.parallel_config.tensor_parallel_size,
                produces=transfer.is_kv_producer, consumes=transfer.is_kv_consumer,
                whole=tuple(WholeGroup(g.kv_cache_spec.block_size, tuple(sorted(g.layer_names)))
                            for _, g in self.whole_groups)))

    def _make_transfer(self, config, common: dict):
        raise NotImplementedError

    def _write(self, move: KVMove, tensors: dict[str, torch.Tensor]) -> int:
        raise NotImplementedError

    def _read(self, move: KVMove) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saved within the step: nothing is in flight when a request is preempted

    # Scheduler side.

    def _managers(self) -> list:
        """The H2O groups' managers, in group order (as ``h2o_groups`` lists them)."""
        return h2o_managers(self._kv_cache_manager)

    def _split(self, ids) -> tuple[list[list[int]], list[list[int]]]:
        """A request's block ids (every group's): the H2O groups', the whole groups'."""
        return [ids[g] for g, _ in self.h2o_groups], [ids[g] for g, _ in self.whole_groups]

    def on_new_request(self, request) -> None:
        self.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.transfer.matched(request, num_computed_tokens, self._managers()), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        h2o_ids, whole_ids = self._split(blocks.get_block_ids())
        self.transfer.allocated(request, h2o_ids, num_external_tokens, whole_ids)

    def _whole_ids(self, req_id: str) -> list[list[int]]:
        return self._split(self._kv_cache_manager.get_block_ids(req_id))[1]

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        # vLLM builds this before ``_update_after_schedule``, where H2O takes off padding it would
        # cut (and the fresh blocks sized for it): take it off first, so that a save reads the
        # blocks of the step as it runs. The later call finds nothing left to take.
        scheduling.drop_padding(self._managers(), scheduler_output, self.requests)
        return H2OConnectorMetadata(self.transfer.orders(scheduler_output, self.requests, self._managers(),
                                                         self._whole_ids))

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        return False, self.transfer.finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)

    # Worker side.

    def _layers(self):
        """(name, impl, kv_cache, H2O group) of each H2O attention layer (read from the config,
        not the forward context: Model Runner V2 saves after it has closed). A drafter's
        layers run H2O's backend too, with their cache whole: their group says which they are."""
        for name, layer in self._vllm_config.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if name in self.h2o_group_of and hasattr(impl, "cache_state"):
                yield name, impl, layer.kv_cache, self.h2o_group_of[name]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the whole groups' layers, one row per block of the pool."""
        num_blocks = self._kv_cache_config.num_blocks
        self.whole_caches = [(name, i, by_pool_block(kv_caches[name], num_blocks, name))
                             for i, (_, group) in enumerate(self.whole_groups)
                             for name in sorted(group.layer_names) if name in kv_caches]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        orders = self._get_connector_metadata().orders
        if orders.loads:
            save_load.load(orders, self._layers(), self._read, self.whole_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # every layer is saved at once, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        orders = self._get_connector_metadata().orders
        if orders.saves:
            metrics.recorder().add(kv_transfer_saved_bytes=save_load.save(orders, self._layers(), self._write,
                                                                         self.whole_caches))


class H2OStorageConnector(H2OConnector):
    """H2O's state through shared storage (``KVStore``), on ``ExampleConnector``'s settings."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        extra = vllm_config.kv_transfer_config
        self.store = KVStore(extra.get_from_extra_config("shared_storage_path", "/tmp") if extra else "/tmp")
        super().__init__(vllm_config, role, kv_cache_config)

    def _make_transfer(self, config, common: dict):
        return TransferScheduler(self.store, config, **common)

    def _write(self, move: KVMove, tensors: dict[str, torch.Tensor]) -> int:
        return self.store.write_rank(move.key, get_tensor_model_parallel_rank(), tensors)

    def _read(self, move: KVMove) -> dict[str, torch.Tensor]:
        return self.store.read_rank(move.key, get_tensor_model_parallel_rank())
