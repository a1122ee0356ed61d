"""ScoreRecords: the scheduler's index of the H2O score records kept beside the prefix cache.

Runs in the engine-core process; the workers hold the records' contents (``worker/prefix_records.py``)
and do what ``PrefixOrders`` tells them. Never touches a tensor.

Why records: H2O's scores include the attention the prompt's own queries paid to earlier
prompt tokens. On a cache hit of ``H`` tokens those queries are not recomputed, so the hitting
request needs, for every token ``t < H``, the score ``s_H(t)`` that the queries ``0..H-1``
gave it. Attention is causal, so ``s_H`` depends on the first ``H`` tokens alone (and on the
score modes that shape it, ``ScoreMode.record_key``): it can be recorded once and reused.

A record of boundary ``H`` (a multiple of the block size) is ``H`` fp32 scores per (layer, KV
head), kept in ``H / block_size`` record slots of a pool as large as the KV block pool: at most
one fp32 per KV token slot per (layer, KV head), i.e. ``2 / (head_size * kv_dtype_bytes)`` of
the KV memory (0.8% for head 128 in bf16). A hit is cut back to the longest boundary that has a
record; a request records the boundaries it could not hit (its longest match, its prompt's last
block boundary), so the next request with the same prefix hits exactly. The pool is shared LRU:
a record used or written moves to the back; when a new one needs slots, records that never
served a hit are evicted first, then the others, each from the front.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable


@dataclass(eq=False)
class Record:
    key: Hashable           # (hash of the boundary block, the score modes that shaped it)
    num_blocks: int         # boundary, in KV blocks
    slots: list[int]        # record-pool slot of each KV block of the prefix, in order
    ready: bool = False     # written by a finished step: hits may use it
    hits: int = 0           # hits it has served
    writer: str | None = field(default=None)  # request that writes it, while pending


class ScoreRecords:
    """Record slots and the records that hold them, keyed by boundary."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._index: OrderedDict[Hashable, Record] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._index)

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self._free)

    def has(self, key: Hashable) -> bool:
        """A record for ``key`` exists, written or pending."""
        return key in self._index

    def pending(self, key: Hashable) -> bool:
        """A record for ``key`` is reserved and its writer's step has not run yet."""
        record = self._index.get(key)
        return record is not None and not record.ready

    def ready(self, key: Hashable) -> Record | None:
        """The written record of ``key``, marked as just used; None if there is none yet."""
        record = self._index.get(key)
        if record is None or not record.ready:
            return None
        record.hits += 1
        self._index.move_to_end(key)
        return record

    def reserve(self, key: Hashable, num_blocks: int, writer: str) -> Record | None:
        """Slots for a new record of ``key`` that ``writer`` will write; evicts written records
        to make room, those that never served a hit first, each kind least recently used
        first. None if the pool cannot hold it (then nothing is evicted)."""
        assert key not in self._index
        if num_blocks <= 0:
            return None
        evictable = sum(len(r.slots) for r in self._index.values() if r.ready)
        if len(self._free) + evictable < num_blocks:
            return None
        while len(self._free) < num_blocks:
            # A prompt's own boundary is recorded for a repeat that may never come; a shared
            # prefix that served hits is likely to serve more.
            victim = next((k for k, r in self._index.items() if r.ready and not r.hits), None)
            if victim is None:  # not `or`: a key may be falsy (0 in the property test)
                victim = next(k for k, r in self._index.items() if r.ready)
            self._release(victim)
        slots = [self._free.pop() for _ in range(num_blocks)]
        record = self._index[key] = Record(key, num_blocks, slots, writer=writer)
        return record

    def commit(self, record: Record) -> None:
        """Its writer's step has run: hits may use it."""
        if self._index.get(record.key) is record:
            record.ready, record.writer = True, None
            self._index.move_to_end(record.key)

    def drop(self, record: Record) -> None:
        """A pending record whose writer stopped (finished, aborted or preempted) before it."""
        if self._index.get(record.key) is record:
            self._release(record.key)

    def _release(self, key: Hashable) -> None:
        record = self._index.pop(key)
        self._free.extend(reversed(record.slots))
