"""Worker side of H2O: KV-space metadata, K/V writes, score accumulation, compaction."""
