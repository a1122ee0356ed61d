"""The CUDA path's fp8 cache write on the CPU (``TritonOps.write_fp8``): what a GPU stores."""
import torch

from h2o_vllm.oracle.stored_kv import through
from h2o_vllm.worker.cuda.ops import TritonOps


def test_write_fp8_stores_scaled_saturated_nearest_even_values_at_the_slots():
    num_blocks, block_size, heads, head_size = 3, 4, 2, 8
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=torch.uint8)
    ops = TritonOps(head_size, torch.float8_e4m3fn)
    ops.k_scale, ops.v_scale = 0.5, 4.0
    views = ops.cache_views(kv_cache)
    assert views.keys.dtype == torch.float8_e4m3fn and views.keys.shape == (3, 4, 2, 8)
    key = torch.randn(6, heads * head_size) * 300  # some past 448 * scale: saturated
    value = torch.randn(6, heads * head_size)
    slots = torch.tensor([5, 0, -1, 11, 6, -1])  # -1: padding, not written
    ops.write_fp8(views, key, value, slots)
    live = slots >= 0
    got_k = views.keys[slots[live] // block_size, slots[live] % block_size].float() * 0.5
    got_v = views.values[slots[live] // block_size, slots[live] % block_size].float() * 4.0
    assert torch.equal(got_k, through(key[live].view(-1, heads, head_size), torch.float8_e4m3fn, 0.5))
    assert torch.equal(got_v, through(value[live].view(-1, heads, head_size), torch.float8_e4m3fn, 4.0))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[live]] = True
    untouched = kv_cache.transpose(1, 2).reshape(num_blocks * block_size, -1)[~written]
    assert not untouched.any()
