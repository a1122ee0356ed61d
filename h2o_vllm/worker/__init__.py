"""Worker side of H2O: KV-space metadata, K/V writes, score accumulation, compaction."""

import logging

_announced: set[str] = set()


def announce_backend(backend: str, how: str) -> None:
    """One INFO line per worker process naming the H2O attention backend it runs (vLLM's
    handlers print the ``vllm.`` loggers)."""
    if backend not in _announced:
        _announced.add(backend)
        logging.getLogger("vllm.h2o_vllm").info("h2o: attention backend %s (%s)", backend, how)
