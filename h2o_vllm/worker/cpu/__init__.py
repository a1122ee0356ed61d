"""The CPU implementation: vLLM's CPU attention, torch score accumulation and compaction."""
