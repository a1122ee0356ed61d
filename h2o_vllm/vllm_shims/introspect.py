"""Read-only views of an offline engine's internals, for the tools around the plugin.

Why these touches exist: the demo, the benchmarks and the GPU load check run vLLM's engine core
in their own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and measure what H2O changes, the KV
blocks a run holds and the preemptions it suffers, between steps; vLLM has no public API for
either. A profile also times vLLM's CPU attention methods by name. The plugin's runtime never
calls this module.

Each vLLM symbol named here is in ``SYMBOLS`` and looked up with ``seam._require``, so an
unsupported vLLM fails naming the symbol and the supported range (``seam.SUPPORTED_VLLM``);
``tests/unit/vllm_shims/test_introspect.py`` records their signatures and every instance
attribute read here, and fails when vLLM renames one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from h2o_vllm.vllm_shims.symbols import _require

#: Every vLLM symbol this module looks up ("module:Qual.name").
SYMBOLS = {
    "in_process_client": "vllm.v1.engine.core_client:InprocClient",
    "preempt_request": "vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
    "get_new_blocks": "vllm.v1.core.block_pool:BlockPool.get_new_blocks",
    "sliding_window_spec": "vllm.v1.kv_cache_interface:SlidingWindowSpec",
    "cpu_attention_impl": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl",
}


def in_process_scheduler(llm_engine) -> Any:
    """The scheduler of an ``LLMEngine`` (``LLM.llm_engine``) whose engine core runs in this
    process; a ``RuntimeError`` for an engine core in another process."""
    _, client_class = _require(SYMBOLS["in_process_client"])
    client = llm_engine.engine_core
    if not isinstance(client, client_class):
        raise RuntimeError(f"needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (an in-process engine core); "
                           f"this engine's core client is {type(client).__name__}")
    return client.engine_core.scheduler


def block_pool(scheduler) -> Any:
    """The scheduler's KV ``BlockPool`` (``get_num_free_blocks()``, ``num_gpu_blocks``)."""
    return scheduler.kv_cache_manager.block_pool


def held_blocks_by_kind(scheduler) -> dict[str, int]:
    """Blocks the scheduler's requests hold, by the attention of their KV-cache group:
    "global" (full attention: H2O's) and, for a hybrid model, "sliding" (vLLM's window). A
    block is the same memory in every group (vLLM pages them uniformly), so the split is the
    KV memory's. The null blocks standing for a window's dropped past hold nothing."""
    _, sliding = _require(SYMBOLS["sliding_window_spec"])
    held: dict[str, int] = {}
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        kind = "sliding" if isinstance(manager.kv_cache_spec, sliding) else "global"
        held[kind] = held.get(kind, 0) + sum(
            not block.is_null for blocks in manager.req_to_blocks.values() for block in blocks)
    return held


def count_preemptions(scheduler) -> Callable[[], int]:
    """Count this scheduler's preemptions from now on; returns the reader of the count.

    Wraps the instance's ``Scheduler._preempt_request``, through which vLLM preempts every
    request (its own counter, ``vllm:num_preemptions``, counts only with stats logging on)."""
    _require(SYMBOLS["preempt_request"])
    original = scheduler._preempt_request
    count = 0

    def counting_preempt(*args, **kwargs):
        nonlocal count
        count += 1
        return original(*args, **kwargs)

    scheduler._preempt_request = counting_preempt
    return lambda: count


@contextlib.contextmanager
def after_each_allocation(pool, callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback()`` right after each ``BlockPool.get_new_blocks`` of ``pool`` (a step's
    in-flight peak, before the compactions it ends with free blocks), while inside."""
    _require(SYMBOLS["get_new_blocks"])
    original = pool.get_new_blocks

    def get_new_blocks(*args, **kwargs):
        blocks = original(*args, **kwargs)
        callback()
        return blocks

    pool.get_new_blocks = get_new_blocks
    try:
        yield
    finally:
        del pool.get_new_blocks  # the class's method again


def cpu_attention_impl() -> type:
    """vLLM's CPU attention implementation class: its ``forward`` (the attention kernel) and
    ``do_kv_cache_update`` (the K/V write) are what a profile times as vLLM's own."""
    return _require(SYMBOLS["cpu_attention_impl"])[1]
