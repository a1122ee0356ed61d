"""Staging: the producer's NIXL staging space, handed out by the scheduler.

Pure (stdlib only). Every tensor-parallel rank of a producer has a staging buffer of the same
size, registered with NIXL once; a prompt's state is packed by every rank at the same
offset (ranks hold equal shares of the KV heads, so equal bytes), which the scheduler picks
here when it orders the save and names in the request's ``kv_transfer_params`` when the
request finishes. Space comes back when every rank of the consumer has read it (each read
ends with a NIXL notification to the producer's rank it read from), or when it was never
read within ``ttl_s`` after the request finished (``kv_lease_duration``, the key vLLM's NIXL
connector frees unread blocks by). Tickets are never reused: a late
notification for a space already given back releases nothing.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Reservation:
    ticket: int
    offset: int
    nbytes: int
    expires: float | None = None  # set when the request finishes with a state to read
    read_by: set[int] = field(default_factory=set)  # consumer ranks that have read it


class Staging:
    def __init__(self, capacity: int, world_size: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.world_size, self.ttl_s, self.clock = capacity, world_size, ttl_s, clock
        self.held: dict[int, Reservation] = {}
        self._next_ticket = 1
        self.num_expired = 0

    def reserve(self, nbytes: int) -> Reservation | None:
        """The lowest free run of ``nbytes`` (first fit), or None when none is free."""
        self.expire()
        at = 0
        for r in sorted(self.held.values(), key=lambda r: r.offset):
            if r.offset - at >= nbytes:
                break
            at = max(at, r.offset + r.nbytes)
        if at + nbytes > self.capacity:
            return None
        reservation = Reservation(self._next_ticket, at, nbytes)
        self._next_ticket += 1
        self.held[reservation.ticket] = reservation
        return reservation

    def commit(self, ticket: int) -> Reservation:
        """The state is complete and named to a client: its reader has ``ttl_s`` to read it."""
        reservation = self.held[ticket]
        reservation.expires = self.clock() + self.ttl_s
        return reservation

    def read(self, ticket: int, rank: int) -> None:
        """Consumer rank ``rank`` has read ``ticket``: given back once every rank has."""
        reservation = self.held.get(ticket)
        if reservation is None:
            return
        reservation.read_by.add(rank)
        if len(reservation.read_by) >= self.world_size:
            del self.held[ticket]

    def drop(self, ticket: int) -> None:
        """A state that will never be named (its request ended without a first token)."""
        self.held.pop(ticket, None)

    def expire(self) -> None:
        now = self.clock()
        for ticket in [t for t, r in self.held.items() if r.expires is not None and r.expires <= now]:
            del self.held[ticket]
            self.num_expired += 1

    @property
    def used(self) -> int:
        return sum(r.nbytes for r in self.held.values())
