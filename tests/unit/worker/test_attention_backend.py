"""worker.attention_backend: how a step's plan reaches the metadata builders (the hooks hand it over)."""
import torch

from h2o_vllm.config import Budget
from h2o_vllm.worker import plan as step_plan
from h2o_vllm.worker.attention_backend import H2OBuilderMixin, arm, building, take_armed

t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


def _builders(n: int) -> list[H2OBuilderMixin]:
    return [object.__new__(H2OBuilderMixin) for _ in range(n)]  # no vLLM builder behind them


def test_current_plan_is_set_only_inside_the_context():
    plan = step_plan.make_step_plan(t([0]), t([3]), t([3]), [Budget(1, 1, 1)])
    builders = _builders(2)
    assert all(b.plan is None for b in builders)
    with building(builders, plan):
        assert all(b.plan is plan for b in builders)
    assert all(b.plan is None for b in builders)


def test_armed_plan_is_taken_once_and_only_for_its_batch():
    """Model Runner V2: the plan made in the runner's prepare_attn reaches the model state's
    prepare_attn for the same batch, never a dummy run's."""
    builders = _builders(2)
    batch, dummy, plan = object(), object(), object()
    arm(builders, batch, plan)
    assert take_armed(builders, dummy) is None
    assert take_armed(builders, batch) is plan
    assert take_armed(builders, batch) is None
