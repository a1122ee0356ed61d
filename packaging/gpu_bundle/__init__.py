"""The GPU bundle (vLLM without a network, for the GPU machine) and the GPU check's helpers.

Packaging, not runtime and not in the wheel: nothing in ``h2o_vllm`` imports it. ``packaging/``
goes on ``sys.path`` (``benchmarks/gpu_check.sh`` and the tests do that), so these import as
``gpu_bundle.<module>``.
"""
