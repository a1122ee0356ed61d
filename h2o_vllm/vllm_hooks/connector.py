"""H2O's KV connectors: vLLM's connector API (``--kv-transfer-config``) carrying H2O's state.

Both sides are thin: the scheduler's calls go to ``scheduler.transfer.TransferScheduler``, the
worker's to ``worker.transfer``; a connector only supplies its medium. Users keep vLLM's flag
and connector names (``frontend.kv_transfer_config.settle``):
``{"kv_connector": "ExampleConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
"kv_connector_extra_config": {"shared_storage_path": ...}}`` runs ``H2OStorageConnector``
(shared storage) in its place, ``{"kv_connector": "NixlConnector", "kv_role": "kv_both"}``
runs ``H2ONixlConnector`` (NIXL reads from the producer's memory, ``worker.nixl_transport``).
Why a connector of our own and not a wrapper of vLLM's: a stock connector moves whole blocks
by token position, and after compaction position ``t`` of a block is no token in particular;
what must travel (live K/V per head, their scores) is H2O's, and so is when (after the
prompt's compaction). A speculative drafter's own layers (KV-cache groups H2O leaves whole)
travel beside it as the blocks that hold the prompt (``worker.transfer``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorWorkerMetadata, SupportsHMA)
from vllm.logger import init_logger

from h2o_vllm.config import h2o_config
from h2o_vllm.frontend.kv_transfer_config import H2O_CONNECTOR, H2O_NIXL_CONNECTOR
from h2o_vllm.kv_store import KVStore
from h2o_vllm.transfer_orders import KVMove, NixlPeer, TransferOrders, TransferReport
from h2o_vllm.vllm_hooks.connector_groups import by_pool_block, h2o_groups, whole_groups

logger = init_logger("vllm.h2o_vllm")

NAME = H2O_CONNECTOR
NIXL_NAME = H2O_NIXL_CONNECTOR


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
            from h2o_vllm.scheduler.transfer import WholeGroup
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
        from h2o_vllm.vllm_hooks.engine_core import _h2o_managers
        return _h2o_managers(self._kv_cache_manager)

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
        from h2o_vllm.scheduler import events
        # vLLM builds this before ``_update_after_schedule``, where H2O takes off padding it would
        # cut (and the fresh blocks sized for it): take it off first, so that a save reads the
        # blocks of the step as it runs. The later call finds nothing left to take.
        events.drop_padding(self._managers(), scheduler_output, self.requests)
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
            from h2o_vllm.worker import transfer
            transfer.load(orders, self._layers(), self._read, self.whole_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # every layer is saved at once, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        orders = self._get_connector_metadata().orders
        if orders.saves:
            from h2o_vllm import metrics
            from h2o_vllm.worker import transfer
            metrics.recorder().add(kv_transfer_saved_bytes=transfer.save(orders, self._layers(), self._write,
                                                                         self.whole_caches))


class H2OStorageConnector(H2OConnector):
    """H2O's state through shared storage (``KVStore``), on ``ExampleConnector``'s settings."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        extra = vllm_config.kv_transfer_config
        self.store = KVStore(extra.get_from_extra_config("shared_storage_path", "/tmp") if extra else "/tmp")
        super().__init__(vllm_config, role, kv_cache_config)

    def _make_transfer(self, config, common: dict):
        from h2o_vllm.scheduler.transfer import TransferScheduler
        return TransferScheduler(self.store, config, **common)

    def _write(self, move: KVMove, tensors: dict[str, torch.Tensor]) -> int:
        return self.store.write_rank(move.key, _rank(), tensors)

    def _read(self, move: KVMove) -> dict[str, torch.Tensor]:
        return self.store.read_rank(move.key, _rank())


@dataclass
class H2ONixlHandshake(KVConnectorHandshakeMetadata):
    peer: NixlPeer


class H2OTransferReport(KVConnectorWorkerMetadata):
    def __init__(self, report: TransferReport) -> None:
        self.report = report

    def aggregate(self, other: "H2OTransferReport") -> "H2OTransferReport":
        return H2OTransferReport(TransferReport().merge(self.report).merge(other.report))


#: ``kv_connector_extra_config`` keys of H2O's NIXL connector, with their defaults.
STAGING_MIB, STAGING_MIB_DEFAULT = "h2o_staging_mib", 1024
LEASE_S, LEASE_S_DEFAULT = "kv_lease_duration", 120
TIMEOUT_S, TIMEOUT_S_DEFAULT = "h2o_nixl_timeout_s", 30  # a decoder's wait for one read


class H2ONixlConnector(H2OConnector):
    """H2O's state over NIXL: each rank reads its share from the producer's staging memory
    (``scheduler.nixl_transfer``, ``worker.nixl_transport``), on ``NixlConnector``'s settings."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        self.nixl = None
        self.layout = None
        super().__init__(vllm_config, role, kv_cache_config)

    def _staging_bytes(self) -> int:
        return int(float(self._kv_transfer_config.get_from_extra_config(STAGING_MIB, STAGING_MIB_DEFAULT)) * 2**20)

    def _make_transfer(self, config, common: dict):
        from h2o_vllm.scheduler.nixl_transfer import NixlTransferScheduler, StateShape
        from h2o_vllm.scheduler.staging import Staging
        groups = [group for _, group in self.h2o_groups]
        spec = groups[0].kv_cache_spec  # every H2O group's layers are alike: one shape, packed by name
        shape = StateShape(sum(len(g.layer_names) for g in groups), spec.num_kv_heads, spec.head_size,
                           spec.dtype.itemsize,
                           tuple(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for _, g in self.whole_groups))
        lease = float(self._kv_transfer_config.get_from_extra_config(LEASE_S, LEASE_S_DEFAULT))
        staging = Staging(self._staging_bytes(), common["world_size"], lease)
        return NixlTransferScheduler(staging, shape, config, **common)

    # Scheduler side.

    def set_xfer_handshake_metadata(self, metadata) -> None:
        self.transfer.peers = tuple(metadata[rank].peer for rank in sorted(metadata))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, H2OTransferReport):
            self.transfer.update(meta.report)

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from h2o_vllm.worker.nixl_transport import NixlTransport, StateLayout
        super().register_kv_caches(kv_caches)
        layers = sorted(self._layers(), key=lambda layer: layer[0])
        views, _ = layers[0][1].cache_state(layers[0][2])  # the H2O layers are alike
        _, _, kv_heads, head_size = views.keys.shape
        whole = []
        for name, group, cache in self.whole_caches:
            page = self.whole_groups[group][1].kv_cache_spec.page_size_bytes
            if cache[0].numel() * cache.element_size() != page:  # the scheduler reserves staging by the spec
                raise RuntimeError(f"{NIXL_NAME}: a block of {name} holds {cache[0].numel() * cache.element_size()} "
                                   f"bytes where its KV-cache spec says {page}")
            whole.append((name, group, tuple(cache.shape[1:]), cache.dtype))
        self.layout = StateLayout(tuple(layer[0] for layer in layers), kv_heads, head_size, views.keys.dtype,
                                  tuple(whole))
        rank = _rank()
        name = f"h2o-{self._kv_transfer_config.engine_id}-dp{self._vllm_config.parallel_config.data_parallel_index}-tp{rank}"
        timeout = float(self._kv_transfer_config.get_from_extra_config(TIMEOUT_S, TIMEOUT_S_DEFAULT))
        self.nixl = NixlTransport(name, self._staging_bytes(), rank, timeout)

    def get_handshake_metadata(self) -> H2ONixlHandshake | None:
        return H2ONixlHandshake(self.nixl.peer) if self.nixl is not None else None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        orders = self._get_connector_metadata().orders
        for req_id in orders.forgets:
            self.nixl.forget(req_id)
        for fetch in orders.fetches:
            self.nixl.fetch(fetch)
        super().start_load_kv(forward_context, **kwargs)

    def build_connector_worker_meta(self) -> H2OTransferReport | None:
        report = self.nixl.poll() if self.nixl is not None else None
        return H2OTransferReport(report) if report else None

    def _write(self, move: KVMove, tensors: dict[str, torch.Tensor]) -> int:
        from h2o_vllm.packed_state import PARTS
        return self.nixl.stage(move, [{part: tensors[f"{name}.{part}"] for part in PARTS}
                                      for name in self.layout.names],
                               [tensors[f"{name}.blocks"] for name, _, _, _ in self.layout.whole])

    def _read(self, move: KVMove) -> dict[str, torch.Tensor]:
        return self.nixl.take(move, self.layout)

    def shutdown(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()
