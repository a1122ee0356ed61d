"""Shared pieces of the score kernels (worker process, CUDA path): the paged key-tile load, the
online-softmax step, and log2(e).

Cache layout as vLLM's GPU backends (FlashAttention / Triton attention): key_cache [num_blocks,
block_size, num_kv_heads, head_size]; scores [num_blocks, num_kv_heads, block_size] fp32,
KV-space. See docs/semantics.md, "Score".
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Softmax runs in exp2, with log2(e) folded into the scale.
LOG2E = 1.4426950408889634


@triton.jit
def load_key_tile(key_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                  stride_kb, stride_ks, stride_kh, block_size, k_scale):
    """K at KV positions offs_n of one row and KV head, upcast to fp32 and times ``k_scale``
    (an fp8 cache's per-tensor scale; 1.0 otherwise, which is exact) (masked lanes are 0).

    bt_row points at the row's block-table entries. Also returns each position's block (int64),
    which the caller needs to address the same positions in ``scores``.
    """
    blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    k = tl.load(key_cache + blk[:, None] * stride_kb
                + (offs_n % block_size)[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * k_scale
    return blk, k


@triton.jit
def soft_cap(s, cap_log2, SOFTCAP: tl.constexpr):
    """The model's logit soft-cap (Gemma 2: ``cap * tanh(logits / cap)``) on logits s in log2
    units, with the cap in the same units (``cap * log2(e)``). Applied before masking: a masked
    -inf would come out as -cap. tanh(x) = 1 - 2 / (exp(2x) + 1) stays finite for every x."""
    if SOFTCAP:
        s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap_log2)) + 1.0))
    return s


@triton.jit
def softmax_start(sinks, q_head, mask, BLOCK: tl.constexpr, SINKS: tl.constexpr):
    """The running (max, sum of exp2) an online softmax starts from, per query row: empty
    (-inf, 0), or with the model's sink logit already in (gpt-oss: ``sinks`` one per query
    head, any float dtype; ``(sink * log2(e), 1)``), so that the final sum is its softmax's
    denominator while the sink owns no key. Masked rows start empty."""
    if SINKS:
        m_i = tl.load(sinks + q_head, mask=mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(mask, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
    return m_i, l_i


@triton.jit
def online_softmax_step(m_i, l_i, s):
    """One key tile of a running (max, sum of exp2) per query row: s [rows, keys] in log2 units,
    masked keys at -inf. Returns the updated (m_i, l_i)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
    return m_new, l_i
