"""worker.plan: the per-step plan of a batch, from the rows' logical counts and Budgets."""
import torch

from h2o_vllm.budgets import RequestBudgets
from h2o_vllm.config import Budget, H2OConfig
from h2o_vllm.policy import kv_len_after
from h2o_vllm.worker import plan as step_plan

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


def test_plan_batch_resolves_each_request_once_and_prunes():
    book = RequestBudgets(H2OConfig(heavy_tokens=4, recent_tokens=4), block_size=16)
    asked = []

    def extra_args_of(req_id):
        asked.append(req_id)
        return {"h2o_interval": 1} if req_id == "b" else None
    for _ in range(2):
        plan = step_plan.plan_batch(book, ["a", "b"], t([30, 30]), t([20, 20]), t([1, 1]),
                                    extra_args_of, live_request_ids=["a", "b"])
    assert book.resolve("b", 20).interval == 1 and book.resolve("a", 20).interval == 16
    assert plan.kv_lens_after.tolist() == [kv_len_after(31, 20, Budget(4, 4, 16)),
                                           kv_len_after(31, 20, Budget(4, 4, 1))]
    for i in range(300):  # finished requests the runner no longer holds are dropped eventually
        book.resolve(f"gone-{i}", 10)
    step_plan.plan_batch(book, ["a"], t([30]), t([20]), t([1]), extra_args_of, live_request_ids=["a"])
    assert len(book) == 1


def test_rows_to_truncate_keeps_the_blocks_of_the_new_length():
    plan = step_plan.make_step_plan(t([20, 5]), t([1, 1]), t([20, 5]), [Budget(2, 2, 1)] * 2)
    assert plan.due.tolist() == [True, True]
    assert step_plan.rows_to_truncate(plan, 4) == [(0, 1), (1, 1)]
    assert step_plan.rows_to_truncate(plan, 3) == [(0, 2), (1, 2)]


def test_current_plan_is_set_only_inside_the_context():
    plan = step_plan.make_step_plan(t([0]), t([3]), t([3]), [Budget(1, 1, 1)])
    assert step_plan.current() is None
    with step_plan.current_plan(plan):
        assert step_plan.current() is plan
    assert step_plan.current() is None


def test_record_compactions_counts_evicted_tokens(monkeypatch):
    from h2o_vllm import metrics
    recorder = metrics.Recorder(None)
    monkeypatch.setattr(metrics, "recorder", lambda: recorder)
    # Row 0 prefills its whole 20-token prompt (20 -> 4 live); row 1 is still in its prompt.
    plan = step_plan.make_step_plan(t([0, 3]), t([20, 1]), t([20, 10]), [Budget(2, 2, 1)] * 2)
    step_plan.record_compactions(plan)
    assert recorder.values == {"evicted_tokens": 16, "compactions": 1}
