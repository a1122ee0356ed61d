"""TransferOrders: what the scheduler tells the workers, per step, about KV transfer, and
TransferReport: what the workers tell it back.

Pure data (stdlib only), built by ``kv_transfer.transfer_scheduler.TransferScheduler.orders`` in the
engine-core process and carried to every worker inside H2O's KV-connector metadata
(``kv_transfer.connector``); read by the runner hooks (prompt lengths) and by
``kv_transfer.save_load`` (loads and saves). Fetches and reports are NIXL's
(``kv_transfer.nixl_transport``): a state read from the producer's staging space before the
scheduler lets the request load it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVMove:
    """One request's live KV positions ``[0, kv_len)`` in ``block_ids`` (each H2O group's
    blocks, in order: vLLM splits a target into several beside a drafter with fewer layers),
    to or from the stored state ``key``; and the blocks of each whole group (a speculative
    drafter's own layers, every position kept) that hold the prompt."""
    req_id: str
    key: str
    block_ids: tuple[tuple[int, ...], ...]
    kv_len: int
    whole: tuple[tuple[int, ...], ...] = ()
    #: Where the state sits in the producer's NIXL staging space (0 on shared storage).
    ticket: int = 0
    offset: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class NixlPeer:
    """One worker rank's NIXL agent and its registered staging buffer."""
    agent: str
    metadata: str  # the agent's NIXL metadata (base64): how to reach it and its buffer's keys
    base: int      # the staging buffer's address in that rank's process


@dataclass(frozen=True)
class KVFetch:
    """Read a producer's packed state (``peers[rank]``, ``offset`` .. ``+ nbytes``) into this
    worker's memory, for the consumer request ``req_id`` to load once every rank has it."""
    req_id: str
    key: str
    ticket: int
    offset: int
    nbytes: int
    peers: tuple[NixlPeer, ...]


@dataclass
class TransferOrders:
    #: Requests of this step whose H2O prompt is shorter than vLLM's: a consumer's request is
    #: the producer's prompt plus the producer's first token, and H2O runs it as the producer's
    #: request continued (docs/kv-transfer.md). Sent every step the request is scheduled.
    prompt_lens: dict[str, int] = field(default_factory=dict)
    #: States to load into a request's blocks before this step's forward.
    loads: list[KVMove] = field(default_factory=list)
    #: States to save once this step's forward (and the prompt's compaction) is done.
    saves: list[KVMove] = field(default_factory=list)
    #: NIXL reads to start, and fetched states no request will load (drop them).
    fetches: list[KVFetch] = field(default_factory=list)
    forgets: list[str] = field(default_factory=list)


@dataclass
class TransferReport:
    """A step's news from the workers, merged over ranks: each rank's finished fetches
    (None, or why it failed) and, on a producer, the staging tickets a consumer rank read."""
    fetched: dict[str, dict[int, str | None]] = field(default_factory=dict)
    read: list[tuple[int, int]] = field(default_factory=list)  # (ticket, rank)

    def merge(self, other: "TransferReport") -> "TransferReport":
        for req_id, results in other.fetched.items():
            self.fetched.setdefault(req_id, {}).update(results)
        self.read.extend(other.read)
        return self

    def __bool__(self) -> bool:
        return bool(self.fetched or self.read)
