"""Adding a mode is one file: a test-only mode, put in the registry and nowhere else, reaches
config parsing, the flags, the per-request keys, the step plan and the oracle."""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from h2o_vllm import score_modes
from h2o_vllm.config import H2OConfig, request_overrides
from h2o_vllm.frontend import requests
from h2o_vllm.oracle.cache import SequenceState
from h2o_vllm.score_modes import ScoreMode, StepQueries
from h2o_vllm.score_modes.base import integer_at_least
from h2o_vllm.worker.plan import make_step_plan

from flag_parsing import parse, refused


@dataclass(frozen=True)
class SkipFirst(ScoreMode):
    """Test-only: the prompt's first ``skip_first`` queries add nothing."""
    skip_first: int

    help: ClassVar[str] = "Leave out the prompt's first INT queries."
    neutral: ClassVar[int] = 0

    @classmethod
    def check(cls, value) -> None:
        integer_at_least("skip_first", value, 0)

    @classmethod
    def query_factors(cls, values: torch.Tensor, queries: StepQueries) -> torch.Tensor:
        return (queries.position >= values[queries.row]).to(torch.float64)

    def oracle_query_weight(self, position: int, prompt_len: int, chunk) -> float:
        return 0.0 if position < self.skip_first else 1.0


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(score_modes, "MODES", (*score_modes.MODES, SkipFirst))


def test_config_parses_checks_and_resolves_it(registered):
    config = H2OConfig.from_dict({"heavy_tokens": 4, "skip_first": 3})
    assert config.skip_first == 3 and config.to_dict() == {"heavy_tokens": 4, "skip_first": 3}
    assert config.budget(20, 16).mode(SkipFirst) == SkipFirst(3)
    refused({"skip_first": -1}, "h2o.skip_first must be an integer >= 0, got -1")


def test_the_flag_and_the_request_key_exist(registered):
    assert parse(["--h2o-skip-first", "2"]) == {"h2o": {"skip_first": 2}}
    assert request_overrides({"h2o_skip_first": 5}) == {"skip_first": 5}
    requests.check_request_overrides({"h2o": {}}, {"h2o_skip_first": 5})  # not an unknown key


def test_the_plan_and_the_oracle_weigh_queries_by_it(registered):
    budget = H2OConfig(heavy_tokens=64, recent_tokens=64, skip_first=3).budget(8, 16)
    plan = make_step_plan(torch.tensor([0]), torch.tensor([8]), torch.tensor([8]), [budget])
    assert plan.query_weights.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    oracle = SequenceState(prompt_len=8, budget=budget).query_weights(torch.arange(8))
    assert torch.equal(plan.query_weights, oracle)


def test_unregistered_it_is_an_unknown_key():
    with pytest.raises(ValueError, match="unknown h2o key"):
        H2OConfig.from_dict({"skip_first": 3})
