"""Which KV-cache groups H2O's connectors move, read from vLLM's ``KVCacheConfig`` when a
connector is built (the engine has loaded the model and formed its groups; no request has
run): the one H2O group, whose kept state travels, and a speculative drafter's groups, which
H2O leaves whole and which travel as the blocks that hold the prompt. Anything else is
refused there, naming the way out.
"""
from __future__ import annotations

from typing import Any


def whole_groups(kv_cache_config) -> list[tuple[int, Any]]:
    """(index, group) of each KV-cache group H2O leaves whole: a speculative drafter's own
    layers (a hybrid model's window groups are refused beside a connector before load,
    ``frontend.kv_transfer_config.check_model``). Their prompt travels as whole blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from h2o_vllm.scheduler.spec import H2OAttentionSpec
    whole = [(g, group) for g, group in enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else ())
             if not isinstance(group.kv_cache_spec, H2OAttentionSpec)]
    for _, group in whole:
        if not isinstance(group.kv_cache_spec, FullAttentionSpec):
            raise ValueError(f"H2O's KV connector moves H2O's state and full-attention layers kept whole; "
                             f"{type(group.kv_cache_spec).__name__} layers ({', '.join(group.layer_names[:3])}) "
                             "would need a transfer of their own: drop --kv-transfer-config, or turn H2O KV "
                             "eviction off (drop --kv-eviction h2o / additional_config['h2o'])")
    return whole


def check_one_h2o_group(kv_cache_config) -> None:
    """H2O's connectors move one H2O KV-cache group. vLLM forms several beside a speculative
    drafter's whole group when the drafter has far fewer layers than the target (it groups
    layers in equal numbers: an EAGLE head's one layer beside a 30-layer target makes 30).
    Refused when the engine starts, before any request: the transfer orders name one group's
    blocks, and a request would otherwise fail mid-way."""
    from h2o_vllm.scheduler.spec import H2OAttentionSpec
    groups = [g for g in (kv_cache_config.kv_cache_groups if kv_cache_config else ())
              if isinstance(g.kv_cache_spec, H2OAttentionSpec)]
    if len(groups) > 1:
        raise ValueError(
            f"H2O's KV connector (--kv-transfer-config) moves one H2O KV-cache group, and vLLM split this "
            f"model's layers into {len(groups)} beside the speculative drafter's own (it groups layers in "
            "equal numbers, so a drafter with far fewer layers than the target splits it): draft with n-gram "
            "lookup ('{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'), "
            "or with a draft model of more than two thirds of the target's layers, or drop --speculative-config "
            "or --kv-transfer-config, or turn H2O KV eviction off (drop --kv-eviction h2o / additional_config['h2o'])")
