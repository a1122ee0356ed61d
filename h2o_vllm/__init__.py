"""h2o-vllm: H2O (Heavy-Hitter Oracle) KV-cache eviction for stock vLLM's paged KV cache.

Importing this package imports no vLLM: the plugin entry point is ``h2o_vllm.plugin:register``.
"""
from h2o_vllm.config import H2OConfig

__version__ = "0.1.0"
__all__ = ["H2OConfig", "__version__"]
