"""The GPU bundle (vLLM without a network, for the GPU machine) and the GPU check's helpers.

Tooling, not runtime: nothing in ``h2o_vllm`` imports it. ``benchmarks/`` goes on ``sys.path``
(``gpu_check.sh`` and the tests do that), so these import as ``gpu_bundle.<module>``.
"""
