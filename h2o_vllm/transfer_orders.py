"""TransferOrders: what the scheduler tells the workers, per step, about KV transfer.

Pure data (stdlib only), built by ``scheduler.transfer.TransferScheduler.orders`` in the
engine-core process and carried to every worker inside H2O's KV-connector metadata
(``vllm_hooks.connector``); read by the runner hooks (prompt lengths) and by
``worker.transfer`` (loads and saves).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVMove:
    """One request's live KV positions ``[0, kv_len)`` in ``block_ids`` (its H2O group's
    blocks, in order), to or from the stored state ``key``."""
    req_id: str
    key: str
    block_ids: tuple[int, ...]
    kv_len: int


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
