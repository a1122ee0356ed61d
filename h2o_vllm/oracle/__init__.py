"""The dense H2O oracle: a Hugging Face causal LM plus plain torch, no vLLM.

The independent side of every token-for-token test (docs/semantics.md, "What H2O is, precisely"):
it imports ``h2o_vllm.config``, each score mode's oracle rule (``ScoreMode.oracle_*``, written
apart from the engine's vectorised rule in the same class) and torch only (the model is a
Hugging Face module), never ``policy``, ``worker`` or vLLM. It honours every field of
``Budget``: heavy, recent (with the ``min_tokens`` floor), interval, sinks and the score modes;
with the paper's defaults its arithmetic is the plain H2O sum (see ``H2OOracle``).

    ref = H2OOracle(model, H2OConfig(heavy_ratio=0.1, recent_ratio=0.1), block_size=16)
    tokens = ref.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)
    ref.last_states[0].layers[0].positions   # [num_kv_heads, kv_len] kept logical positions
    logprobs = ref.score(prompt, continuation)
"""
from h2o_vllm.oracle.cache import LayerCache, SequenceState
from h2o_vllm.oracle.model import H2OOracle, generate_each
from h2o_vllm.oracle.stored_kv import FP8_E4M3, FP8_E4M3_CPU, StoredKV

__all__ = ["FP8_E4M3", "FP8_E4M3_CPU", "H2OOracle", "generate_each", "LayerCache", "SequenceState", "StoredKV"]
