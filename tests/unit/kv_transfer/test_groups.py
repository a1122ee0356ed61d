"""kv_transfer.groups: which KV-cache groups H2O's connectors move, read from vLLM's
own ``KVCacheConfig`` when the engine starts: every H2O group (vLLM splits a target into
several beside a drafter with fewer layers), and a speculative drafter's groups whole;
anything else is refused then, naming the way out, before a request can fail."""
import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)

from h2o_vllm.config import H2OConfig
from h2o_vllm.spec import H2OAttentionSpec
from h2o_vllm.kv_transfer.groups import by_pool_block, h2o_groups, whole_groups

SHAPE = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
H2O = H2OAttentionSpec(**SHAPE, h2o=H2OConfig())


def _config(*groups) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def test_an_eagle_head_beside_a_split_target_is_moved_whole_and_each_h2o_group_by_its_own_blocks():
    """A two-layer target and a one-layer head: vLLM's groups are [layer 0], [layer 1], [head]."""
    config = _config((["t.0"], H2O), (["t.1"], H2O), (["head"], FullAttentionSpec(**SHAPE)))
    assert [(g, group.layer_names) for g, group in h2o_groups(config)] == [(0, ["t.0"]), (1, ["t.1"])]
    assert [(g, group.layer_names) for g, group in whole_groups(config)] == [(2, ["head"])]
    assert whole_groups(_config((["t.0", "t.1"], H2O))) == []


def test_a_group_neither_h2o_nor_full_attention_is_refused():
    with pytest.raises(ValueError, match="SlidingWindowSpec") as refused:
        whole_groups(_config((["t.0"], H2O), (["w.0"], SlidingWindowSpec(**SHAPE, sliding_window=32))))
    assert "--kv-transfer-config" in str(refused.value)


def test_a_whole_layers_view_has_one_row_per_pool_block_even_where_its_kernel_blocks_are_smaller():
    """vLLM's view of a layer whose backend splits each 32-token pool block into two kernel
    blocks of 16 counts kernel blocks; a pool block's two are adjacent."""
    pool = torch.arange(4 * 2 * 32 * 8, dtype=torch.float32).reshape(4, 2, 32, 8)
    assert by_pool_block(pool, 4, "l") is pool
    kernel = pool.reshape(4, 2, 2, 16, 8).transpose(1, 2).reshape(8, 2, 16, 8)  # pool block b: rows 2b, 2b+1
    folded = by_pool_block(kernel, 4, "l")
    assert folded.shape == (4, 2, 2, 16, 8)
    assert torch.equal(folded[2], kernel[4:6])
    folded[1] = 0  # a view: writes reach the cache
    assert not kernel[2:4].any() and kernel[4:].all()
    with pytest.raises(RuntimeError, match="5 blocks"):
        by_pool_block(torch.zeros(5, 1), 4, "l")
