"""budgets.RequestBudgets: each request's Budget resolved once (``request_budget``), from the
engine config and its own sampling params' ``extra_args``, with the default interval one KV block."""
import pytest
from vllm import SamplingParams

from h2o_vllm.budgets import RequestBudgets, request_budget
from h2o_vllm.config import Budget, H2OConfig

ENGINE = H2OConfig(heavy_ratio=0.1, recent_ratio=0.1, min_tokens=0)  # the paper's rule, no floor


def test_budgets_resolve_engine_default_with_block_interval():
    budgets = RequestBudgets(ENGINE, block_size=16)
    assert budgets.resolve("a", 100) == Budget(heavy=10, recent=10, interval=16)
    assert budgets.resolve("a", 100).tokens == 20


def test_budgets_resolve_request_overrides():
    budgets = RequestBudgets(ENGINE, block_size=16)
    params = SamplingParams(extra_args={"h2o_heavy_tokens": 3, "h2o_interval": 1, "unrelated": 0})
    got = budgets.resolve("a", 100, params)
    assert got == request_budget(ENGINE, params, 100, 16)
    assert got == Budget(heavy=3, recent=10, interval=1)
    assert budgets.resolve("b", 100, None) == Budget(10, 10, 16)


def test_budgets_are_resolved_once_per_request():
    """A later lookup (the scheduler's manager knows no extra_args) reads the first resolution."""
    budgets = RequestBudgets(ENGINE, block_size=16)
    first = budgets.resolve("a", 100, SamplingParams(extra_args={"h2o_recent_tokens": 5}))
    assert budgets.resolve("a", 100) is first and budgets["a"] is first
    assert budgets.resolve("a", 7, SamplingParams(extra_args={"h2o_recent_tokens": 99})) is first


def test_budgets_read_before_resolution_raise_naming_the_request():
    """The worker's plan reads budgets resolved when the request arrived: a request that never
    arrived is an error, not the engine's default budget."""
    with pytest.raises(KeyError, match="'late'"):
        RequestBudgets(ENGINE, block_size=16)["late"]


def test_budgets_forget_and_retain():
    budgets = RequestBudgets(ENGINE, block_size=16)
    for rid in "abc":
        budgets.resolve(rid, 50)
    budgets.forget("a")
    budgets.forget("missing")
    assert "a" not in budgets and len(budgets) == 2
    budgets.retain(["c"])
    assert list(budgets._budgets) == ["c"]
