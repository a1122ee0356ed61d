"""worker.step without vLLM's engine: metadata in KV space, the step's device tensors, and one
layer's sequence run with each device's ops.

The Triton kernels (``TritonOps``) run under Triton's interpreter (TRITON_INTERPRET=1, set
before any kernel module is imported) on CPU tensors; ``CPUOps`` runs on a cache in the CPU
backend's own layout (``one_layer``). Both go through the one ``update_scores_and_compact``, so
equal results mean the two devices differ only where they should: how they read and write
the cache. Not covered here: vLLM's own kernels (tests/engine/test_cuda.py, benchmarks/gpu_check.sh).
"""
from one_layer import BLOCK, DEVICE, CPUCache, Layer, batch_plan, block_table  # isort: skip

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.oracle.cache import query_weight as oracle_query_weight
from h2o_vllm.config import Budget  # noqa: E402
from h2o_vllm.worker import step as worker_step  # noqa: E402
from h2o_vllm.worker.cpu.ops import CPUOps  # noqa: E402
from h2o_vllm.worker.cuda.ops import TritonCacheViews, TritonOps  # noqa: E402
from h2o_vllm.oracle.cache import LayerCache  # noqa: E402
from h2o_vllm.worker.plan import kv_slot_mapping  # noqa: E402
from h2o_vllm.score_modes import Decay, ExpectedAttention, KeyDiff, ObsWindow, Pooling, Score
from h2o_vllm.score_modes.rotary import Rotary

if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no GPU", allow_module_level=True)


def test_kv_slot_mapping_is_kv_space_and_keeps_padding():
    plan = batch_plan([30, 5, 0], [1, 7, 3], [20, 12, 3])
    table = block_table(3, 4)
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
    plan = batch_plan([30, 5], [1, 7], [20, 12])
    table = block_table(3, 4)  # one padding row, as under CUDA-graph padding
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
    assert [(d.rows.tolist(), d.num_heavy.tolist(), d.targets.tolist(), d.blocks.shape[1])
            for d in step.due] == [([1], [4], [8], BLOCK)]  # 12 live tokens: one block wide


def test_only_prefill_rows_use_the_batch_as_packed():
    plan = batch_plan([0, 0], [5, 3], [5, 3])
    table = block_table(2, 1)
    step = worker_step.make_step(plan, table, kv_slot_mapping(plan, table, 8, BLOCK), BLOCK)
    assert step.decode_rows is None and step.prefill_tokens is None
    assert step.prefill_query_start_loc.tolist() == [0, 5, 8]


def test_make_step_carries_the_weights_indexed_like_the_queries():
    budgets = [Budget(4, 4, 4, scoring=(Decay(0.5),)), Budget(4, 4, 4, scoring=(ObsWindow(2),))]
    plan = batch_plan([30, 0], [1, 5], [20, 5], budgets=budgets)
    table = block_table(2, 4)
    step = worker_step.make_step(plan, table, kv_slot_mapping(plan, table, 6, BLOCK), BLOCK)
    assert step.query_weight.device == table.device and step.query_weight.dtype == torch.float32
    assert step.query_weight[step.decode_tokens].tolist() == [1.0]            # decay^0
    assert step.query_weight[step.prefill_tokens].tolist() == [0, 0, 0, 1, 1]  # window of 2
    assert step.score_scale[step.decode_rows].tolist() == [0.5]
    assert step.score_scale[step.prefill_rows].tolist() == [1.0]
    paper = batch_plan([30, 0], [1, 5], [20, 5])
    step = worker_step.make_step(paper, table, kv_slot_mapping(paper, table, 6, BLOCK), BLOCK)
    assert step.query_weight is None and step.score_scale is None


PAPER = Budget(4, 4, 4)
# Rows A (prompt 20, at once) and B (prompt 13, in chunks of 8 and 5) of the cross-device
# test: paper H2O, or one row weighted (decay, observation window, sinks) beside a paper row.
BUDGETS = {"paper": (PAPER, PAPER),
           "decay-sinks": (Budget(4, 4, 4, sink_tokens=2, scoring=(Decay(0.9),)), PAPER),
           "window": (PAPER, Budget(4, 4, 4, sink_tokens=1, scoring=(Decay(0.8), ObsWindow(7)))),
           # KeyDiff ranks from the keys each device gathers from its own layout.
           "keydiff-pool": (Budget(4, 4, 4, sink_tokens=1, scoring=(Pooling(3), Score("keydiff"))), PAPER)}


@pytest.mark.parametrize("budgets", list(BUDGETS))
@pytest.mark.parametrize("group,fused", [(1, False), (3, False), (1, True), (3, True)],
                         ids=["g1", "g3", "g1-fused", "g3-fused"])
def test_one_layer_steps_agree_across_devices(group, fused, budgets):
    """A tiny layer over a whole schedule (chunked prefill beside a prompt, mixed prefill and
    decode steps, compactions at the prompt's end and every interval): write K/V at the KV
    slots, then update_scores_and_compact with the Triton kernels and with the CPU's torch
    ops; live K, V and scores must agree after every step, and the mass must be accounted.
    fused: the Triton side is the CUDA path's fused attention (TritonOps.attend, then
    update_scores_and_compact(accumulated=True)), whose output must be dense attention's."""
    torch.manual_seed(0)
    num_kv_heads, head_size, prompts = 2, 16, [20, 13]
    layer = Layer(block_table(2, 2, seed=1), num_kv_heads, head_size, fused=fused)
    # (tokens already computed, tokens this step) per row: A's prompt at once, B's in chunks.
    schedule = [[(0, 20), (0, 8)], [(20, 1), (8, 5)]] + [[(21 + i, 1), (13 + i, 1)] for i in range(7)]
    compacted = 0
    for step_rows in schedule:
        plan = batch_plan([c for c, _ in step_rows], [q for _, q in step_rows], prompts,
                          budgets=BUDGETS[budgets])
        assert plan.weighted == (budgets not in ("paper", "keydiff-pool"))
        num_tokens = int(plan.query_lens.sum())
        query = torch.randn(num_tokens + 3, num_kv_heads * group, head_size, device=DEVICE)  # padded
        new_k = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        new_v = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        mass, cpu_mass = layer.step(plan, query, new_k, new_v)
        if fused:
            torch.testing.assert_close(layer.out[:num_tokens].cpu().double(), layer.want_out,
                                       rtol=1e-5, atol=1e-5)
        compacted += int(plan.due.sum())
        for row in range(2):
            blk, off = layer.live(row, int(plan.kv_lens_after[row]))
            assert torch.equal(layer.keys.cpu()[blk, off], layer.cpu.views.keys[blk, off])
            assert torch.equal(layer.values.cpu()[blk, off], layer.cpu.views.values[blk, off])
            torch.testing.assert_close(*layer.live_scores(row, int(plan.kv_lens_after[row])),
                                       rtol=1e-5, atol=1e-5)
        if plan.due.any():
            torch.testing.assert_close(mass.cpu(), cpu_mass, rtol=1e-5, atol=1e-5)
            assert 0 < float(mass[1]) <= float(mass[0])
        else:  # nothing compacted, nothing to account
            assert mass is None and cpu_mass is None
    assert compacted >= 4  # both rows compacted after their prompt and again on the cadence


def test_compaction_keeps_recent_plus_top_heavy_per_head():
    """One due row, scores set by hand: each head keeps its own top-heavy tokens plus the
    recent window, in order, and the mass before/after is what was dropped."""
    plan = batch_plan([11], [1], [4], heavy=2, recent=2, interval=8)  # 12 live -> 4
    assert plan.due.tolist() == [True]
    table = block_table(1, 1, device="cpu")
    keys = torch.arange(BLOCK * 2 * 4, dtype=torch.float32).view(1, BLOCK, 2, 4).repeat(int(table.max()) + 1, 1, 1, 1)
    values = keys.clone() + 0.5
    cache = CPUCache(keys, values)
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


@pytest.mark.parametrize("scorer", [KeyDiff(), ExpectedAttention()], ids=["keydiff", "expected"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_key_scorer_compaction_keeps_what_the_oracle_keeps(fp8, scorer):
    """Two due rows (a prompt's first compaction, pooled; a decode step's, not), K/V in the
    cache, scores irrelevant: each head keeps what the oracle's ``LayerCache.compact`` keeps
    from the same K/V (an fp8 cache's read as fp8 * scale, as the oracle's stored_kv gives
    them back) and, for Expected Attention, each row's last queries of the step (GQA, 2 query
    heads per KV head)."""
    budget = Budget(3, 3, 4, sink_tokens=1, scoring=(Pooling(3), Score(scorer.name)))
    plan = batch_plan([0, 14], [40, 1], [40, 9], budgets=[budget, budget])
    assert plan.due.tolist() == [True, True] and plan.rank == ((Pooling(3),), ())
    assert plan.key_scorers == (scorer, scorer)
    table = block_table(2, 3, device="cpu")
    num_kv_heads, head_size, kv_scale, scale = 2, 32, 0.5, 32 ** -0.5
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(int(table.max()) + 1, BLOCK, num_kv_heads, head_size, generator=gen)
    values = torch.randn(keys.shape, generator=gen) * torch.rand(*keys.shape[:3], 1, generator=gen)
    query = torch.randn(41, 2 * num_kv_heads, head_size, generator=gen)
    rotary = Rotary(1.0 / 100.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    ops = TritonOps(head_size, torch.float8_e4m3fn if fp8 else None)
    stored_keys, stored_values = keys.clone(), values.clone()  # what attention (and the oracle) reads
    if fp8:
        ops.k_scale = ops.v_scale = kv_scale
        keys, values = (keys / kv_scale).to(torch.float8_e4m3fn), (values / kv_scale).to(torch.float8_e4m3fn)
        stored_keys, stored_values = keys.float() * kv_scale, values.float() * kv_scale

    class NoScoring(TritonOps):
        def accumulate(self, *args):  # the scores rank nothing here
            pass
    ops.__class__ = NoScoring
    step = worker_step.make_step(plan, table, kv_slot_mapping(plan, table, 41, BLOCK), BLOCK)
    scores = torch.rand(keys.shape[0], num_kv_heads, BLOCK, generator=gen)
    worker_step.update_scores_and_compact(step, ops, query, TritonCacheViews(keys, values), scores, scale,
                                          rotary=rotary)
    for row, first, queries in ((0, True, query[8:40]), (1, False, query[40:41])):
        kv_len, target = int(plan.kv_seq_lens[row]), int(plan.kv_lens_after[row])
        pos = torch.arange(kv_len)
        blocks, offsets = table[row].long()[pos // BLOCK], pos % BLOCK
        cache = LayerCache(num_kv_heads, head_size)
        cache.append(stored_keys[blocks, offsets].transpose(0, 1), stored_values[blocks, offsets].transpose(0, 1), pos)
        cache.queries, cache.scale = queries.transpose(0, 1), scale
        cache.compact(3, target - 4, 1, budget.scoring if first else (), scorer, rotary.cos_sin)
        kept = keys[blocks[:target], offsets[:target]].float().transpose(0, 1)
        assert torch.equal(kept * (kv_scale if fp8 else 1.0), cache.keys), row


def dense_step(old, keys, query, start, budget, prompt_len, group, scale):
    """The spec's closed form for one row, in fp64, from the row's keys in logical order (no
    compaction yet): queries at positions a..b (a = start) update every live token t as
    s(t) = decay^(b-a+1) * s_old(t) + sum_i decay^(b-i) * w_i * p_i(t), new tokens from 0.

    old: [a, Hkv]; keys: [b + 1, Hkv, D]; query: [b - a + 1, Hq, D]. Returns [b + 1, Hkv]."""
    end = keys.shape[0] - 1
    s = torch.cat([old, torch.zeros(end + 1 - start, keys.shape[1], dtype=torch.float64)])
    decay = (budget.mode(Decay) or Decay(1.0)).decay
    s *= decay ** (end - start + 1)
    for i in range(start, end + 1):
        w = decay ** (end - i) * oracle_query_weight(budget, i, prompt_len)
        for h in range(query.shape[1]):
            logits = keys[:i + 1, h // group].double() @ query[i - start, h].double() * scale
            s[:i + 1, h // group] += w * torch.softmax(logits, dim=0)
    return s


def test_weighted_scores_are_the_closed_form_and_paper_rows_unchanged():
    """A prompt in chunks (then decode steps) of a weighted row (decay 0.9, a 6-token window
    that starts inside chunk 3) beside a paper row: after every step both devices' scores
    equal the closed form computed densely here, and the paper row's scores are bit for bit
    those of the same schedule run as an all-paper (unweighted) batch."""
    num_kv_heads, head_size, group, prompt_len = 2, 16, 2, 20
    weighted = Budget(16, 16, 4, scoring=(Decay(0.9), ObsWindow(6)))  # budgets past 23: no compaction
    runs = {"mixed": (weighted, Budget(16, 16, 4)), "paper": (Budget(16, 16, 4),) * 2}
    layers = {name: Layer(block_table(2, 2, seed=3), num_kv_heads, head_size) for name in runs}
    # Row 0's one-token chunk at position 7 runs as a decode row and weighs 0 (before the window).
    schedule = [[(0, 7), (0, 10)], [(7, 1), (10, 10)], [(8, 7), (20, 1)], [(15, 5), (21, 1)],
                [(20, 1), (22, 1)], [(21, 1), (23, 1)]]
    gen = torch.Generator().manual_seed(4)
    keys = [torch.zeros(0, num_kv_heads, head_size) for _ in range(2)]
    dense = [torch.zeros(0, num_kv_heads, dtype=torch.float64) for _ in range(2)]
    for step_rows in schedule:
        computed, q_lens = [c for c, _ in step_rows], [q for _, q in step_rows]
        num_tokens = sum(q_lens)
        query = torch.randn(num_tokens, num_kv_heads * group, head_size, generator=gen)
        new_k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
        new_v = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
        plans = {name: batch_plan(computed, q_lens, [prompt_len] * 2, budgets=list(budgets))
                 for name, budgets in runs.items()}
        assert plans["mixed"].weighted and not plans["paper"].weighted
        for name, layer in layers.items():
            assert not plans[name].due.any()
            layer.step(plans[name], query.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE))
        start = 0
        for row, (budget, q_len) in enumerate(zip(runs["mixed"], q_lens)):
            keys[row] = torch.cat([keys[row], new_k[start:start + q_len]])
            dense[row] = dense_step(dense[row], keys[row], query[start:start + q_len],
                                    computed[row], budget, prompt_len, group, layers["mixed"].scale)
            start += q_len
            kv_len = computed[row] + q_len
            for got in layers["mixed"].live_scores(row, kv_len):
                torch.testing.assert_close(got, dense[row].float(), rtol=1e-5, atol=1e-6)
        if computed[0] == 0:  # chunk 1 lies before the window: its queries add nothing
            assert all(not got.any() for got in layers["mixed"].live_scores(0, q_lens[0]))
        for mixed, paper in zip(layers["mixed"].live_scores(1, computed[1] + q_lens[1]),
                                layers["paper"].live_scores(1, computed[1] + q_lens[1])):
            assert torch.equal(mixed, paper)


def test_long_decode_rows_split_their_keys_and_agree_across_devices(monkeypatch):
    """Two rows past 256 keys decoding alone: the fused attention splits each row's keys
    (kernels.h2o_split_decode, two splits), and the output, K, V and scores after each step
    still equal dense attention's and the CPU ops' (compactions on the cadence included)."""
    from h2o_vllm.kernels import split_decode
    calls = []
    launch = split_decode.h2o_split_decode
    monkeypatch.setattr(split_decode, "h2o_split_decode",
                        lambda *a, **kw: calls.append(kw["num_splits"]) or launch(*a, **kw))
    torch.manual_seed(0)
    num_kv_heads, head_size, prompts = 2, 16, [280, 300]
    layer = Layer(block_table(2, 20, seed=2), num_kv_heads, head_size, fused=True)
    budget = (Budget(140, 140, 8),) * 2  # 280 kept: decode rows of 281-288 keys, compacting at 288
    schedule = [[(0, 280), (0, 300)]] + [[(280 + i, 1), (300 + i, 1)] for i in range(9)]
    for step_rows in schedule:
        plan = batch_plan([c for c, _ in step_rows], [q for _, q in step_rows], prompts, budgets=budget)
        num_tokens = int(plan.query_lens.sum())
        query = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        new_k, new_v = (torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE) for _ in range(2))
        layer.step(plan, query, new_k, new_v)
        torch.testing.assert_close(layer.out.cpu().double(), layer.want_out, rtol=1e-5, atol=1e-5)
        for row in range(2):
            torch.testing.assert_close(*layer.live_scores(row, int(plan.kv_lens_after[row])),
                                       rtol=1e-5, atol=1e-5)
    assert calls == [2] * 9
