"""Every score mode against its own oracle rule (tests/unit/score_modes/mode_cases.py): the step
plan's fused terms are the oracle's query-by-query rule, bit for bit, and a mode's rank is its
oracle rank."""
import pytest
import torch

from h2o_vllm.config import Budget
from h2o_vllm.oracle.attention import query_coefficients
from h2o_vllm.oracle.cache import SequenceState
from h2o_vllm.score_modes import MODES as REGISTERED
from h2o_vllm.worker.plan import make_step_plan

from mode_cases import MODES, STEPS


def _budget(scoring, chunk=None) -> Budget:
    return Budget(heavy=64, recent=64, interval=64, prefill_chunk=chunk, scoring=scoring)


@pytest.mark.parametrize("name", MODES)
def test_the_plans_terms_are_the_oracles_rule(name):
    """Each row of a batch mixing every step shape: the plan's query weights and score scale
    are what the oracle runs (``query_coefficients`` of its per-query scale and weights)."""
    budgets = [_budget(MODES[name], chunk) for *_, chunk in STEPS]
    computed, q_lens, prompts = (torch.tensor(c) for c in list(zip(*STEPS))[:3])
    plan = make_step_plan(computed, q_lens, prompts, budgets)
    weights = torch.ones(int(q_lens.sum())) if plan.query_weights is None else plan.query_weights
    scale = torch.ones(len(STEPS)) if plan.score_scale is None else plan.score_scale
    for row, ((start, n, prompt_len, _), budget) in enumerate(zip(STEPS, budgets)):
        state = SequenceState(prompt_len=prompt_len, budget=budget)
        a = state.query_scale()
        coef = query_coefficients(n, a, state.query_weights(torch.arange(start, start + n)))
        coef = torch.ones(n) if coef is None else coef
        begin = int(plan.query_starts[row])
        assert torch.equal(weights[begin:begin + n], coef), (name, row)
        want = (torch.tensor(a, dtype=torch.float64) ** n).float()  # fp64 power, rounded once
        assert float(scale[row]) == float(want), (name, row)
        assert float(plan.query_scale[row]) == float(torch.tensor(a, dtype=torch.float32))


def test_a_paper_budget_makes_no_terms():
    plan = make_step_plan(torch.tensor([0]), torch.tensor([9]), torch.tensor([9]), [_budget(())])
    assert plan.query_weights is None and plan.score_scale is None


@pytest.mark.parametrize("mode", [m for modes in MODES.values() for m in modes if m.ranks])
@pytest.mark.parametrize("shape", [(1,), (2, 3, 1), (4, 7), (2, 2, 30)])
def test_rank_is_the_oracles_rank(mode, shape):
    torch.manual_seed(sum(shape))
    candidates = torch.randint(0, 4, shape).float()  # few values: ties and plateaus
    assert torch.equal(mode.rank(candidates), mode.oracle_rank(candidates))


def test_every_registered_mode_has_its_test_module():
    from pathlib import Path
    here = Path(__file__).parent
    for mode in REGISTERED:
        assert (here / f"test_{mode.__module__.rpartition('.')[2]}.py").exists(), mode


@pytest.mark.parametrize("mode", REGISTERED)
def test_a_mode_names_its_key_help_and_neutral_value(mode):
    assert mode.key() and mode.help and mode.neutral is not None
    mode.check(mode.neutral)  # the value that changes nothing is a valid setting
