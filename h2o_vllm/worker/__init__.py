"""Worker side of H2O: the step plan, KV-space metadata, K/V writes, scores and compaction.

``plan`` and ``step`` are written once for both devices; ``cpu/`` and ``cuda/`` supply only
their attention backend and ``DeviceOps`` (cache views, score accumulation, compaction).
"""
