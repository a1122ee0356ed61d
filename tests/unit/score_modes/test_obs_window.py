"""``ObsWindow`` (SnapKV's observation window): config, flag, which queries count, records."""
import pytest

from h2o_vllm.config import Budget
from h2o_vllm.oracle.cache import query_weight
from h2o_vllm.score_modes import ObsWindow

from flag_parsing import parse, refused


@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_out_of_range_is_refused(value):
    refused({"obs_window": value}, f"h2o.obs_window must be an integer >= 1, got {value!r}")


def test_flag_folds_into_the_config():
    assert parse(["--h2o-obs-window", "8"]) == {"h2o": {"obs_window": 8}}


@pytest.mark.parametrize("chunk, weights", [
    (None, [0] * 7 + [1] * 3 + [1, 1]),                 # the prompt's last 3 queries, then all
    (4, [0, 1, 1, 1, 0, 1, 1, 1, 1, 1] + [1, 1]),       # each chunk's last 3: [0,4) [4,8) [8,10)
])
def test_each_chunks_last_queries_count(chunk, weights):
    budget = Budget(heavy=2, recent=2, interval=1, prefill_chunk=chunk, scoring=(ObsWindow(3),))
    assert [query_weight(budget, p, 10) for p in range(12)] == weights


def test_records_are_off_and_hits_stop_at_the_window():
    # A prefix the window does not reach scores all zeros: a hit may reach it without a record.
    assert ObsWindow(3).unrecorded_hit(10) == 7
    assert ObsWindow(30).unrecorded_hit(10) == 0
    assert ObsWindow(3).record_key() is None
