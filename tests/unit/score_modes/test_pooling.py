"""``Pooling`` (SnapKV's pooling at the prompt's compaction): config, flag, rank, records."""
import pytest
import torch

from h2o_vllm.score_modes import Pooling

from flag_parsing import parse, refused


@pytest.mark.parametrize("value, message", [
    (0, "h2o.pool_kernel must be an integer >= 1, got 0"), (True, "h2o.pool_kernel must be an integer"),
    (7.0, "h2o.pool_kernel must be an integer"), (4, r"h2o.pool_kernel must be odd \(1 is no pooling\), got 4"),
])
def test_out_of_range_is_refused(value, message):
    refused({"pool_kernel": value}, message)


def test_flag_folds_into_the_config():
    assert parse(["--h2o-pool-kernel", "15"]) == {"h2o": {"pool_kernel": 15}}


def test_rank_is_the_max_over_the_window_fewer_at_the_ends():
    candidates = torch.tensor([0.0, 1.0, 0.0, 0.0, 5.0, 0.0])
    assert Pooling(3).rank(candidates).tolist() == [1.0, 1.0, 1.0, 5.0, 5.0, 5.0]
    assert Pooling(5).oracle_rank(candidates).tolist() == [1.0, 1.0, 5.0, 5.0, 5.0, 5.0]


def test_pooling_does_not_touch_scores_or_records():
    assert Pooling(5).record_key() is None and Pooling(5).unrecorded_hit(16) is None
    assert Pooling.query_factors(torch.tensor([5]), None) is None
