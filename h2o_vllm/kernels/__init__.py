"""Triton kernels for the CUDA path (worker process): fused attention with score accumulation,
the unfused score kernels, and row compaction.

One module per op: ``attention`` (``h2o_attention``: the CUDA path's attention, which also adds
decode rows' scores and returns the log-sum-exp for the other rows), ``split_decode``
(``h2o_split_decode``: the same for a decode-only batch, each row's keys split over
programs), ``decode_scores`` (``accumulate_decode_scores``), ``prefill_scores`` (``prefill_lse``,
``accumulate_prefill_scores``, ``accumulate_prefill_scores_from_lse``: the prefill rows' score
pass, also run after the fused attention), ``select`` (``select_keep_rows``: a due pass's
keep-sets in one launch) and ``compact`` (``compact_rows``); ``tiles`` holds
what the score kernels share. ``accumulate_decode_scores`` and ``accumulate_prefill_scores``
are the unfused path, kept as the tested reference of the fused one. Each op comes in three:
``<op>_kernel`` (jit), the ``<op>`` launcher (importable from here), and (score and compaction
ops) a plain-torch twin of the same name in ``h2o_vllm.kernels.torch_ops``. Launchers load lazily,
so the twins (torch only) import without Triton; the launchers' shared argument checks live
here. Set ``TRITON_INTERPRET=1`` before the first import of a kernel module to run the kernels
on CPU.

The score kernels (``attention``, ``decode_scores``, ``prefill_scores``): every (row, KV head,
KV position) of ``scores`` is written by exactly one program, so no atomics and the result is
deterministic; this relies on rows not sharing blocks (a prefix-cache hit is copied into the
row's own blocks, docs/prefix-caching.md).
The unfused kernels recompute probabilities from Q and K; the fused attention keeps decode
rows' logits and every row's log-sum-exp instead (docs/cuda.md, "Fused attention"). Math is
fp32 whatever the cache dtype: the score kernels upcast Q and K on load (see
``dot_precision``), the fused attention dots 16-bit Q.K and P.V natively as vLLM's kernel does
(exact products, fp32 sums); softmax uses exp2 with log2(e) folded into the scale. Layouts: see
``h2o_vllm.kernels.tiles``.
"""
from __future__ import annotations

import importlib

import torch

_LAUNCHERS = {
    "accumulate_decode_scores": "h2o_vllm.kernels.decode_scores",
    "accumulate_prefill_scores": "h2o_vllm.kernels.prefill_scores",
    "accumulate_prefill_scores_from_lse": "h2o_vllm.kernels.prefill_scores",
    "h2o_attention": "h2o_vllm.kernels.attention",
    "decode_logit_offsets": "h2o_vllm.kernels.attention",
    "h2o_split_decode": "h2o_vllm.kernels.split_decode",
    "num_splits": "h2o_vllm.kernels.split_decode",
    "prefill_lse": "h2o_vllm.kernels.prefill_scores",
    "compact_rows": "h2o_vllm.kernels.compact",
    "select_keep_rows": "h2o_vllm.kernels.select",
}
__all__ = sorted(_LAUNCHERS)
_UNQUANTISED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: fp8 caches (vLLM's ``kv_cache_dtype`` fp8 / fp8_e4m3): stored ``x / scale``, read back as
#: ``fp8 * scale`` in the query's dtype (the kernels' ``k_scale`` / ``v_scale``).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
_CACHE_DTYPES = _UNQUANTISED_DTYPES + FP8_CACHE_DTYPES


def __getattr__(name: str):
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(_LAUNCHERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_paged(name: str, cache: torch.Tensor, block_table: torch.Tensor,
                scores: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Validate a paged cache against block_table (and scores unless None); return
    (num_blocks, block_size, num_kv_heads, head_size)."""
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], "
                         f"got shape {tuple(cache.shape)}")
    if cache.dtype not in _CACHE_DTYPES:
        raise TypeError(f"{name} dtype must be one of {_CACHE_DTYPES}, got {cache.dtype}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_size, got strides {cache.stride()}")
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    if scores is not None:
        if scores.dtype != torch.float32:
            raise TypeError(f"scores must be float32, got {scores.dtype}")
        if tuple(scores.shape) != (num_blocks, num_kv_heads, block_size):
            raise ValueError(f"scores must be [num_blocks, num_kv_heads, block_size] = "
                             f"{(num_blocks, num_kv_heads, block_size)}, "
                             f"got {tuple(scores.shape)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be [num_rows, max_blocks] int32, "
                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    if block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dim, "
                         f"got {block_table.stride()}")
    for t, n in ((scores, "scores"), (block_table, "block_table")):
        if t is not None and t.device != cache.device:
            raise ValueError(f"{n} is on {t.device}, {name} on {cache.device}")
    return num_blocks, block_size, num_kv_heads, head_size


def check_query(query: torch.Tensor, key_cache: torch.Tensor, num_kv_heads: int) -> int:
    if query.dim() != 3 or query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"query must be [num_tokens, num_q_heads, {key_cache.shape[3]}], "
                         f"got {tuple(query.shape)}")
    if query.dtype != key_cache.dtype and not (key_cache.dtype in FP8_CACHE_DTYPES
                                               and query.dtype in _UNQUANTISED_DTYPES):
        raise TypeError(f"query dtype {query.dtype} must match key_cache dtype {key_cache.dtype} "
                        "(or the cache be fp8)")
    if query.stride(-1) != 1:
        raise ValueError(f"query must be contiguous in head_size, got strides {query.stride()}")
    if query.device != key_cache.device:
        raise ValueError(f"query is on {query.device}, key_cache on {key_cache.device}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads {query.shape[1]} is not a multiple of "
                         f"num_kv_heads {num_kv_heads}")
    return query.shape[1] // num_kv_heads


def check_lens(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int32 or t.device != device:
        raise ValueError(f"{name} must be [{n}] int32 on {device}, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def check_weights(query_weight: torch.Tensor | None, num_tokens: int,
                  score_scale: torch.Tensor | None, num_rows: int, device: torch.device) -> bool:
    """Validate the optional decay / query-weight pair; True when the weighted variant runs."""
    if (query_weight is None) != (score_scale is None):
        raise ValueError("query_weight and score_scale go together: give both or neither")
    if query_weight is None:
        return False
    for name, t, n in (("query_weight", query_weight, num_tokens),
                       ("score_scale", score_scale, num_rows)):
        if t.dim() != 1 or t.shape[0] < n or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} must be [>= {n}] float32 on {device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    return True


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device: torch.device) -> bool:
    """Validate the optional sink logits (gpt-oss: one per query head, any float dtype, upcast
    on load); True when the variant with sinks runs."""
    if sinks is None:
        return False
    if (sinks.dim() != 1 or sinks.shape[0] != num_q_heads or not sinks.is_floating_point()
            or sinks.device != device or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be [{num_q_heads}] (one logit per query head), a contiguous "
                         f"float tensor on {device}; got {tuple(sinks.shape)} {sinks.dtype} on "
                         f"{sinks.device}")
    return True


def check_tile(**tiles: int) -> None:
    for name, size in tiles.items():  # tl.dot needs power-of-two dims of at least 16
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def dot_precision(dtype: torch.dtype) -> str:
    # Kernels upcast Q and K to fp32 (the interpreter cannot dot bf16). A bf16/fp16 value is
    # exact in TF32 (8 / 11 significant bits <= 11), so TF32 loses nothing there and keeps
    # tensor cores; an fp32 cache needs IEEE to match the torch twin.
    return "ieee" if dtype == torch.float32 else "tf32"
