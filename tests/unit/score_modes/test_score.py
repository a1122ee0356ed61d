"""``Score`` (the ``score`` key, a name): config, flag, per-request key, what it cannot combine
with, and prefix-cache records. The KeyDiff rule itself: test_keydiff.py."""
import argparse
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from vllm.exceptions import VLLMValidationError

from h2o_vllm.config import H2OConfig
from h2o_vllm.frontend.requests import check_request_overrides
from h2o_vllm.scheduler.prefix_hits import unrecorded_hit
from h2o_vllm.oracle.cache import LayerCache, SequenceState
from h2o_vllm.score_modes import SCORERS, KeyDiff, Pooling, Score, Scorer, score
from h2o_vllm.worker.plan import make_step_plan

from flag_parsing import parse, refused

CHOICES = "'h2o', 'keydiff', 'expected'"


def test_the_choices_are_the_scorer_registry_default_first():
    assert Score.choices() == tuple(s.name for s in SCORERS) == ("h2o", "keydiff", "expected")
    assert Score.neutral == "h2o" and Score.number is str


@pytest.mark.parametrize("value", ["KeyDiff", "", "expected_attention", 1])
def test_an_unknown_score_is_refused_naming_the_choices(value):
    refused({"score": value}, f"h2o.score must be one of {CHOICES}, got {value!r}")


def test_keydiff_resolves_to_its_scorer_and_h2o_to_the_papers_budget():
    config = H2OConfig.from_dict({"score": "keydiff", "heavy_tokens": 8, "recent_tokens": 8})
    assert config.score == "keydiff" and config.to_dict()["score"] == "keydiff"
    budget = config.budget(40, 16)
    assert budget.key_scorer == KeyDiff() and budget.mode(Score) == Score("keydiff")
    paper = H2OConfig.from_dict({"score": "h2o", "heavy_tokens": 8, "recent_tokens": 8}).budget(40, 16)
    assert paper.scoring == () and paper.key_scorer is None  # the paper's arithmetic, unchanged
    assert H2OConfig().score is None and H2OConfig().budget(40, 16).key_scorer is None


@pytest.mark.parametrize("data, keys", [
    ({"decay": 0.9}, "h2o.decay"), ({"obs_window": 8}, "h2o.obs_window"),
    ({"decay": 0.5, "obs_window": 2}, "h2o.decay and h2o.obs_window"),
])
def test_keydiff_refuses_the_keys_that_only_weigh_attention(data, keys):
    refused({"score": "keydiff", **data}, f"h2o.score 'keydiff' cannot be combined with {keys}")
    H2OConfig.from_dict({"score": "h2o", **data})  # the paper's score reads them


def test_keydiff_composes_with_neutral_weights_pooling_and_sinks():
    config = H2OConfig.from_dict({"score": "keydiff", "decay": 1.0, "pool_kernel": 5, "sink_tokens": 2})
    assert config.budget(100, 16).scoring == (Pooling(5), Score("keydiff"))


def test_the_flag_takes_a_name_and_names_the_choices():
    assert parse(["--h2o-score", "keydiff"]) == {"h2o": {"score": "keydiff"}}
    with pytest.raises(argparse.ArgumentError, match=r"--h2o-score: invalid choice: 'kd' \(choose from 'h2o', 'keydiff', 'expected'\)"):
        parse(["--h2o-score", "kd"])
    with pytest.raises(ValueError, match="--h2o-decay, --h2o-score: h2o.score 'keydiff' cannot be combined"):
        parse(["--h2o-score", "keydiff", "--h2o-decay", "0.9"])


@pytest.mark.parametrize("engine, extra_args, words", [
    ({}, {"h2o_score": "kd"}, f"h2o.score must be one of {CHOICES}, got 'kd'"),
    ({}, {"h2o_score": "keydiff", "h2o_obs_window": 4}, "cannot be combined with h2o.obs_window"),
    ({"decay": 0.9}, {"h2o_score": "keydiff"}, "cannot be combined with h2o.decay"),
])
def test_a_bad_request_score_is_a_client_error(engine, extra_args, words):
    """Refused the way every bad h2o_* key is: a VLLMValidationError, vLLM's HTTP 400."""
    with pytest.raises(VLLMValidationError, match=words):
        check_request_overrides({"h2o": engine}, extra_args)
    check_request_overrides({"h2o": engine}, {"h2o_score": "keydiff", "h2o_decay": 1.0, "h2o_obs_window": None})


def test_a_request_unsets_the_engines_attention_weights_to_run_keydiff():
    """What the refusal tells a request to do: null unsets an engine-wide key."""
    from h2o_vllm.config import request_config
    engine = H2OConfig.from_dict({"decay": 0.9, "obs_window": 32})
    with pytest.raises(ValueError, match="a request may send h2o_decay: null, h2o_obs_window: null"):
        request_config(engine, {"h2o_score": "keydiff"})
    config = request_config(engine, {"h2o_score": "keydiff", "h2o_decay": None, "h2o_obs_window": None})
    assert config.decay is None and config.obs_window is None and config.score == "keydiff"


def test_keydiff_turns_records_off_and_hits_reach_anywhere():
    """The ranking reads the keys, which a hit copies: no record is needed, and the zero
    scores a hit starts from rank nothing (a hit still stops before the first compaction)."""
    budget = H2OConfig(score="keydiff", heavy_tokens=8, recent_tokens=8).budget(200, 16)
    assert unrecorded_hit(200, budget) >= 200
    assert Score("keydiff").record_key() is None and Score("h2o").unrecorded_hit(16) is None


@dataclass(frozen=True)
class KeyNorm(Scorer):
    """Test-only: kvpress's KnormPress, the smallest keys kept."""
    name: ClassVar[str] = "knorm"

    def scores(self, keys, context=None):
        return -keys.norm(dim=-1)

    def oracle_scores(self, keys, context=None):
        return torch.stack([-keys[:, t].norm(dim=-1) for t in range(keys.shape[1])], dim=-1)


def test_a_scorer_added_to_the_registry_reaches_config_flag_request_plan_and_oracle(monkeypatch):
    """Adding a score is one class in ``score.SCORERS``."""
    monkeypatch.setattr(score, "SCORERS", (*score.SCORERS, KeyNorm))
    assert parse(["--h2o-score", "knorm"]) == {"h2o": {"score": "knorm"}}
    check_request_overrides({"h2o": {}}, {"h2o_score": "knorm"})
    refused({"score": "kd"}, "h2o.score must be one of 'h2o', 'keydiff', 'expected', 'knorm', got 'kd'")
    budget = H2OConfig(score="knorm", heavy_tokens=2, recent_tokens=1, interval=1).budget(6, 16)
    plan = make_step_plan(torch.tensor([0]), torch.tensor([6]), torch.tensor([6]), [budget])
    assert plan.key_scorers == (KeyNorm(),) and plan.query_weights is None
    state = SequenceState(prompt_len=6, budget=budget)
    keys = torch.tensor([1.0, 5.0, 0.5, 3.0, 0.1, 2.0]).view(1, 6, 1)
    state.layers.append(LayerCache(1, 1))
    state.layers[0].append(keys, keys, torch.arange(6))
    state.num_tokens = 6
    assert state.compact_if_due() and state.layers[0].positions.tolist() == [[2, 4, 5]]
