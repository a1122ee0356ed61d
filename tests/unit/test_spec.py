"""H2OAttentionSpec: carries the H2O config beside every FullAttentionSpec field, survives
vLLM's merge, is made only from full-attention specs, and vLLM's registry maps it to
H2OManager. Real vLLM spec classes throughout (no stand-ins)."""
import dataclasses
import pickle

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import (FullAttentionManager, SlidingWindowManager,
                                                       get_manager_for_kv_cache_spec)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVQuantMode, MLAAttentionSpec,
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from h2o_vllm import vllm_hooks
from h2o_vllm.config import H2OConfig
from h2o_vllm.scheduler.manager import H2OManager
from h2o_vllm.spec import H2OAttentionSpec, h2o_specs

CONFIG = H2OConfig(heavy_ratio=0.3, recent_ratio=0.2, interval=4)

# Every FullAttentionSpec field away from its default, so a dropped field cannot go unseen.
ODD = dict(block_size=32, num_kv_heads=4, head_size=128, head_size_v=32, dtype=torch.bfloat16,
           dcp_sharded=False, block_stride_alignment=64, max_tp_shards=2,
           kv_quant_mode=KVQuantMode.FP8_PER_TENSOR, page_size_padded=1 << 20, num_head_slots=8,
           state_content_bytes=96, tokens_per_state=2, sliding_window=256, attention_chunk_size=512,
           non_causal=True)


def _full(**overrides):
    return FullAttentionSpec(**{"block_size": 16, "num_kv_heads": 2, "head_size": 64,
                                "dtype": torch.float32, **overrides})


def test_spec_from_full_keeps_every_field_and_adds_h2o():
    full = _full(**ODD)
    base = _full()
    names = [f.name for f in dataclasses.fields(FullAttentionSpec)]
    differing = {n for n in names if getattr(full, n) != getattr(base, n)}
    assert differing == set(names)  # the test's own control
    spec = H2OAttentionSpec.from_full(full, CONFIG)
    assert isinstance(spec, FullAttentionSpec) and spec.h2o == CONFIG
    assert {f.name for f in dataclasses.fields(spec)} == set(names) | {"h2o"}
    assert {n: getattr(spec, n) for n in names} == {n: getattr(full, n) for n in names}
    assert spec.page_size_bytes == full.page_size_bytes


def test_spec_merge_keeps_h2o():
    specs = [H2OAttentionSpec.from_full(_full(sliding_window=64), CONFIG) for _ in range(3)]
    merged = H2OAttentionSpec.merge(specs)
    assert type(merged) is H2OAttentionSpec and merged.h2o == CONFIG
    assert merged == specs[0]
    assert pickle.loads(pickle.dumps(merged)) == merged  # it travels to the engine core pickled


def test_spec_merge_refuses_two_configs():
    specs = [H2OAttentionSpec.from_full(_full(), CONFIG),
             H2OAttentionSpec.from_full(_full(), H2OConfig(heavy_tokens=8, recent_tokens=8))]
    with pytest.raises(ValueError, match="one H2O config"):
        H2OAttentionSpec.merge(specs)


def test_spec_h2o_specs_converts_only_full_attention():
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                               sliding_window=128)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    already = H2OAttentionSpec.from_full(_full(), H2OConfig(heavy_tokens=1, recent_tokens=1))
    specs = {"full.0": _full(), "full.1": _full(**ODD), "window": window, "mla": mla, "h2o": already}
    out = h2o_specs(specs, CONFIG)
    assert list(out) == list(specs)
    for name in ("full.0", "full.1"):
        assert type(out[name]) is H2OAttentionSpec
        assert out[name] == H2OAttentionSpec.from_full(specs[name], CONFIG)
    for name in ("window", "mla", "h2o"):  # a FullAttentionSpec subclass is not full attention
        assert out[name] is specs[name]
    assert specs["full.0"] == _full()  # the input is left alone


def test_spec_h2o_specs_unchanged_when_h2o_is_off():
    specs = {"full": _full()}
    assert h2o_specs(specs, None) is specs


def test_spec_registry_maps_h2o_spec_to_manager():
    vllm_hooks.register_kv_cache_spec()
    vllm_hooks.register_kv_cache_spec()  # every process may load the plugin more than once
    spec = H2OAttentionSpec.from_full(_full(), CONFIG)
    assert KVCacheSpecRegistry.get_manager_class(spec) is H2OManager
    assert KVCacheSpecRegistry.get_manager_class(_full()) is FullAttentionManager
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                               sliding_window=128)
    assert KVCacheSpecRegistry.get_manager_class(window) is SlidingWindowManager
    # vLLM builds the manager itself, as KVCacheCoordinator does for each group.
    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)
    manager = get_manager_for_kv_cache_spec(spec, max_in_flight_tokens=64, max_model_len=256,
                                            block_pool=pool, enable_caching=False,
                                            kv_cache_group_id=0, scheduler_block_size=16)
    assert type(manager) is H2OManager and manager.budgets.config == CONFIG


def _vllm_config(max_model_len: int, prefix_caching: bool):
    from types import SimpleNamespace
    return SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_start_up_check_asks_for_a_chunked_requests_peak_not_max_model_len(prefix_caching):
    """vLLM's start-up check (``check_enough_kv_cache_memory``) asks each spec for one
    max_model_len request's bytes: a 512-token request, held whole, needs 32 blocks (stock vLLM
    refuses a 23-block pool); with prefill_chunk 64 and 8 + 8 tokens (interval: one block), its
    peak is a chunk on top of the budget, 16 + 64 slots (plus one fresh block for its first
    compaction with prefix caching), and fits."""
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    config = _vllm_config(512, prefix_caching)
    full = _full()
    held_whole = H2OAttentionSpec.from_full(full, H2OConfig(heavy_tokens=8, recent_tokens=8))
    chunked = H2OAttentionSpec.from_full(full, H2OConfig(heavy_tokens=8, recent_tokens=8, prefill_chunk=64))
    page = full.page_size_bytes
    assert held_whole.max_memory_usage_bytes(config) == full.max_memory_usage_bytes(config) == 32 * page
    assert chunked.max_memory_usage_bytes(config) == (5 + prefix_caching) * page
    pool = 23 * page
    with pytest.raises(ValueError, match=r"max seq len \(512\)"):
        _check_enough_kv_cache_memory(pool, lambda: full.max_memory_usage_bytes(config), 512, lambda m: 0)
    _check_enough_kv_cache_memory(pool, lambda: chunked.max_memory_usage_bytes(config), 512, lambda m: 0)
