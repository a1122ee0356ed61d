"""``Decay`` (A2SF's forgetting factor): config, flag, step terms, records."""
import argparse

import pytest
import torch

from h2o_vllm.config import H2OConfig
from h2o_vllm.score_modes import Decay, StepQueries

from flag_parsing import parse, refused


@pytest.mark.parametrize("value, message", [
    (0, r"h2o.decay must be in \(0, 1\] \(1 is the paper's plain sum\), got 0"),
    (1.5, r"must be in \(0, 1\]"), (float("nan"), r"must be in \(0, 1\]"),
    (True, r"h2o.decay must be a number in \(0, 1\], got True"), ("0.9", "must be a number"),
])
def test_out_of_range_is_refused(value, message):
    refused({"decay": value}, message)


def test_flag_folds_into_the_config():
    assert parse(["--h2o-decay", "0.9"]) == {"h2o": {"decay": 0.9}}
    with pytest.raises(argparse.ArgumentError, match="h2o.decay must be in"):
        parse(["--h2o-decay", "2"])


def test_terms_decay_every_query_once():
    # One row of 3 queries: query i adds decay^(2 - i); old scores decay^3.
    queries = StepQueries(row=torch.zeros(3, dtype=torch.long), index=torch.arange(3),
                          row_len=torch.full((3,), 3), position=torch.arange(3),
                          prompt_len=torch.full((3,), 3), chunk_start=torch.zeros(3, dtype=torch.long),
                          chunk_end=torch.full((3,), 3))
    values = torch.tensor([0.5], dtype=torch.float64)
    assert Decay.query_factors(values, queries).tolist() == [0.25, 0.5, 1.0]
    assert Decay.score_scales(values, torch.tensor([3])).tolist() == [0.125]


def test_the_decay_names_a_prefixs_record():
    assert Decay(0.9).record_key() != Decay(0.8).record_key()
    assert Decay(0.9).unrecorded_hit(16) is None
    assert H2OConfig(decay=1.0).budget(10, 16).scoring == ()  # the paper's plain sum
