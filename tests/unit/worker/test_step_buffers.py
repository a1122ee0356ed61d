"""worker.step_buffers: a step's device tensors written into buffers allocated once, at the same
address at every step (what a CUDA graph replays; docs/cuda.md, "What full CUDA graphs would
need"), holding what fresh tensors would."""
import dataclasses

import torch

from h2o_vllm.config import Budget
from h2o_vllm.score_modes import Pooling
from h2o_vllm.worker import step as worker_step
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan
from h2o_vllm.worker.step_buffers import StepBuffers

BLOCK = 16


def test_a_name_keeps_its_address_for_any_size_and_grows_only_when_exceeded():
    buffers = StepBuffers("cpu", rows=8, tokens=32)
    first = buffers.put("rows", torch.tensor([3, 1, 2]), reserve=buffers.rows)
    second = buffers.put("rows", torch.tensor([5, 4, 3, 2, 1, 0, 7, 6]), reserve=buffers.rows)
    assert first.data_ptr() == second.data_ptr()
    assert second.tolist() == [5, 4, 3, 2, 1, 0, 7, 6] and second.is_contiguous()
    table = buffers.put("table", torch.arange(6).view(2, 3), torch.int32, reserve=12)
    assert table.shape == (2, 3) and table.dtype == torch.int32 and table.tolist() == [[0, 1, 2], [3, 4, 5]]
    wider = buffers.put("table", torch.ones(3, 4), torch.int32, reserve=12)
    assert wider.data_ptr() == table.data_ptr()
    grown = buffers.put("rows", torch.arange(9), reserve=buffers.rows)  # past the engine's rows
    assert grown.data_ptr() != first.data_ptr() and grown.tolist() == list(range(9))
    assert buffers.put("rows", torch.arange(2), reserve=buffers.rows).data_ptr() == grown.data_ptr()
    mass = buffers.zeros("mass", (2,))
    mass += 3
    assert buffers.zeros("mass", (2,)).tolist() == [0.0, 0.0]


def _tensors(step):
    """(name, tensor) of every device tensor a step's layers read, the due passes' included."""
    out = [(f.name, getattr(step, f.name)) for f in dataclasses.fields(step)
           if isinstance(getattr(step, f.name), torch.Tensor) and f.name != "block_table"]
    for i, due in enumerate(step.due):
        out += [(f"due{i}.{f.name}", getattr(due, f.name)) for f in dataclasses.fields(due)
                if isinstance(getattr(due, f.name), torch.Tensor)]
        out += [(f"due{i}.rank{j}", rows) for j, (_, rows) in enumerate(due.rank)]
    return out


def test_graph_shaped_steps_of_a_batch_size_keep_every_address_and_hold_fresh_values():
    """Decode steps of 3 rows, graph-shaped (every row, one width), then of 2 rows, then a mixed
    prefill step: every tensor of every step equals the fresh one make_step builds without
    buffers (graph-shaped too), and each name keeps one address across all the steps."""
    budgets = [Budget(4, 4, 4), Budget(3, 5, 2, sink_tokens=1, scoring=(Pooling(3),)), Budget(6, 6, 8)]
    prompts = torch.tensor([12, 9, 20])
    table = torch.arange(1, 1 + 3 * 8, dtype=torch.int32).view(3, 8)
    buffers = StepBuffers("cpu", rows=4, tokens=64)
    addresses, due_seen = {}, set()
    batches = [(slice(0, 3), torch.ones(3, dtype=torch.int64), i) for i in range(12)]
    batches += [(slice(0, 2), torch.ones(2, dtype=torch.int64), i) for i in range(12, 16)]
    batches += [(slice(0, 3), torch.tensor([1, 5, 1]), 16)]
    for rows, query_lens, i in batches:
        plan = make_step_plan(prompts[rows] + i, query_lens, prompts[rows], budgets[rows])
        slots = kv_slot_mapping(plan, table, int(query_lens.sum()), BLOCK)
        fresh = worker_step.make_step(plan, table, slots, BLOCK, graph_width=64)
        kept = worker_step.make_step(plan, table, buffers.put("slot_mapping", slots, reserve=64),
                                     BLOCK, buffers, graph_width=64)
        due_seen.add(tuple(plan.due.tolist()))
        assert [n for n, _ in _tensors(kept)] == [n for n, _ in _tensors(fresh)]
        for (name, got), (_, want) in zip(_tensors(kept), _tensors(fresh)):
            assert got.dtype == want.dtype and torch.equal(got, want), name
            assert addresses.setdefault(name, got.data_ptr()) == got.data_ptr(), name
        if bool((query_lens == 1).all()):
            (due,) = kept.due
            assert due.rows.shape == query_lens.shape and due.positions.shape == (64,)
            assert kept.decode_width == 64 and kept.mass is not None
    assert len(due_seen) >= 3  # rows due alone, together, and none
    assert "prefill_rows" in addresses and "due0.rank0" in addresses
