"""One H2O step on the worker, for both devices: the metadata moved into KV space, the step's
device tensors, and the per-layer sequence after attention (docs/semantics.md, "Step order").

Runs in the worker process. ``kv_space_metadata`` runs once per step in a metadata builder;
``update_scores_and_compact`` once per attention layer, after the layer has written K/V at the
KV-space slots and attended: zero the scores of the slots just written, add this step's
probabilities, select each due row's keep-set per head (ranked by its scores, or by a score of
its live cache: ``worker.key_scores``) and compact, all due rows in one padded pass
(``worker.due_pass``), and add the attention mass into the step's one buffer.
A device supplies ``DeviceOps``: how to view its cache, accumulate and compact. Imports no
vLLM, so the whole sequence runs on CPU tensors in unit tests.
Cache views: keys / values [num_blocks, block_size, num_kv_heads, head_size] (strided views
are fine); scores [num_blocks, num_kv_heads, block_size] fp32, KV-space.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from h2o_vllm import metrics
from h2o_vllm.score_modes.rotary import Rotary
from h2o_vllm.worker import due_pass, prefix_records
from h2o_vllm.worker.due_pass import DuePass, due_passes
from h2o_vllm.worker.key_scores import key_scores
from h2o_vllm.worker.plan import StepPlan, kv_slot_mapping
from h2o_vllm.worker.prefix_records import PrefixStep
from h2o_vllm.worker.step_buffers import FreshTensors, StepBuffers


@dataclass(frozen=True)
class H2OStep:
    """What every layer of a KV-cache group reads in one step: the plan (CPU) and its device
    tensors, built once in the metadata builder."""
    plan: StepPlan
    block_table: torch.Tensor          # [>= num_rows, max_blocks] int32, device
    kv_seq_lens: torch.Tensor          # [num_rows] int32, device: keys each row attends over
    new_blocks: torch.Tensor           # [num_new] int64: slots this step writes (block, offset)
    new_offsets: torch.Tensor
    decode_rows: torch.Tensor | None   # [D] int64 rows with one query, None when D == 0
    decode_tokens: torch.Tensor | None  # [D] int64 their token index in the batch
    prefill_rows: torch.Tensor | None  # [P] int64 rows with several queries
    prefill_tokens: torch.Tensor | None  # [sum q_len] int64, their tokens packed; None: all tokens
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32 over the packed tokens
    max_prefill_query_len: int
    max_prefill_kv_len: int
    due: tuple[DuePass, ...]  # the step's compactions (worker.due_pass), () when no row is due
    # [2] fp32, device: the due rows' attention mass before and after compaction, summed over
    # every layer of the step; None when no row is due. Read once, after ``last_layer``
    # (``DeferredMass``): when the step is over, not at the next one, which an idle engine
    # never starts and which a second build of the same batch would start too early.
    mass: torch.Tensor | None = None
    last_layer: str = ""  # the group's last layer in forward order (its builder's layer_names[-1])
    # Graph-shaped decode (``make_step``): the due pass's width, which each decode row's share
    # of the fused attention's logits scratch spans; 0 on an eager step.
    decode_width: int = 0
    # What the device's ops precompute once per step (the CPU's: a call that builds it on first use).
    device_index: Any = None
    # Decay and query weights (StepPlan.query_weights / score_scale) on the device; None on
    # an unweighted (paper H2O) step. Indexed like the queries: query_weight by token
    # (decode_tokens, prefill_tokens), score_scale by row (decode_rows, prefill_rows).
    query_weight: torch.Tensor | None = None   # [num_tokens] fp32
    score_scale: torch.Tensor | None = None    # [num_rows] fp32
    # Weighted steps: per prefill row, its first query of nonzero weight (q_len if none); the
    # queries before it add nothing to the scores, so score passes start there (an observation
    # window scores its last queries only). int32 [P], device; None on an unweighted step.
    prefill_first_scored: torch.Tensor | None = None
    # Prefix caching (worker.prefix_records): this step's hit scores, record phases, fresh blocks; and
    # the table due rows compact through (block_table unless a row compacts into fresh blocks).
    prefix: PrefixStep | None = None
    compact_table: torch.Tensor | None = None


class DeviceOps(Protocol):
    """What differs between devices; everything else is written once here."""

    def read_scales(self, layer) -> None:
        """Take the layer's fp8 KV scales for this forward (``worker.kv_dtype``)."""

    def read_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys gathered from ``cache_views(...).keys`` in fp32, as the attention reads them
        (``worker.kv_dtype``: an fp8 cache's dequantised)."""

    def read_values(self, values: torch.Tensor) -> torch.Tensor:
        """Values gathered from ``cache_views(...).values`` in fp32, as ``read_keys``."""

    def cache_views(self, kv_cache: torch.Tensor) -> Any:
        """An object with ``keys`` and ``values``: [num_blocks, block_size, num_kv_heads, head_size]."""

    def step_index(self, step: H2OStep, block_size: int, buffers: StepBuffers | None = None) -> Any:
        """Per-step indices the device's accumulate reads in every layer (or None); in
        ``buffers`` where given."""

    def accumulate(self, step: H2OStep, query: torch.Tensor, views: Any, scores: torch.Tensor,
                   scale: float, softcap: float = 0.0, sink_logits: torch.Tensor | None = None) -> None:
        """Add this step's softmax probabilities, summed over each KV head's query group; on a
        weighted step, first scale each row's live scores by step.score_scale[row] and weight
        each query's probabilities by step.query_weight[token]. The probabilities are the
        model's own attention: softcap > 0 soft-caps the logits before the softmax (Gemma 2);
        sink_logits [num_q_heads] puts each head's sink logit in its denominator (gpt-oss)."""

    def compact(self, views: Any, scores: torch.Tensor, block_table: torch.Tensor,
                rows: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor) -> None:
        """Move K, V and scores at KV positions keep[i, h, :targets[i]] of row rows[i] to
        [0, targets[i]) (``kernels.compact_rows``); a row whose target is 0 moves nothing."""


def kv_space_metadata(cm, plan: StepPlan, block_size: int, ops: DeviceOps, last_layer: str = "",
                      buffers: StepBuffers | None = None, graph_width: int | None = None):
    """vLLM's ``CommonAttentionMetadata`` moved into KV space, and the step's ``H2OStep``.

    seq_lens (the kernel's key counts) and slot_mapping (where K/V are written) come from the
    plan; RoPE positions stay logical (vLLM computes them from the logical positions).
    ``buffers``: the builder's (``worker.step_buffers``), where the step's device tensors are
    written; ``graph_width``: graph-shaped decode (``make_step``)."""
    buffers = buffers or FreshTensors(cm.seq_lens.device)
    num_rows = plan.query_lens.shape[0]
    # may be padded past num_rows: padding keeps vLLM's values
    seq_lens = buffers.put("seq_lens", cm.seq_lens, cm.seq_lens.dtype, buffers.rows)
    seq_lens[:num_rows].copy_(plan.kv_seq_lens, non_blocking=True)
    slots = kv_slot_mapping(plan, cm.block_table_tensor, cm.slot_mapping.shape[0], block_size)
    slots = buffers.put("slot_mapping", slots, reserve=buffers.tokens)
    cm = dataclasses.replace(cm, seq_lens=seq_lens, max_seq_len=int(plan.kv_seq_lens.max()),
                             slot_mapping=slots)
    step = make_step(plan, cm.block_table_tensor, slots, block_size, buffers, graph_width)
    step = dataclasses.replace(step, device_index=ops.step_index(step, block_size, buffers),
                               last_layer=last_layer)
    if plan.prefix is not None:
        step = dataclasses.replace(step, prefix=_prefix_step(plan, step, slots, block_size, ops))
    return cm, step


def _prefix_step(plan: StepPlan, step: H2OStep, slots: torch.Tensor, block_size: int,
                 ops: DeviceOps) -> PrefixStep:
    """The step's prefix-cache work; its record phases are H2OSteps of their own (fresh
    tensors: they come at prompt boundaries, which no decode graph holds)."""
    def sub_step(sub_plan: StepPlan) -> H2OStep:
        sub = make_step(sub_plan, step.block_table, slots, block_size)
        return dataclasses.replace(sub, device_index=ops.step_index(sub, block_size))
    phases, snapshots = [], []
    for sub_plan, snaps in prefix_records.phase_plans(plan):
        phases.append(sub_step(sub_plan))
        snapshots.append(snaps)
    masked = prefix_records.masked_plan(plan)
    return prefix_records.make_prefix_step(plan, step.block_table,
                                         None if masked is None else sub_step(masked),
                                         phases, snapshots, block_size)


def graph_shaped(plan: StepPlan, graph_width: int | None) -> bool:
    """Whether a step runs graph-shaped (``make_step``): a decode-only batch, without the
    prefix cache's record phases, of an engine whose decode steps run so."""
    return graph_width is not None and plan.prefix is None and bool((plan.query_lens == 1).all())


def make_step(plan: StepPlan, block_table: torch.Tensor, kv_slots: torch.Tensor, block_size: int,
              buffers: StepBuffers | None = None, graph_width: int | None = None) -> H2OStep:
    """block_table: [>= num_rows, max_blocks] int32 on the device; kv_slots from kv_slot_mapping.
    A plan may cover only part of each row's queries (``worker.prefix_records.phase_plans``).

    ``graph_width`` (KV positions; None: eager): a decode-only step (``graph_shaped``) then
    passes every row to one due pass at least that wide, due or not, and sizes the decode
    logits by that width (``decode_width``), so that every step of a batch size launches the
    same kernels over the same buffers (docs/cuda.md, "What full CUDA graphs would need")."""
    buffers = buffers or FreshTensors(block_table.device)
    put, rows, tokens = buffers.put, buffers.rows, buffers.tokens
    query_lens, kv_seq_lens = plan.query_lens, plan.kv_seq_lens
    table = prefix_records.compact_table(plan, block_table)
    new = kv_slots[:int(query_lens.sum())]
    starts = plan.query_starts
    decode = (query_lens == 1).nonzero().flatten()
    prefill = (query_lens > 1).nonzero().flatten()
    decode_rows = decode_tokens = prefill_rows = prefill_tokens = prefill_qsl = None
    if decode.numel():
        decode_rows = put("decode_rows", decode, reserve=rows)
        decode_tokens = put("decode_tokens", starts[decode], reserve=rows)
    max_q = max_kv = 0
    if prefill.numel():
        q = query_lens[prefill]
        max_q, max_kv = int(q.max()), int(kv_seq_lens[prefill].max())
        prefill_rows = put("prefill_rows", prefill, reserve=rows)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q, 0)])
        prefill_qsl = put("prefill_query_start_loc", qsl, torch.int32, rows + 1)
        packed = torch.equal(starts[prefill], torch.cumsum(q, 0) - q)
        if decode.numel() or not packed:  # else the batch's tokens are the prefill rows', in order
            prefill_tokens = put("prefill_tokens", torch.cat([torch.arange(int(s), int(s) + int(n))
                                                              for s, n in zip(starts[prefill], q)]),
                                 reserve=tokens)
    graph = graph_shaped(plan, graph_width)
    due = due_passes(plan, table, block_size, every_row=graph, min_width=graph_width if graph else 0,
                     buffers=buffers)
    return H2OStep(
        plan=plan, block_table=block_table, kv_seq_lens=put("kv_seq_lens", kv_seq_lens, torch.int32, rows),
        new_blocks=put("new_blocks", new // block_size, reserve=tokens),
        new_offsets=put("new_offsets", new % block_size, reserve=tokens),
        decode_rows=decode_rows, decode_tokens=decode_tokens, prefill_rows=prefill_rows,
        prefill_tokens=prefill_tokens, prefill_query_start_loc=prefill_qsl,
        max_prefill_query_len=max_q, max_prefill_kv_len=max_kv,
        due=due, mass=buffers.zeros("mass", (2,)) if due else None, compact_table=table,
        decode_width=due[0].positions.shape[0] if graph else 0,
        query_weight=_fp32_to(plan.query_weights, "query_weight", buffers, tokens),
        score_scale=_fp32_to(plan.score_scale, "score_scale", buffers, rows),
        prefill_first_scored=_first_scored(plan, prefill, buffers))


def _first_scored(plan: StepPlan, prefill: torch.Tensor, buffers) -> torch.Tensor | None:
    """``H2OStep.prefill_first_scored``: the plan's, for the prefill rows."""
    if plan.first_scored is None or not prefill.numel():
        return None
    return buffers.put("prefill_first_scored", plan.first_scored[prefill], torch.int32, buffers.rows)


def _fp32_to(t: torch.Tensor | None, name: str, buffers, reserve: int) -> torch.Tensor | None:
    return None if t is None else buffers.put(name, t, torch.float32, reserve)


def prepare_scores(step: H2OStep, scores: torch.Tensor, records: torch.Tensor | None) -> None:
    """What the step's accumulation must find in place: the scores of prefix-cache hit copies
    (their record's). Before the fused attention, or inside ``update_scores_and_compact``."""
    if step.prefix is not None:
        prefix_records.init_hit_scores(step.prefix, scores, records)


def zero_new_slots(step: H2OStep, scores: torch.Tensor) -> None:
    """A slot's score starts when its K/V is written (slots are reused across requests)."""
    scores[step.new_blocks, :, step.new_offsets] = 0.0


def scoring_step(step: H2OStep) -> H2OStep:
    """The step the attention pass scores (fused or not): the step itself, or with the rows
    that write score records masked out (``worker.prefix_records``: they are scored in phases)."""
    if step.prefix is not None and step.prefix.masked is not None:
        return step.prefix.masked
    return step


def update_scores_and_compact(step: H2OStep, ops: DeviceOps, query: torch.Tensor, views: Any,
                              scores: torch.Tensor, scale: float,
                              records: torch.Tensor | None = None, *,
                              accumulated: bool = False, softcap: float = 0.0,
                              sink_logits: torch.Tensor | None = None,
                              rotary: Rotary | None = None) -> torch.Tensor | None:
    """After attention: scores of new slots start at 0 (a slot's score starts when its K/V is
    written; slots are reused across requests), add this step's probabilities (scaled and
    weighted by the score modes on a weighted step: ``H2OStep.score_scale``), compact due rows.

    ``target`` exceeds sinks + heavy + recent only when a recomputed request lands past a
    compaction point; the extra slots then go to the recent window. query: [>= num_tokens, num_q_heads,
    head_size]. Returns ``step.mass``, into which this layer added the compacted rows'
    attention mass before and after compaction ([2] fp32 on the device, summed over the step's
    layers, read once per step for the metrics); None when no row is due. With prefix caching,
    ``records`` holds the layer's score records and ``step.prefix`` says what to do with them.
    accumulated: the attention kernel has already zeroed the new slots and added this step's
    probabilities (the CUDA path's fused attention, after ``prepare_scores``).
    """
    prefix = step.prefix
    if not accumulated:
        zero_new_slots(step, scores)
        prepare_scores(step, scores, records)
        ops.accumulate(scoring_step(step), query, views, scores, scale, softcap, sink_logits)
    if prefix is not None:
        for phase, snap in zip(prefix.phases, prefix.snapshots):
            ops.accumulate(phase, query, views, scores, scale, softcap, sink_logits)
            prefix_records.snapshot(snap, scores, records)
        prefix_records.relocate(prefix, views, scores)
    for due in step.due:
        live = due_pass.live_scores(due, scores)  # [R, Hkv, width]
        ranked = live if due.key_scorer is None else key_scores(due, ops, views, step, query, scale, rotary)
        keep, keep_idx = due_pass.keep_sets(due, ranked)
        step.mass.add_(due_pass.masses(due, live, keep))
        ops.compact(views, scores, step.compact_table, due.rows, keep_idx, due.targets)
    return step.mass


class DeferredMass:
    """Attention mass of compacted rows for the metrics, read without stalling the GPU: copied
    to pinned memory behind an event, recorded once the event has passed (CPU: at once)."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, object]] = []

    def push(self, mass: torch.Tensor) -> None:
        if mass.device.type != "cuda":
            self._record(mass)
            return
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(mass, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))
        while self._pending and self._pending[0][1].query():
            self._record(self._pending.pop(0)[0])

    @staticmethod
    def _record(mass: torch.Tensor) -> None:
        total, kept = mass.tolist()
        metrics.recorder().add(evicted_attention_mass=total - kept, attention_mass=total)
