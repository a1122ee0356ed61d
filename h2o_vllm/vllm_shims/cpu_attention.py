"""The CPU attention builder's ISA, read and set where vLLM keeps it; its metadata cut down to
the decode rows.

Runs in the worker process. H2O reads K back from the CPU cache in the ``vec``/``vec16``
layouts (``worker/cpu/layout.py``, verified in the CPU cache study); others, such as AMX, pack
K differently, so an H2O engine runs one of those two.
"""
from __future__ import annotations

import dataclasses

import torch

READABLE_ISAS = ("vec", "vec16")


def use_readable_isa(builder, layer_names) -> str:
    """Switch ``builder`` (a ``CPUAttentionMetadataBuilder``) and its layers to a readable ISA
    if vLLM chose another; returns the ISA in use."""
    if builder.isa not in READABLE_ISAS:
        builder.isa = "vec" if builder.block_size % 32 == 0 else "vec16"
        builder._set_isa_to_layers(layer_names)
    return builder.isa


def reads_fp8() -> bool:
    """Whether vLLM's CPU attention reads an fp8 cache on this machine: x86 with AVX-512 or AMX,
    the CPU features its ISA choice (``cpu_attn._get_attn_isa``) asks torch for."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def decode_rows_metadata(cm, rows: torch.Tensor, tokens: torch.Tensor):
    """vLLM's ``CommonAttentionMetadata`` of a batch cut down to the rows that have one query
    each (``rows``, their tokens ``tokens``, int64), in that order, for the CPU builder to plan
    vLLM's kernel over them alone: the rows with several queries are attended by H2O
    (``worker.cpu.prefill``). Per-row and per-token fields are indexed; the fields the CPU
    builder does not read and that describe the whole batch are dropped."""
    num_rows = rows.shape[0]
    query_start_loc = torch.arange(num_rows + 1, dtype=cm.query_start_loc.dtype)
    seq_lens = cm.seq_lens[rows.to(cm.seq_lens.device)]
    return dataclasses.replace(
        cm, query_start_loc=query_start_loc.to(cm.query_start_loc.device),
        query_start_loc_cpu=query_start_loc, seq_lens=seq_lens, num_reqs=num_rows,
        num_actual_tokens=num_rows, max_query_len=1, max_seq_len=int(seq_lens.max()),
        block_table_tensor=cm.block_table_tensor[rows], slot_mapping=cm.slot_mapping[tokens],
        positions=None if cm.positions is None else cm.positions[tokens],
        logits_indices_padded=None, num_logits_indices=None, max_logits_per_req=None,
        is_prefilling=None, seq_lens_cpu_upper_bound=None, req_idx=None,
        dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None,
        _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
