"""PrefixOrders: what the scheduler tells the workers, per step, about the prefix cache.

Pure data (stdlib only), built by ``scheduler.prefix_hits.prefix_orders`` in the engine-core process
and carried to every worker on vLLM's ``SchedulerOutput`` (``vllm_hooks.engine_core``), read by
``worker.prefix_records``. The K/V of a hit is copied by vLLM itself (its copy-on-write pairs,
``SchedulerOutput.kv_cache_block_copies``); these orders add what only H2O needs:

- ``score_inits``: (block, record slot) for each block a hit was copied into: its scores start
  as the record's (slot -1: zeros, for a request whose observation window starts past the hit).
- ``record_writes``: (request, boundary tokens, record slots): once the request's queries before
  the boundary have been scored, its scores of KV positions ``[0, boundary)`` are recorded.
- ``fresh_blocks``: request -> the blocks its first compaction writes into, so that the blocks
  the prefix cache indexes are never rewritten (the request's row becomes these blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: The attribute of vLLM's ``SchedulerOutput`` that carries a step's orders: {KV-cache group
#: id: PrefixOrders} for each H2O group with any.
ATTRIBUTE = "h2o_prefix"


@dataclass
class PrefixOrders:
    score_inits: list[tuple[int, int]] = field(default_factory=list)
    record_writes: list[tuple[str, int, list[int]]] = field(default_factory=list)
    fresh_blocks: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.score_inits or self.record_writes or self.fresh_blocks)
