"""H2O's NIXL connector: each rank reads its share of a prompt's H2O state from the producer's
staging memory (``kv_transfer.nixl_scheduler``, ``kv_transfer.nixl_transport``), on
``NixlConnector``'s settings (``{"kv_connector": "NixlConnector", "kv_role": "kv_both"}``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata, KVConnectorRole,
                                                               KVConnectorWorkerMetadata)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from h2o_vllm.kv_transfer.connector import H2OConnector
from h2o_vllm.kv_transfer.nixl_scheduler import NixlTransferScheduler, StateShape
from h2o_vllm.kv_transfer.nixl_transport import NixlTransport, StateLayout
from h2o_vllm.kv_transfer.orders import KVMove, NixlPeer, TransferReport
from h2o_vllm.kv_transfer.packed_state import PARTS
from h2o_vllm.kv_transfer.staging import Staging
from h2o_vllm.kv_transfer.transfer_config import H2O_NIXL_CONNECTOR

NIXL_NAME = H2O_NIXL_CONNECTOR


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
    (``kv_transfer.nixl_scheduler``, ``kv_transfer.nixl_transport``), on ``NixlConnector``'s settings."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        self.nixl = None
        self.layout = None
        super().__init__(vllm_config, role, kv_cache_config)

    def _staging_bytes(self) -> int:
        return int(float(self._kv_transfer_config.get_from_extra_config(STAGING_MIB, STAGING_MIB_DEFAULT)) * 2**20)

    def _make_transfer(self, config, common: dict):
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
        rank = get_tensor_model_parallel_rank()
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
        return self.nixl.stage(move, [{part: tensors[f"{name}.{part}"] for part in PARTS}
                                      for name in self.layout.names],
                               [tensors[f"{name}.blocks"] for name, _, _, _ in self.layout.whole])

    def _read(self, move: KVMove) -> dict[str, torch.Tensor]:
        return self.nixl.take(move, self.layout)

    def shutdown(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
