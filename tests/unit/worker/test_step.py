"""worker.step without vLLM's engine: metadata in KV space, the step's device tensors, and one
layer's sequence run with each device's ops.

The Triton kernels (``TritonOps``) run under Triton's interpreter (TRITON_INTERPRET=1, set
before any kernel module is imported) on CPU tensors; ``CPUOps`` runs on a cache in the CPU
backend's own layout. Both go through the one ``update_scores_and_compact``, so equal results
mean the two devices differ only where they should: how they read and write the cache.
Not covered here: vLLM's own kernels (tests/engine/test_cuda.py, benchmarks/gpu_check.sh).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.config import Budget  # noqa: E402
from h2o_vllm.worker import step as worker_step  # noqa: E402
from h2o_vllm.worker.cpu.ops import CPUOps  # noqa: E402
from h2o_vllm.worker.cuda.ops import TritonCacheViews, TritonOps  # noqa: E402
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan  # noqa: E402

if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no GPU", allow_module_level=True)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
BLOCK = 16


def _plan(num_computed, query_lens, prompt_lens, heavy=4, recent=4, interval=4):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    budgets = [Budget(heavy, recent, interval)] * len(num_computed)
    return make_step_plan(t(num_computed), t(query_lens), t(prompt_lens), budgets)


def _block_table(num_rows, blocks_per_row, seed=0, device=DEVICE):
    perm = torch.randperm(num_rows * blocks_per_row + 1, generator=torch.Generator().manual_seed(seed))
    perm = perm[perm != 0][: num_rows * blocks_per_row]  # block 0 is never a row's
    return perm.view(num_rows, blocks_per_row).to(torch.int32).to(device)


def test_kv_slot_mapping_is_kv_space_and_keeps_padding():
    plan = _plan([30, 5, 0], [1, 7, 3], [20, 12, 3])
    table = _block_table(3, 4)
    slots = kv_slot_mapping(plan, table, int(plan.query_lens.sum()) + 5, BLOCK)
    assert slots.shape == (16,) and slots.device == table.device
    assert (slots[11:] == -1).all()
    for row, first in ((0, 0), (1, 1), (2, 8)):
        kv = int(plan.kv_lens_before[row]) + torch.arange(int(plan.query_lens[row]))
        expected = table[row].long().cpu()[kv // BLOCK] * BLOCK + kv % BLOCK
        assert slots[first:first + len(kv)].cpu().tolist() == expected.tolist()
    # Row 0 decodes past its first compaction: its new token sits right after the live window.
    assert int(plan.kv_lens_before[0]) < 30


def test_kv_space_metadata_rewrites_lengths_and_slots_keeps_positions():
    from vllm.v1.attention.backend import CommonAttentionMetadata
    plan = _plan([30, 5], [1, 7], [20, 12])
    table = _block_table(3, 4)  # one padding row, as under CUDA-graph padding
    num_tokens = 8
    positions = torch.tensor([30, 5, 6, 7, 8, 9, 10, 11], device=DEVICE)
    logical_seq_lens = torch.tensor([31, 12, 0], dtype=torch.int32, device=DEVICE)
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 8, 8], dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=torch.tensor([0, 1, 8, 8], dtype=torch.int32),
        seq_lens=logical_seq_lens, num_reqs=2, num_actual_tokens=num_tokens, max_query_len=7,
        max_seq_len=31, block_table_tensor=table,
        slot_mapping=torch.zeros(num_tokens + 2, dtype=torch.int64, device=DEVICE),
        positions=positions)
    out, step = worker_step.kv_space_metadata(cm, plan, BLOCK, TritonOps(16))
    assert out.seq_lens.tolist() == plan.kv_seq_lens.tolist() + [0]
    assert out.seq_lens.dtype == torch.int32 and out.max_seq_len == int(plan.kv_seq_lens.max())
    assert out.positions is positions and out.query_start_loc is cm.query_start_loc
    assert logical_seq_lens.tolist() == [31, 12, 0]  # vLLM's tensor is not written through
    assert out.slot_mapping.shape == cm.slot_mapping.shape and (out.slot_mapping[8:] == -1).all()
    assert step.kv_seq_lens.tolist() == plan.kv_seq_lens.tolist()
    assert step.decode_rows.tolist() == [0] and step.decode_tokens.tolist() == [0]
    assert step.prefill_rows.tolist() == [1] and step.prefill_tokens.tolist() == list(range(1, 8))
    assert step.prefill_query_start_loc.tolist() == [0, 7]
    new = out.slot_mapping[:8]
    assert step.new_blocks.tolist() == (new // BLOCK).tolist()
    # Row 1 ends its 12-token prompt here: compacted to heavy + recent = 8 in this step.
    assert plan.due.tolist() == [False, True]
    assert [(g.rows.tolist(), g.heavy, g.target, g.blocks.shape[1]) for g in step.due] == [([1], 4, 8, 12)]


def test_only_prefill_rows_use_the_batch_as_packed():
    plan = _plan([0, 0], [5, 3], [5, 3])
    table = _block_table(2, 1)
    step = worker_step.make_step(plan, table, kv_slot_mapping(plan, table, 8, BLOCK), BLOCK)
    assert step.decode_rows is None and step.prefill_tokens is None
    assert step.prefill_query_start_loc.tolist() == [0, 5, 8]


class _CPUCache:
    """A cache in the CPU backend's layout ([num_blocks, num_kv_heads, block_size, 2 * head],
    K stored transposed) holding the same K and V as the kernels' layout."""

    def __init__(self, keys, values):
        num_blocks, block_size, num_kv_heads, head_size = keys.shape
        self.kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size)
        self.views = CPUOps().cache_views(self.kv_cache)
        self.views.keys.copy_(keys.cpu())
        self.views.values.copy_(values.cpu())


@pytest.mark.parametrize("group", [1, 3])
def test_one_layer_steps_agree_across_devices(group):
    """A tiny layer over a whole schedule (chunked prefill beside a prompt, mixed prefill and
    decode steps, compactions at the prompt's end and every interval): write K/V at the KV
    slots, then update_scores_and_compact with the Triton kernels and with the CPU's torch
    ops; live K, V and scores must agree after every step, and the mass must be accounted."""
    torch.manual_seed(0)
    num_kv_heads, head_size, prompts = 2, 16, [20, 13]
    scale = head_size ** -0.5
    table = _block_table(2, 2, seed=1)
    num_blocks = int(table.max()) + 1
    shape = (num_blocks, BLOCK, num_kv_heads, head_size)
    keys, values = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    scores = torch.rand(num_blocks, num_kv_heads, BLOCK, device=DEVICE)  # stale values
    cpu = _CPUCache(keys, values)
    cpu_scores = scores.clone().cpu()
    triton_ops, cpu_ops = TritonOps(head_size), CPUOps()
    # (tokens already computed, tokens this step) per row: A's prompt at once, B's in chunks.
    schedule = [[(0, 20), (0, 8)], [(20, 1), (8, 5)]] + [[(21 + i, 1), (13 + i, 1)] for i in range(7)]
    compacted = 0
    for step_rows in schedule:
        plan = _plan([c for c, _ in step_rows], [q for _, q in step_rows], prompts)
        num_tokens = int(plan.query_lens.sum())
        query = torch.randn(num_tokens + 3, num_kv_heads * group, head_size, device=DEVICE)  # padded
        slots = kv_slot_mapping(plan, table, num_tokens + 3, BLOCK)
        new_k = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        new_v = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        for k_cache, v_cache in ((keys, values), (cpu.views.keys, cpu.views.values)):  # K/V write
            s = slots[:num_tokens].to(k_cache.device)
            k_cache[s // BLOCK, s % BLOCK] = new_k.to(k_cache.device)
            v_cache[s // BLOCK, s % BLOCK] = new_v.to(k_cache.device)
        step = worker_step.make_step(plan, table, slots, BLOCK)
        mass = worker_step.update_scores_and_compact(step, triton_ops, query, TritonCacheViews(keys, values),
                                                     scores, scale)
        cpu_table = table.cpu()
        cpu_step = worker_step.make_step(plan, cpu_table, slots.cpu(), BLOCK)
        cpu_step = worker_step.dataclasses.replace(cpu_step, device_index=cpu_ops.step_index(cpu_step, BLOCK))
        cpu_mass = worker_step.update_scores_and_compact(cpu_step, cpu_ops, query.cpu(), cpu.views,
                                                         cpu_scores, scale)
        compacted += int(plan.due.sum())
        for row in range(2):
            pos = torch.arange(int(plan.kv_lens_after[row]))
            blk, off = cpu_table[row].long()[pos // BLOCK], pos % BLOCK
            assert torch.equal(keys.cpu()[blk, off], cpu.views.keys[blk, off])
            assert torch.equal(values.cpu()[blk, off], cpu.views.values[blk, off])
            torch.testing.assert_close(scores.cpu()[blk, :, off], cpu_scores[blk, :, off],
                                       rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mass.cpu(), cpu_mass, rtol=1e-5, atol=1e-5)
        if plan.due.any():
            assert 0 < float(mass[1]) <= float(mass[0])
        else:
            assert mass.tolist() == [0.0, 0.0]
    assert compacted >= 4  # both rows compacted after their prompt and again on the cadence


def test_compaction_keeps_recent_plus_top_heavy_per_head():
    """One due row, scores set by hand: each head keeps its own top-heavy tokens plus the
    recent window, in order, and the mass before/after is what was dropped."""
    plan = _plan([11], [1], [4], heavy=2, recent=2, interval=8)  # 12 live -> 4
    assert plan.due.tolist() == [True]
    table = _block_table(1, 1, device="cpu")
    keys = torch.arange(BLOCK * 2 * 4, dtype=torch.float32).view(1, BLOCK, 2, 4).repeat(int(table.max()) + 1, 1, 1, 1)
    values = keys.clone() + 0.5
    cache = _CPUCache(keys, values)
    scores = torch.zeros(keys.shape[0], 2, BLOCK)
    blk = int(table[0, 0])
    scores[blk, 0, :12] = torch.tensor([9, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0.])
    scores[blk, 1, :12] = torch.tensor([0, 7, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0.])

    class NoScoring(CPUOps):
        def accumulate(self, *args):  # the hand-set scores stay as they are
            pass
    ops = NoScoring()
    step = worker_step.make_step(plan, table, kv_slot_mapping(plan, table, 1, BLOCK), BLOCK)
    scores[blk, :, 11] = 0  # the new token's slot is zeroed by the step anyway
    mass = worker_step.update_scores_and_compact(step, ops, torch.zeros(1, 2, 4), cache.views, scores, 1.0)
    kept = {0: [0, 3, 10, 11], 1: [1, 5, 10, 11]}
    for head, positions in kept.items():
        assert torch.equal(cache.views.keys[blk, :4, head], keys[blk, positions, head])
        assert torch.equal(cache.views.values[blk, :4, head], values[blk, positions, head])
    assert mass.tolist() == [30.0, 30.0]  # everything with a score was kept
