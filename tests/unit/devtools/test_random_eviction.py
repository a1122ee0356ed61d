"""The benchmark-only random eviction: a score mode registered in the benchmark's process only,
whose prompt compaction keeps heavy tokens drawn at random and the recent window as H2O does."""
import pytest
import torch

from h2o_devtools import random_eviction
from h2o_vllm import score_modes
from h2o_vllm.config import H2OConfig, request_keys
from h2o_vllm.policy import select_keep


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(score_modes, "MODES", score_modes.MODES)
    random_eviction.register()
    random_eviction.register()


def test_registering_twice_adds_it_once(registered):
    assert score_modes.MODES.count(random_eviction.RandomHeavy) == 1
    assert "h2o_random_heavy" in request_keys()


def test_its_config_is_the_papers_budget_plus_the_key(registered):
    assert random_eviction.h2o_config("random@c256", 0.2) == {
        "heavy_ratio": 0.1, "recent_ratio": 0.1, "min_tokens": 0, "prefill_chunk": 256, "random_heavy": 1}
    assert random_eviction.h2o_config("local", 0.2) == {"heavy_ratio": 0.0, "recent_ratio": 0.2, "min_tokens": 0}
    budget = H2OConfig.from_dict(random_eviction.h2o_config("random", 0.2)).budget(100, 16)
    assert budget.mode(random_eviction.RandomHeavy) == random_eviction.RandomHeavy(1)


def test_the_heavy_pick_ignores_the_scores_and_keeps_the_recent_window(registered):
    scores = torch.arange(64.0).expand(3, 64)  # by score, H2O would keep 48..55 as heavy
    torch.manual_seed(0)
    keep = select_keep(scores, 8, 8, rank=(random_eviction.RandomHeavy(1),))
    assert keep.shape == (3, 16)
    assert torch.equal(keep[:, 8:], torch.arange(56, 64).expand(3, 8))
    assert not torch.equal(keep[:, :8], torch.arange(48, 56).expand(3, 8))
    assert len({tuple(row) for row in keep[:, :8].tolist()}) > 1  # each head draws its own
