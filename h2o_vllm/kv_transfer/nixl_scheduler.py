"""NixlTransferScheduler: the scheduler's side of moving H2O's state over NIXL.

The protocol is ``TransferScheduler``'s (docs/kv-transfer.md); only the medium differs. The
producer packs a prompt's state into staging space it reserves at the save
(``kv_transfer.staging``), and names it (each rank's NIXL agent and buffer, the offset, the
ticket) in the request's ``kv_transfer_params``; vLLM's disaggregation proxy hands those to
the decoder, as it does for vLLM's own NIXL connector. The decoder's workers read the state
before the request is admitted (``KVFetch``; vLLM asks again each step while it is on its
way), and the request loads it from there like a stored one; a read that fails (the
producer gone, its space released) computes the prompt here instead, exactly.

Only requests sent for remote decode (``do_remote_decode`` in their ``kv_transfer_params``,
as the proxy sends them) save: a plain request on a ``kv_both`` engine holds no staging.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from h2o_vllm import metrics
from h2o_vllm.config import H2OConfig
from h2o_vllm.kv_transfer.orders import KVFetch, KVMove, NixlPeer, TransferOrders, TransferReport
from h2o_vllm.kv_transfer.packed_state import packed_nbytes
from h2o_vllm.kv_transfer.staging import Staging
from h2o_vllm.kv_transfer.store import StoredPrompt
from h2o_vllm.kv_transfer.transfer_scheduler import PENDING, TransferScheduler, WholeGroup

logger = logging.getLogger("vllm.h2o_vllm")

PARAMS = "h2o_nixl"


@dataclass(frozen=True)
class StateShape:
    """What one rank's packed state is made of: the H2O layers' count and per-rank KV heads,
    the head size and the cache's bytes per element, and a block's bytes in each whole group
    (all its layers: a speculative drafter's own), read from the KV-cache spec."""
    num_layers: int
    kv_heads: int
    head_size: int
    itemsize: int
    whole_block_nbytes: tuple[int, ...] = ()

    def nbytes(self, kv_len: int, whole: tuple[tuple[int, ...], ...] = ()) -> int:
        blocks = sum(len(ids) * n for ids, n in zip(whole, self.whole_block_nbytes, strict=True))
        return packed_nbytes(self.num_layers, kv_len, self.kv_heads, self.head_size, self.itemsize) + blocks


class NixlTransferScheduler(TransferScheduler):
    def __init__(self, staging: Staging, shape: StateShape, config: H2OConfig, block_size: int,
                 world_size: int, produces: bool, consumes: bool, whole: tuple[WholeGroup, ...] = ()) -> None:
        super().__init__(None, config, block_size, world_size, produces, consumes, whole)
        self.staging, self.shape = staging, shape
        self.peers: tuple[NixlPeer, ...] = ()           # this engine's ranks, from the handshake
        self.named: dict[str, tuple[str, StoredPrompt, dict]] = {}  # consumer request -> its params
        self.fetching: dict[str, dict[int, str | None]] = {}  # consumer request -> ranks' results
        self.fetches: list[KVFetch] = []
        self.forgets: list[str] = []
        self.tickets: dict[str, int] = {}                # producer request -> its reservation
        self.num_unstaged = 0

    # The medium's hooks.

    def _committed(self, req_id: str, key: str, kv_params: dict | None = None) -> StoredPrompt | None:
        if kv_params is not None:  # the decoder's request, as vLLM's proxy sends it
            try:  # a client's params: anything malformed is no state (the prompt is computed here)
                where = kv_params[PARAMS]
                peers = tuple(NixlPeer(str(agent), str(metadata), int(base)) for agent, metadata, base in where["peers"])
                where = {"ticket": int(where["ticket"]), "offset": int(where["offset"]),
                         "nbytes": int(where["nbytes"]), "peers": peers}
                stored = StoredPrompt(prompt_len=int(kv_params["h2o_prompt_tokens"]),
                                      first_token=int(kv_params["h2o_first_token"]),
                                      kv_len=int(kv_params["h2o_kv_tokens"]), world_size=len(peers))
            except (KeyError, TypeError, ValueError):
                return None
            self.named[req_id] = (key, stored, where)
            return stored
        found = self.named.get(req_id)
        return found[1] if found is not None and found[0] == key else None

    def _readiness(self, req_id: str, key: str, stored: StoredPrompt):
        flaw = self._world_flaw(stored)
        if flaw is not None:
            return flaw
        results = self.fetching.get(req_id)
        if results is None and req_id not in self.named:
            return "it gave up its read earlier (a local prefix hit first)"
        if results is None:
            _, _, where = self.named[req_id]
            self.fetching[req_id] = {}
            self.fetches.append(KVFetch(req_id, key, where["ticket"], where["offset"], where["nbytes"], where["peers"]))
            return PENDING
        errors = [f"rank {rank}: {error}" for rank, error in sorted(results.items()) if error]
        if errors:
            return "the NIXL read failed (" + "; ".join(errors) + ")"
        return PENDING if len(results) < self.world_size else None

    def _staged(self, request, move: KVMove) -> KVMove | None:
        if not (request.kv_transfer_params or {}).get("do_remote_decode"):
            return None
        nbytes = self.shape.nbytes(move.kv_len, move.whole)
        reservation = self.staging.reserve(nbytes)
        if reservation is None:
            self.num_unstaged += 1
            logger.warning("h2o: request %s's state (%d bytes) does not fit the NIXL staging space "
                           "(%d of %d bytes held): the decoder will compute its prompt itself; raise "
                           "kv_connector_extra_config.h2o_staging_mib", request.request_id, nbytes,
                           self.staging.used, self.staging.capacity)
            return None
        self.tickets[request.request_id] = reservation.ticket
        return dataclasses.replace(move, ticket=reservation.ticket, offset=reservation.offset, nbytes=nbytes)

    def _commit(self, req_id: str, key: str, stored: StoredPrompt) -> dict:
        reservation = self.staging.commit(self.tickets.pop(req_id))
        return {PARAMS: {"ticket": reservation.ticket, "offset": reservation.offset, "nbytes": reservation.nbytes,
                         "peers": [[p.agent, p.metadata, p.base] for p in self.peers]}}

    def _forget(self, req_id: str) -> None:
        ticket = self.tickets.pop(req_id, None)
        if ticket is not None:
            self.staging.drop(ticket)  # saved, never named: its request ended without a first token
        self.named.pop(req_id, None)
        if self.fetching.pop(req_id, None) is not None:
            self.forgets.append(req_id)

    # NIXL's own.

    def allocated(self, request, block_ids, num_external_tokens: int, whole_ids=()) -> None:
        super().allocated(request, block_ids, num_external_tokens, whole_ids)
        if any(move.req_id == request.request_id for move in self.loads):
            self.fetching.pop(request.request_id, None)  # the load takes the fetched bytes

    def orders(self, scheduler_output, requests, managers, whole_ids=lambda rid: ()) -> TransferOrders:
        orders = super().orders(scheduler_output, requests, managers, whole_ids)
        orders.fetches, self.fetches = self.fetches, []
        orders.forgets, self.forgets = self.forgets, []
        metrics.recorder().set(kv_transfer_staging_bytes=self.staging.used)
        return orders

    def update(self, report: TransferReport) -> None:
        """The workers' news of a step: fetches done, staging read by a consumer. (An idle
        producer hears of reads at its next step; it only needs the space then.)"""
        for req_id, results in report.fetched.items():
            if req_id in self.fetching:
                self.fetching[req_id].update(results)
        for ticket, rank in report.read:
            self.staging.read(ticket, rank)
        self.staging.expire()
        metrics.recorder().set(kv_transfer_staging_bytes=self.staging.used)
