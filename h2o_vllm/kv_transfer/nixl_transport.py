"""NixlTransport: a worker rank's NIXL agent, carrying H2O's state between engines.

Runs in the worker process; imports no vLLM, and ``nixl`` only when built. Each rank has one
agent (UCX) and one staging buffer in host memory, registered once. Its NIXL metadata (a few
hundred bytes: how to reach it, its buffer's keys) travels in the request's
``kv_transfer_params``, so a decoder needs no connection to a listener first: a NIXL
listener thread of a producer pinned beside vLLM's busy OpenMP threads was found to leave
decoders waiting for metadata for tens of seconds. A producer rank packs a finished prompt's state into its buffer at the
offset the scheduler reserved (``packed_state``); a consumer rank reads it with one NIXL
READ from the producer rank of the same index, checks both seals, and keeps the bytes until
the request's load writes them into the paged cache (``kv_transfer.save_load.load``). The READ
carries a notification that tells the producer rank its space was read
(``TransferReport.read``); the consumer reports each fetch's end the same way
(``TransferReport.fetched``).

Why host staging and not the paged cache itself, as vLLM's NIXL connector reads it: the
producer's blocks go back to vLLM's pool the moment its request finishes (what H2O kept is a
fifth of a prompt, packed in one run), and the scores, which vLLM's cache does not hold,
travel in the same run.
"""
from __future__ import annotations

import base64
import contextlib
import os
import time
from dataclasses import dataclass

import torch

from h2o_vllm.kv_transfer.orders import KVFetch, KVMove, NixlPeer, TransferReport
from h2o_vllm.kv_transfer.packed_state import SEAL, pack, seal, unpack

READ_MARK = b"h2o-read:"


@dataclass
class StateLayout:
    """The H2O layers of this rank (name order) and the shape of their cached K/V; and the
    whole layers (a speculative drafter's own, name order): (name, group index in
    ``KVMove.whole``, a block's shape, dtype)."""
    names: tuple[str, ...]
    kv_heads: int
    head_size: int
    dtype: torch.dtype
    whole: tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...] = ()


@dataclass
class _Read:
    fetch: KVFetch
    peer: NixlPeer
    buffer: torch.Tensor
    registered: object
    deadline: float
    handle: object = None
    forgotten: bool = False


@contextlib.contextmanager
def _on_spare_cores():
    """Threads started here run on the cores this thread is not pinned to. NIXL's threads
    (UCX's, which serve reads and notifications) inherit the CPU set of the thread that starts
    them, and vLLM's CPU worker pins its main thread to its OpenMP cores, which its runtime
    keeps busy; vLLM reserves other cores for a connector's threads
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``)."""
    pinned = os.sched_getaffinity(0)
    spare = set(range(os.cpu_count() or 1)) - pinned
    moved = False
    for cores in (spare, spare | pinned):
        if cores and cores != pinned:
            try:
                os.sched_setaffinity(0, cores)
                moved = True
                break
            except OSError:  # cores outside this container's set
                continue
    try:
        yield
    finally:
        if moved:
            os.sched_setaffinity(0, pinned)


class NixlTransport:
    def __init__(self, name: str, staging_bytes: int, rank: int, timeout_s: float = 30.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # optional: the nixl extra
        with _on_spare_cores():
            self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8)  # pages committed as states land
        self._registered = self.agent.register_memory(self.agent.get_reg_descs(self.staging))
        metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.peer = NixlPeer(name, metadata, self.staging.data_ptr())
        self.rank, self.timeout_s = rank, timeout_s
        self.reads: dict[str, _Read] = {}
        self.fetched: dict[str, tuple[torch.Tensor, KVFetch]] = {}
        self._known: set[str] = set()  # remote agents added from their metadata
        self._report = TransferReport()

    # Producer.

    def stage(self, move: KVMove, layers: list[dict[str, torch.Tensor]], blocks: list[torch.Tensor] = ()) -> int:
        """Pack ``move``'s state (its layers in name order, then its whole layers' blocks) at
        its reserved offset."""
        written = pack(self.staging[move.offset:move.offset + move.nbytes], move.key, move.ticket, layers, blocks)
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
        read = _Read(fetch, peer, buffer, registered, time.monotonic() + self.timeout_s)
        self.reads[fetch.req_id] = read
        try:
            if peer.agent not in self._known:
                self.agent.add_remote_agent(base64.b64decode(peer.metadata))
                self._known.add(peer.agent)
            self._start(read)
        except Exception as e:  # nixl's own errors: metadata it cannot use, a peer it cannot reach
            self._end(fetch.req_id, f"NIXL could not read from {peer.agent}: {e}")

    def forget(self, req_id: str) -> None:
        """No request will load ``req_id``'s state: drop it (once its read has ended)."""
        self.fetched.pop(req_id, None)
        read = self.reads.get(req_id)
        if read is not None:
            read.forgotten = True

    def take(self, move: KVMove, layout: StateLayout) -> dict[str, torch.Tensor]:
        """The fetched state that ``move`` loads, as ``kv_transfer.save_load.load`` takes it."""
        buffer, fetch = self.fetched.pop(move.req_id)
        blocks = [(name, (len(move.whole[group]), *shape), dtype) for name, group, shape, dtype in layout.whole]
        state = unpack(buffer, fetch.key, fetch.ticket, layout.names, move.kv_len, layout.kv_heads,
                       layout.head_size, layout.dtype, blocks)
        return {f"{name}.{part}": t for name, parts in state.items() for part, t in parts.items()}

    def poll(self) -> TransferReport:
        """Advance the reads, collect the producer's notifications; the news since the last poll."""
        for req_id, read in list(self.reads.items()):
            state = self.agent.check_xfer_state(read.handle)
            if state == "DONE":
                whole = read.buffer[:SEAL], read.buffer[-SEAL:]
                mark = seal(read.fetch.key, read.fetch.ticket)
                ok = torch.equal(whole[0], mark) and torch.equal(whole[1], mark)
                self._end(req_id, None if ok else "the bytes read are not the state named (the producer "
                                                  "released or reused its staging space first)")
            elif state == "ERR":
                self._end(req_id, f"NIXL reported an error reading from {read.peer.agent}")
            elif time.monotonic() > read.deadline:
                self._end(req_id, f"the read from {read.peer.agent} did not finish within {self.timeout_s:g} s")
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
        read.handle = self.agent.initialize_xfer("READ", local, remote, read.peer.agent, notice)
        if self.agent.transfer(read.handle) == "ERR":
            raise RuntimeError("the transfer did not start")

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
