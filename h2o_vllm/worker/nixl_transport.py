"""NixlTransport: a worker rank's NIXL agent, carrying H2O's state between engines.

Runs in the worker process; imports no vLLM, and ``nixl`` only when built. Each rank has one
agent (UCX) with a metadata listener on its own port, and one staging buffer in host memory,
registered once. A producer rank packs a finished prompt's state into its buffer at the
offset the scheduler reserved (``packed_state``); a consumer rank reads it with one NIXL
READ from the producer rank of the same index, checks both seals, and keeps the bytes until
the request's load writes them into the paged cache (``worker.transfer.load``). The READ
carries a notification that tells the producer rank its space was read
(``TransferReport.read``); the consumer reports each fetch's end the same way
(``TransferReport.fetched``).

Why host staging and not the paged cache itself, as vLLM's NIXL connector reads it: the
producer's blocks go back to vLLM's pool the moment its request finishes (what H2O kept is a
fifth of a prompt, packed in one run), and the scores, which vLLM's cache does not hold,
travel in the same run.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import torch

from h2o_vllm.packed_state import SEAL, pack, seal, unpack
from h2o_vllm.transfer_orders import KVFetch, KVMove, NixlPeer, TransferReport

READ_MARK = b"h2o-read:"


@dataclass
class StateLayout:
    """The H2O layers of this rank (name order) and the shape of their cached K/V."""
    names: tuple[str, ...]
    kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass
class _Read:
    fetch: KVFetch
    peer: NixlPeer
    buffer: torch.Tensor
    registered: object
    deadline: float
    handle: object = None
    forgotten: bool = False


class NixlTransport:
    def __init__(self, name: str, host: str, port: int, staging_bytes: int, rank: int,
                 metadata_timeout_s: float = 30.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config
        self.agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=True, listen_port=port,
                                                        backends=["UCX"]))
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        self._registered = self.agent.register_memory(self.agent.get_reg_descs(self.staging))
        self.peer = NixlPeer(name, host, port, self.staging.data_ptr())
        self.rank, self.metadata_timeout_s = rank, metadata_timeout_s
        self.reads: dict[str, _Read] = {}
        self.fetched: dict[str, tuple[torch.Tensor, KVFetch]] = {}
        self._asked: set[str] = set()  # remote agents whose metadata was asked for
        self._report = TransferReport()

    # Producer.

    def stage(self, move: KVMove, layers: list[dict[str, torch.Tensor]]) -> int:
        """Pack ``move``'s state (its layers in name order) at its reserved offset."""
        written = pack(self.staging[move.offset:move.offset + move.nbytes], move.key, move.ticket, layers)
        if written != move.nbytes:
            raise RuntimeError(f"h2o: the packed state of {move.req_id} has {written} bytes where the "
                               f"scheduler reserved {move.nbytes}: the KV-cache spec and the layers disagree")
        return written

    # Consumer.

    def fetch(self, fetch: KVFetch) -> None:
        """Start reading ``fetch`` from the producer rank of this rank's index."""
        peer = fetch.peers[self.rank]
        buffer = torch.empty(fetch.nbytes, dtype=torch.uint8)
        registered = self.agent.register_memory(self.agent.get_reg_descs(buffer))
        if peer.agent not in self._asked:
            try:  # NIXL's metadata client takes an IP address, not a host name
                address = socket.gethostbyname(peer.host)
            except OSError:
                address = peer.host  # the read then fails with the name in its reason
            self.agent.fetch_remote_metadata(peer.agent, address, peer.port)
            self._asked.add(peer.agent)
        self.reads[fetch.req_id] = _Read(fetch, peer, buffer, registered,
                                         time.monotonic() + self.metadata_timeout_s)

    def forget(self, req_id: str) -> None:
        """No request will load ``req_id``'s state: drop it (once its read has ended)."""
        self.fetched.pop(req_id, None)
        read = self.reads.get(req_id)
        if read is not None:
            read.forgotten = True

    def take(self, req_id: str, kv_len: int, layout: StateLayout) -> dict[str, torch.Tensor]:
        """The fetched state of ``req_id``, as ``worker.transfer.write_state`` takes it per layer."""
        buffer, fetch = self.fetched.pop(req_id)
        state = unpack(buffer, fetch.key, fetch.ticket, layout.names, kv_len, layout.kv_heads,
                       layout.head_size, layout.dtype)
        return {f"{name}.{part}": t for name, parts in state.items() for part, t in parts.items()}

    def poll(self) -> TransferReport:
        """Advance the reads, collect the producer's notifications; the news since the last poll."""
        for req_id, read in list(self.reads.items()):
            if read.handle is None:
                if not self.agent.check_remote_metadata(read.peer.agent):
                    if time.monotonic() > read.deadline:
                        self._asked.discard(read.peer.agent)
                        self._end(req_id, f"no NIXL metadata from {read.peer.agent} at "
                                          f"{read.peer.host}:{read.peer.port} within {self.metadata_timeout_s:g} s")
                    continue
                self._start(read)
                if read.handle is None:
                    self._end(req_id, f"NIXL could not start the read from {read.peer.agent}")
                    continue
            state = self.agent.check_xfer_state(read.handle)
            if state == "DONE":
                whole = read.buffer[:SEAL], read.buffer[-SEAL:]
                mark = seal(read.fetch.key, read.fetch.ticket)
                ok = torch.equal(whole[0], mark) and torch.equal(whole[1], mark)
                self._end(req_id, None if ok else "the bytes read are not the state named (the producer "
                                                  "released or reused its staging space first)")
            elif state == "ERR":
                self._end(req_id, f"NIXL reported an error reading from {read.peer.agent}")
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                if message.startswith(READ_MARK):
                    ticket, rank = message[len(READ_MARK):].decode().split(":")
                    self._report.read.append((int(ticket), int(rank)))
        report, self._report = self._report, TransferReport()
        return report

    def _start(self, read: _Read) -> None:
        n = read.fetch.nbytes
        local = self.agent.get_xfer_descs([(read.buffer.data_ptr(), n, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(read.peer.base + read.fetch.offset, n, 0)], "DRAM")
        notice = READ_MARK + f"{read.fetch.ticket}:{self.rank}".encode()
        try:
            read.handle = self.agent.initialize_xfer("READ", local, remote, read.peer.agent, notice)
            if self.agent.transfer(read.handle) == "ERR":
                self.agent.release_xfer_handle(read.handle)
                read.handle = None
        except Exception:  # nixl raises its own errors for an unreachable peer
            read.handle = None

    def _end(self, req_id: str, error: str | None) -> None:
        read = self.reads.pop(req_id)
        if read.handle is not None:
            self.agent.release_xfer_handle(read.handle)
        self.agent.deregister_memory(read.registered)
        if read.forgotten:
            return
        if error is None:
            self.fetched[req_id] = (read.buffer, read.fetch)
        self._report.fetched[req_id] = {self.rank: error}

    def close(self) -> None:
        for req_id in list(self.reads):
            self.reads[req_id].forgotten = True
            self._end(req_id, None)
        self.agent.deregister_memory(self._registered)
