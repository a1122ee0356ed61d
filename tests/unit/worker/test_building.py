"""worker.building: a step's plan is current for the builders only inside its one build."""
import torch

from h2o_vllm.config import Budget
from h2o_vllm.worker import plan as step_plan
from h2o_vllm.worker.building import building, building_held, hold, plan_for

t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
LAYERS = {"model.layers.0.attn": 0, "model.layers.1.attn": 1}


def _plan():
    return step_plan.make_step_plan(t([0]), t([3]), t([3]), [Budget(1, 1, 1)])


def test_plan_is_current_only_inside_the_build():
    plan = _plan()
    assert plan_for(["model.layers.0.attn"]) is None
    with building(plan, LAYERS):
        assert plan_for(["model.layers.0.attn"]) is plan
        with building(None, {}):  # a nested dummy build sees no plan
            assert plan_for(["model.layers.0.attn"]) is None
        assert plan_for(["model.layers.1.attn"]) is plan
    assert plan_for(["model.layers.0.attn"]) is None


def test_each_group_builds_with_its_own_prefix_orders():
    orders = {0: object(), 1: object()}
    plan = step_plan.StepPlan(**{**_plan().__dict__, "group_prefixes": orders, "prefix": orders[0]})
    with building(plan, LAYERS):
        assert plan_for(["model.layers.0.attn"]).prefix is orders[0]
        assert plan_for(["model.layers.1.attn"]).prefix is orders[1]


def test_a_layer_outside_every_h2o_group_is_an_error_not_group_zero():
    with building(_plan(), LAYERS):
        try:
            plan_for(["model.layers.9.attn"])
        except KeyError:
            return
    raise AssertionError("an unknown layer was given a group")


def test_held_plan_is_taken_once_and_only_for_its_batch():
    """Model Runner V2: the plan made in the runner's prepare_attn reaches the model state's
    prepare_attn for the same batch, never a dummy run's."""
    batch, dummy, plan = object(), object(), _plan()
    hold(batch, plan, LAYERS)
    with building_held(dummy):
        assert plan_for(["model.layers.0.attn"]) is None
    with building_held(batch):
        assert plan_for(["model.layers.0.attn"]) is plan
    assert plan_for(["model.layers.0.attn"]) is None
    with building_held(batch):  # taken once
        assert plan_for(["model.layers.0.attn"]) is None
