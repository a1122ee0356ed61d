"""One step of H2O on the CUDA path, without vLLM: device metadata, then scores and compaction.

Runs in the worker process. ``make_cuda_step`` turns the runner hook's StepPlan (CPU tensors)
into the device tensors every layer of the step shares, once per step in the metadata builder;
``update_scores_and_compact`` runs, per layer, after the stock kernel has attended: zero the
scores of the slots this step wrote, add this step's probabilities (the Triton score kernels),
compact the due rows (``policy.select_keep`` per head, then the ``compact_rows`` kernel).
Imports no vLLM, so the whole sequence runs on CPU tensors under ``TRITON_INTERPRET=1``.
Cache views: key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_size];
scores [num_blocks, num_kv_heads, block_size] fp32, KV-space (h2o_vllm.kernels' layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_vllm.policy import select_keep
from h2o_vllm.worker.plan import StepPlan
from h2o_vllm.worker.plan import kv_slot_mapping as plan_slot_mapping


@dataclass(frozen=True)
class DueGroup:
    """Due rows that share (kv_len, heavy, target): one select_keep and one compact launch."""
    rows: torch.Tensor      # [R] int64, device: batch rows
    blocks: torch.Tensor    # [R, kv_len] int64, device: block of KV position t of each row
    offsets: torch.Tensor   # [kv_len] int64, device: offset of KV position t
    heavy: int
    target: int


@dataclass(frozen=True)
class CudaStep:
    """Device tensors of one step, shared by every layer of the KV-cache group."""
    kv_seq_lens: torch.Tensor         # [num_rows] int32: keys each row attends over
    new_blocks: torch.Tensor          # [num_new] int64: slots this step writes (block, offset)
    new_offsets: torch.Tensor
    decode_rows: torch.Tensor | None  # [D] int64 rows with one query, None when D == 0
    decode_tokens: torch.Tensor | None  # [D] int64 their token index in the batch
    prefill_rows: torch.Tensor | None   # [P] int64 rows with several queries
    prefill_tokens: torch.Tensor | None  # [sum q_len] int64, their tokens packed; None: all tokens
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32 over the packed tokens
    max_prefill_query_len: int
    max_prefill_kv_len: int
    due: tuple[DueGroup, ...]


def _to(t: torch.Tensor, device, dtype=torch.int64) -> torch.Tensor:
    return t.to(dtype).to(device, non_blocking=True)


def kv_slot_mapping(plan: StepPlan, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """The CPU builder's KV-space slots, shaped like vLLM's (possibly padded) ``slot_mapping``."""
    return plan_slot_mapping(plan, block_table, slot_mapping.shape[0], block_size)


def make_cuda_step(plan: StepPlan, block_table: torch.Tensor, kv_slots: torch.Tensor,
                   block_size: int) -> CudaStep:
    """block_table: [>= num_rows, max_blocks] int32 on the device; kv_slots from kv_slot_mapping."""
    device = block_table.device
    query_lens = plan.query_lens
    kv_seq_lens = plan.kv_seq_lens
    num_new = int(query_lens.sum())
    new = kv_slots[:num_new]
    starts = torch.cumsum(query_lens, 0) - query_lens
    decode = (query_lens == 1).nonzero().flatten()
    prefill = (query_lens > 1).nonzero().flatten()
    decode_rows = decode_tokens = prefill_rows = prefill_tokens = prefill_qsl = None
    if decode.numel():
        decode_rows, decode_tokens = _to(decode, device), _to(starts[decode], device)
    max_q = max_kv = 0
    if prefill.numel():
        q = query_lens[prefill]
        max_q, max_kv = int(q.max()), int(kv_seq_lens[prefill].max())
        prefill_rows = _to(prefill, device)
        prefill_qsl = _to(torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q, 0)]),
                          device, torch.int32)
        if not decode.numel():  # only prefill rows: the batch's tokens are already packed
            prefill_tokens = None
        else:
            prefill_tokens = _to(torch.cat([torch.arange(int(s), int(s) + int(n))
                                            for s, n in zip(starts[prefill], q)]), device)
    return CudaStep(
        kv_seq_lens=_to(kv_seq_lens, device, torch.int32),
        new_blocks=new // block_size, new_offsets=new % block_size,
        decode_rows=decode_rows, decode_tokens=decode_tokens, prefill_rows=prefill_rows,
        prefill_tokens=prefill_tokens, prefill_query_start_loc=prefill_qsl,
        max_prefill_query_len=max_q, max_prefill_kv_len=max_kv,
        due=_due_groups(plan, block_table, block_size))


def _due_groups(plan: StepPlan, block_table: torch.Tensor, block_size: int) -> tuple[DueGroup, ...]:
    device = block_table.device
    groups: dict[tuple[int, int, int], list[int]] = {}
    for row in plan.due.nonzero().flatten().tolist():
        key = (int(plan.kv_seq_lens[row]), int(plan.heavy[row]), int(plan.kv_lens_after[row]))
        groups.setdefault(key, []).append(row)
    out = []
    for (kv_len, heavy, target), rows in groups.items():
        pos = torch.arange(kv_len)
        rows_d = _to(torch.tensor(rows), device)
        blocks = block_table[rows_d][:, _to(pos // block_size, device)].to(torch.int64)
        out.append(DueGroup(rows=rows_d, blocks=blocks, offsets=_to(pos % block_size, device),
                            heavy=heavy, target=target))
    return tuple(out)


def update_scores_and_compact(step: CudaStep, query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, scores: torch.Tensor,
                              block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """After attention: scores of new slots start at 0 (a slot's score starts when its K/V is
    written; slots are reused across requests), add this step's probabilities, compact due rows.

    query: [>= num_tokens, num_q_heads, head_size]. Returns [2] fp32 on the device: the
    attention mass of the compacted rows before and after compaction (for metrics, no sync).
    """
    from h2o_vllm import kernels
    scores[step.new_blocks, :, step.new_offsets] = 0.0
    if step.decode_rows is not None:
        kernels.accumulate_decode_scores(
            query[step.decode_tokens], key_cache, block_table[step.decode_rows],
            step.kv_seq_lens[step.decode_rows], scores, scale)
    if step.prefill_rows is not None:
        # Only prefill rows: the (possibly padded) query is already packed by the offsets.
        q = query if step.prefill_tokens is None else query[step.prefill_tokens]
        kernels.accumulate_prefill_scores(
            q, key_cache, block_table[step.prefill_rows], step.prefill_query_start_loc,
            step.kv_seq_lens[step.prefill_rows], scores, scale,
            max_query_len=step.max_prefill_query_len, max_kv_len=step.max_prefill_kv_len)
    mass = torch.zeros(2, dtype=torch.float32, device=scores.device)
    for group in step.due:
        live = scores[group.blocks, :, group.offsets[None, :]]          # [R, kv_len, Hkv]
        live = live.transpose(1, 2)                                     # [R, Hkv, kv_len]
        keep = select_keep(live, group.heavy, group.target - group.heavy)  # [R, Hkv, target]
        mass[0] += live.sum()
        mass[1] += live.gather(-1, keep).sum()
        kernels.compact_rows(key_cache, value_cache, scores, block_table, group.rows, keep)
    return mass
