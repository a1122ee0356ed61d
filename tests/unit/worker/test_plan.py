"""worker.plan: the per-step plan of a batch, from the rows' logical counts and Budgets."""
from types import SimpleNamespace

import pytest
import torch

from h2o_vllm.oracle.cache import query_weight as oracle_query_weight
from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.config import Budget, H2OConfig
from h2o_vllm.policy import kv_len_after
from h2o_vllm.worker import plan as step_plan
from h2o_vllm.score_modes import Decay, ObsWindow, Pooling

t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


def test_make_step_plan_rows_follow_kv_len_after():
    budgets = [Budget(4, 4, 16), Budget(2, 2, 1), Budget(100, 100, 16)]
    computed, query, prompt = [40, 9, 0], [1, 1, 30], [30, 9, 30]
    plan = step_plan.make_step_plan(t(computed), t(query), t(prompt), budgets)
    for row, budget in enumerate(budgets):
        before = kv_len_after(computed[row], prompt[row], budget)
        after = kv_len_after(computed[row] + query[row], prompt[row], budget)
        assert int(plan.kv_lens_before[row]) == before
        assert int(plan.kv_seq_lens[row]) == before + query[row]
        assert int(plan.kv_lens_after[row]) == after
        assert bool(plan.due[row]) == (after < before + query[row])
    assert plan.query_starts.tolist() == [0, 1, 2]
    assert plan.heavy.tolist() == [4, 2, 100]
    assert plan.due.tolist() == [False, True, False]


def test_plan_batch_reads_each_requests_resolved_budget_and_prunes():
    book = RequestBudgets(H2OConfig(heavy_tokens=4, recent_tokens=4), block_size=16)
    book.resolve("a", 20)
    book.resolve("b", 20, SimpleNamespace(extra_args={"h2o_interval": 1}))
    for _ in range(2):
        plan = step_plan.plan_batch(book, ["a", "b"], t([30, 30]), t([20, 20]), t([1, 1]),
                                    live_request_ids=["a", "b"])
    assert book.resolve("b", 20).interval == 1 and book.resolve("a", 20).interval == 16
    assert plan.kv_lens_after.tolist() == [kv_len_after(31, 20, Budget(4, 4, 16)),
                                           kv_len_after(31, 20, Budget(4, 4, 1))]
    for i in range(300):  # finished requests the runner no longer holds are dropped eventually
        book.resolve(f"gone-{i}", 10)
    step_plan.plan_batch(book, ["a"], t([30]), t([20]), t([1]), live_request_ids=["a"])
    assert len(book) == 1


def test_rows_to_truncate_keeps_the_blocks_of_the_new_length():
    plan = step_plan.make_step_plan(t([20, 5]), t([1, 1]), t([20, 5]), [Budget(2, 2, 1)] * 2)
    assert plan.due.tolist() == [True, True]
    assert step_plan.rows_to_truncate(plan, 4) == [(0, 1, None), (1, 1, None)]
    assert step_plan.rows_to_truncate(plan, 3) == [(0, 2, None), (1, 2, None)]


def test_record_compactions_counts_evicted_tokens(monkeypatch):
    from h2o_vllm import metrics
    recorder = metrics.Recorder(None)
    monkeypatch.setattr(metrics, "recorder", lambda: recorder)
    # Row 0 prefills its whole 20-token prompt (20 -> 4 live); row 1 is still in its prompt.
    plan = step_plan.make_step_plan(t([0, 3]), t([20, 1]), t([20, 10]), [Budget(2, 2, 1)] * 2)
    step_plan.record_compactions(plan)
    assert recorder.values == {"evicted_tokens": 16, "compactions": 1}


def test_paper_budgets_make_an_unweighted_step():
    plan = step_plan.make_step_plan(t([0, 30]), t([20, 1]), t([20, 30]), [Budget(2, 2, 1)] * 2)
    assert plan.query_weights is None and plan.score_scale is None and not plan.weighted
    assert plan.query_scale.tolist() == [1.0, 1.0] and plan.query_scale.dtype == torch.float32
    # A window only weighs prompt queries: past the prompt with decay 1 the step is the paper's.
    plan = step_plan.make_step_plan(t([30]), t([1]), t([30]), [Budget(2, 2, 1, scoring=(ObsWindow(4),))])
    assert plan.query_weights is None and plan.score_scale is None


def test_query_weights_follow_budget_query_weight_and_decay():
    """Token j of row r (logical position i = num_computed[r] + j, last position b) weighs
    decay^(b - i) * oracle_query_weight(budget, i, prompt_len); each row's old scores decay^q_len."""
    budgets = [Budget(2, 2, 1, scoring=(Decay(0.9), ObsWindow(5))), Budget(2, 2, 1),
               Budget(2, 2, 1, sink_tokens=1, scoring=(ObsWindow(3),)), Budget(2, 2, 1, scoring=(Decay(0.5),)),
               Budget(2, 2, 1, prefill_chunk=4, scoring=(ObsWindow(2),))]
    # Row 0 straddles its window; row 4 (chunks of 4, each scored by its last 2) two chunks.
    computed, query, prompt = [4, 0, 2, 40, 2], [6, 3, 1, 1, 5], [12, 3, 7, 30, 11]
    plan = step_plan.make_step_plan(t(computed), t(query), t(prompt), budgets)
    assert plan.weighted and plan.query_weights.dtype == plan.score_scale.dtype == torch.float32
    expected = []
    for budget, start, q_len, prompt_len in zip(budgets, computed, query, prompt):
        last, decay = start + q_len - 1, (budget.mode(Decay) or Decay(1.0)).decay
        expected += [decay ** (last - i) * oracle_query_weight(budget, i, prompt_len)
                     for i in range(start, start + q_len)]
    assert plan.query_weights.tolist() == pytest.approx(expected, rel=1e-6)
    assert plan.query_weights.tolist()[:3] == [0.0, 0.0, 0.0]        # row 0: before its window
    assert plan.query_weights.tolist()[6:9] == [1.0, 1.0, 1.0]      # the paper row
    assert plan.query_weights.tolist()[9] == 0.0                     # row 2: before its window
    assert plan.query_weights.tolist()[11:16] == [1.0, 1.0, 0.0, 0.0, 1.0]  # positions 2..6
    assert plan.score_scale.tolist() == pytest.approx([0.9 ** 6, 1.0, 1.0, 0.5, 1.0], rel=1e-6)
    assert plan.query_scale.tolist() == pytest.approx([0.9, 1.0, 1.0, 0.5, 1.0])


def test_pooling_ranks_only_each_rows_first_compaction():
    # Budget 4 (2 + 2), interval 2: a 10-token prompt first compacts at its prefill (row 0); a
    # 3-token prompt at 6 tokens (row 1, at its first due decode); rows 2 and 3 compacted before.
    budget = Budget(2, 2, 2, scoring=(Pooling(5),))
    plan = step_plan.make_step_plan(t([0, 5, 11, 6]), t([10, 1, 1, 1]), t([10, 3, 10, 3]), [budget] * 4)
    assert plan.due.tolist() == [True, True, True, False]
    assert plan.rank == ((Pooling(5),), (Pooling(5),), (), ())


def test_a_chunked_prompt_compacts_at_chunk_ends_and_pools_only_the_first():
    # Budget 4 + interval 2, chunks of 5, a 20-token prompt: the chunk ending at 10 compacts
    # first (pooled), the one ending at 15 again (4 + 5 >= 6); a step ending mid-chunk never does.
    budget = Budget(2, 2, 2, prefill_chunk=5, scoring=(Pooling(3),))
    plan = step_plan.make_step_plan(t([5, 10, 10, 15]), t([5, 5, 3, 5]), t([20] * 4), [budget] * 4)
    assert plan.kv_lens_before.tolist() == [5, 4, 4, 4]
    assert plan.kv_lens_after.tolist() == [4, 4, 7, 4]
    assert plan.due.tolist() == [True, True, False, True]
    assert plan.rank == ((Pooling(3),), (), (), ())
