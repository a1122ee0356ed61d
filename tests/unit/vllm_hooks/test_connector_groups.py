"""vllm_hooks.connector_groups: which KV-cache groups H2O's connectors move, read from vLLM's own
``KVCacheConfig`` when the engine starts: one H2O group, and a speculative drafter's groups
whole; anything else is refused then, naming the way out, before a request can fail."""
import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)

from h2o_vllm.config import H2OConfig
from h2o_vllm.scheduler.spec import H2OAttentionSpec
from h2o_vllm.vllm_hooks.connector_groups import check_one_h2o_group, whole_groups

SHAPE = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


H2O = H2OAttentionSpec(**SHAPE, h2o=H2OConfig())


def test_a_drafters_group_is_moved_whole_beside_the_one_h2o_group():
    config = _config(H2O, FullAttentionSpec(**SHAPE))
    check_one_h2o_group(config)
    assert [(g, group.layer_names) for g, group in whole_groups(config)] == [(1, ["layer.1"])]
    assert whole_groups(_config(H2O)) == []


def test_several_h2o_groups_are_refused_naming_n_gram_drafts():
    """An EAGLE head's one layer beside a many-layer target: vLLM splits the target."""
    with pytest.raises(ValueError) as refused:
        check_one_h2o_group(_config(H2O, H2O, FullAttentionSpec(**SHAPE)))
    message = str(refused.value)
    assert "into 2" in message and '"ngram"' in message and "--kv-transfer-config" in message


def test_a_group_neither_h2o_nor_full_attention_is_refused():
    with pytest.raises(ValueError, match="SlidingWindowSpec"):
        whole_groups(_config(H2O, SlidingWindowSpec(**SHAPE, sliding_window=32)))
