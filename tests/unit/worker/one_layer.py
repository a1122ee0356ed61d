"""A tiny attention layer's H2O state on both devices, for the worker tests (tests/unit/worker).

The same K, V and scores are held in the Triton kernels' layout (``TritonOps``; under
Triton's interpreter without a GPU) and in the CPU backend's own layout (``CPUOps``), and
``Layer.step`` runs one worker step on both through the one ``update_scores_and_compact``.
TRITON_INTERPRET must be set before any kernel module is imported, hence the setdefault.
"""
import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from h2o_vllm.config import Budget  # noqa: E402
from h2o_vllm.worker import step as worker_step  # noqa: E402
from h2o_vllm.worker.cpu.ops import CPUOps  # noqa: E402
from h2o_vllm.worker.cuda.ops import TritonCacheViews, TritonOps  # noqa: E402
from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
BLOCK = 16


def batch_plan(num_computed, query_lens, prompt_lens, heavy=4, recent=4, interval=4, budgets=None):
    """The step plan of one batch; every row gets Budget(heavy, recent, interval) unless
    ``budgets`` gives each row's."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    budgets = budgets or [Budget(heavy, recent, interval)] * len(num_computed)
    return make_step_plan(t(num_computed), t(query_lens), t(prompt_lens), budgets)


def block_table(num_rows, blocks_per_row, seed=0, device=DEVICE):
    perm = torch.randperm(num_rows * blocks_per_row + 1, generator=torch.Generator().manual_seed(seed))
    perm = perm[perm != 0][: num_rows * blocks_per_row]  # block 0 is never a row's
    return perm.view(num_rows, blocks_per_row).to(torch.int32).to(device)


class CPUCache:
    """A cache in the CPU backend's layout ([num_blocks, num_kv_heads, block_size, 2 * head],
    K stored transposed) holding the same K and V as the kernels' layout."""

    def __init__(self, keys, values):
        num_blocks, block_size, num_kv_heads, head_size = keys.shape
        self.kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size)
        self.views = CPUOps().cache_views(self.kv_cache)
        self.views.keys.copy_(keys.cpu())
        self.views.values.copy_(values.cpu())


class Layer:
    """One layer's K, V and scores, equal on both devices at the start (random, and random
    stale scores, so that zeroing the new slots is checked)."""

    def __init__(self, table, num_kv_heads, head_size, seed=0, fused=False):
        """fused: the Triton side runs the CUDA path's fused attention (TritonOps.attend),
        which also writes ``self.out`` (``self.want_out``: dense attention's, computed before);
        else its unfused accumulate, like the CPU side."""
        self.fused, self.out, self.want_out = fused, None, None
        gen = torch.Generator().manual_seed(seed)
        shape = (int(table.max()) + 1, BLOCK, num_kv_heads, head_size)
        self.table, self.scale = table, head_size ** -0.5
        self.keys = torch.randn(shape, generator=gen).to(DEVICE)
        self.values = torch.randn(shape, generator=gen).to(DEVICE)
        self.scores = torch.rand(shape[0], num_kv_heads, BLOCK, generator=gen).to(DEVICE)
        self.cpu = CPUCache(self.keys, self.values)
        self.cpu_scores = self.scores.cpu().clone()
        self.triton_ops, self.cpu_ops = TritonOps(head_size), CPUOps()

    def step(self, plan, query, new_k, new_v):
        """Write this step's K/V at the KV-space slots, then the per-layer sequence on each
        device. query: [>= num_tokens, num_q_heads, head_size] (padding allowed). Returns
        the attention mass of each device (Triton's, the CPU's)."""
        num_tokens = int(plan.query_lens.sum())
        slots = kv_slot_mapping(plan, self.table, query.shape[0], BLOCK)
        cpu = self.cpu.views
        for k_cache, v_cache in ((self.keys, self.values), (cpu.keys, cpu.values)):
            s = slots[:num_tokens].to(k_cache.device)
            k_cache[s // BLOCK, s % BLOCK] = new_k.to(k_cache.device)
            v_cache[s // BLOCK, s % BLOCK] = new_v.to(k_cache.device)
        step = worker_step.make_step(plan, self.table, slots, BLOCK)
        views = TritonCacheViews(self.keys, self.values)
        if self.fused:  # the reference first: compaction moves K/V once attention is done
            self.want_out = dense_attention(plan, query, self.keys, self.values, self.table)
            step = dataclasses.replace(step, device_index=self.triton_ops.step_index(step, BLOCK))
            starts = torch.cat([torch.zeros(1, dtype=torch.int64), plan.query_lens.cumsum(0)])
            self.out = torch.full_like(query, float("nan"))
            self.triton_ops.attend(step, query, views, self.out, self.scores, self.scale,
                                   starts.to(torch.int32).to(DEVICE))
        mass = worker_step.update_scores_and_compact(
            step, self.triton_ops, query, views, self.scores, self.scale, accumulated=self.fused)
        cpu_step = worker_step.make_step(plan, self.table.cpu(), slots.cpu(), BLOCK)
        cpu_step = dataclasses.replace(cpu_step, device_index=self.cpu_ops.step_index(cpu_step, BLOCK))
        cpu_mass = worker_step.update_scores_and_compact(cpu_step, self.cpu_ops, query.cpu(),
                                                         self.cpu.views, self.cpu_scores, self.scale)
        return mass, cpu_mass

    def live(self, row, kv_len):
        """(block, offset) of a row's first kv_len KV positions, on the CPU."""
        pos = torch.arange(kv_len)
        return self.table.cpu()[row].long()[pos // BLOCK], pos % BLOCK

    def live_scores(self, row, kv_len):
        """Scores [kv_len, num_kv_heads] of a row's live KV positions: (Triton's, the CPU's)."""
        blk, off = self.live(row, kv_len)
        return self.scores.cpu()[blk, :, off], self.cpu_scores[blk, :, off]


def dense_attention(plan, query, keys, values, table):
    """Causal softmax attention of each row's queries over its live keys (KV positions
    [0, kv_seq_len), this step's included), fp64 torch; [num_tokens, num_q_heads, head_size]."""
    out = []
    for row in range(plan.query_lens.shape[0]):
        q_len, kv_len = int(plan.query_lens[row]), int(plan.kv_seq_lens[row])
        start = int(plan.query_starts[row])
        pos = torch.arange(kv_len)
        blk = table.cpu()[row].long()[pos // BLOCK]
        k, v = (c.cpu()[blk, pos % BLOCK].double() for c in (keys, values))  # [kv, Hkv, D]
        q = query.cpu()[start:start + q_len].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        visible = pos[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        p = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(out)
