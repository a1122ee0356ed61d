"""The CUDA implementation: vLLM's Triton attention, H2O's Triton score and compaction kernels."""
