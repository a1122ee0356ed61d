"""Fuzzing the configuration surface beyond the config dict (tests/unit/test_config.py):
per-request extra args through the request-validation path, and the CLI flags. Nothing
crashes; every rejection is a ValueError (or argparse's exit 2) that names what was wrong;
whatever is accepted runs through the paths the scheduler and the workers take."""
from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from h2o_vllm.frontend import flags
from h2o_vllm.config import H2OConfig, config_from_additional, request_keys, request_overrides
from h2o_vllm.policy import kv_len_after

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.integers(-5, 5000),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.text(max_size=8),
    st.binary(max_size=4))
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=2), st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2))
_ENGINE = st.sampled_from([{}, {"heavy_ratio": 0.2}, {"heavy_tokens": 16, "recent_tokens": 16},
                           {"recent_ratio": 0.0, "heavy_tokens": 4, "interval": 1}])
_EXTRA_ARGS = st.dictionaries(
    st.one_of(st.sampled_from(sorted(request_keys())), st.sampled_from(["h2o_budget", "h2o_", "other", "H2O_interval"])),
    _VALUES, max_size=6)
_NOT_VALID = (ValueError,)


def _check(additional_config, extra_args):
    from h2o_vllm.frontend.requests import check_request_overrides
    check_request_overrides(additional_config, extra_args)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=_ENGINE, extra_args=_EXTRA_ARGS, h2o_on=st.booleans())
def test_request_extra_args_are_accepted_and_usable_or_refused_with_a_clear_value_error(engine, extra_args, h2o_on):
    additional = {"h2o": engine} if h2o_on else {}
    given_keys = [k for k in extra_args if k.startswith("h2o_")]  # unknown ones are refused too
    try:
        _check(additional, extra_args)
    except ValueError as exc:
        message = str(exc)
        assert given_keys, "refused a request without h2o_* keys"
        assert any(k in message for k in given_keys), message
        return
    overrides = request_overrides(extra_args)
    config = config_from_additional(additional)
    if config is None:
        assert not overrides
        return
    # What the scheduler hook and the runner hook do with an accepted request.
    request_config = config.with_overrides(overrides) if overrides else config
    for prompt_len in (1, 17, 300):
        budget = request_config.budget(prompt_len, 16)
        heavy, recent = budget.heavy, budget.recent
        assert isinstance(heavy, int) and isinstance(recent, int) and heavy + recent > 0
        interval = budget.interval
        assert isinstance(interval, int) and interval >= 1
        assert 0 < kv_len_after(prompt_len + 50, prompt_len, budget) <= prompt_len + 50


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 10**400, -1, 1.5, "0.1", [0.1], {"a": 1}, True])
@pytest.mark.parametrize("key", ["h2o_heavy_ratio", "h2o_recent_ratio"])
def test_bad_ratio_per_request_names_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        _check({"h2o": {}}, {key: value})


# --------------------------------------------------------------------------- CLI flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    parser.add_argument("--additional-config", type=json.loads, default=None)
    flags.add_h2o_args(parser)
    return parser


_TOKEN_TEXT = st.one_of(st.integers(-3, 10**6).map(str), st.floats(allow_nan=True).map(repr),
                        st.sampled_from(["", " ", "0x10", "1e3", "nan", "inf", "-0", "½", "1_000"]),
                        st.text(max_size=6))
_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(), st.text(max_size=4))
_ADDITIONAL = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={"h2o": st.one_of(st.none(), _ENGINE, st.dictionaries(
        st.sampled_from(["heavy_ratio", "recent_ratio", "heavy_tokens", "recent_tokens", "interval", "bogus"]),
        _JSON_SCALARS, max_size=3), st.integers()), "other": st.integers()}))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_eviction=st.sampled_from([None, "none", "h2o", "H2O", ""]),
       values=st.dictionaries(st.sampled_from(sorted(flags.flags())), _TOKEN_TEXT, max_size=5),
       additional=_ADDITIONAL)
def test_cli_flags_fold_or_fail_cleanly(kv_eviction, values, additional):
    argv = []
    if kv_eviction is not None:
        argv += ["--kv-eviction", kv_eviction]
    for key, text in values.items():
        argv += [f"{flags.flags()[key]}={text}"]
    if additional is not None:
        argv += ["--additional-config", json.dumps(additional, allow_nan=True)]
    try:
        args = _parser().parse_args(argv)
    except argparse.ArgumentError as exc:
        assert exc.argument_name in ("--kv-eviction", "--additional-config", *flags.flags().values()), str(exc)
        return
    except SystemExit as exc:  # argparse's own refusal: a usage message and exit status 2
        assert exc.code == 2
        return
    try:
        flags.fold_namespace(args)
    except flags.FlagError as exc:
        assert str(exc).startswith("--"), str(exc)
        return
    try:
        # vLLM's create_engine_config, through the engine-args hook: an --additional-config
        # h2o entry given without any flag is validated there, before the model loads.
        config = config_from_additional(args.additional_config)
    except ValueError as exc:
        assert not values and "h2o" in str(exc), str(exc)
        return
    if config is not None:
        assert isinstance(config, H2OConfig)
        budget = config.budget(100, 16)
        assert math.isfinite(budget.heavy + budget.recent + budget.interval)
