"""H2OConfig: validation, parsing, overrides and the per-prompt budget rule (pure, no vLLM)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from h2o_vllm.config import DEFAULT_MIN_TOKENS, DEFAULT_RATIO, Budget, H2OConfig
from h2o_vllm.score_modes import Decay, ObsWindow, Pooling

KEYS = ["heavy_ratio", "recent_ratio", "heavy_tokens", "recent_tokens", "interval"]
RATIO_KEYS = ["heavy_ratio", "recent_ratio"]
TOKEN_KEYS = ["heavy_tokens", "recent_tokens"]


def _error(data) -> str:
    with pytest.raises(ValueError) as info:
        H2OConfig.from_dict(data)
    return str(info.value)


# --------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("key", RATIO_KEYS)
@pytest.mark.parametrize("value", [-0.1, -1, 1.0000001, 1.5, 2, float("nan"), float("inf"),
                                   float("-inf"), 10**400, -(10**400)])
def test_ratio_out_of_range_rejected(key, value):
    msg = _error({key: value})
    assert f"h2o.{key}" in msg
    assert "[0, 1]" in msg


@pytest.mark.parametrize("key", RATIO_KEYS)
@pytest.mark.parametrize("value", [True, False, "0.1", b"0.1", [0.1], {"x": 1}, object()])
def test_ratio_wrong_type_rejected(key, value):
    msg = _error({key: value})
    assert f"h2o.{key}" in msg
    assert "[0, 1]" in msg


@pytest.mark.parametrize("key", TOKEN_KEYS)
@pytest.mark.parametrize("value", [-1, -100, -(10**30)])
def test_negative_token_count_rejected(key, value):
    msg = _error({key: value})
    assert f"h2o.{key}" in msg
    assert ">= 0" in msg


@pytest.mark.parametrize("key", TOKEN_KEYS)
@pytest.mark.parametrize("value", [True, False, "8", 8.0, 8.5, float("nan"), float("inf"), None.__class__])
def test_token_count_wrong_type_rejected(key, value):
    msg = _error({key: value})
    assert f"h2o.{key}" in msg
    assert ">= 0" in msg
    assert "integer" in msg


@pytest.mark.parametrize("value", [0, -1, -16, 1.0, 2.5, 16.0, float("nan"), float("inf"), True, "16"])
def test_bad_interval_rejected(value):
    msg = _error({"interval": value})
    assert "h2o.interval" in msg
    assert ">= 1" in msg


HEAVY_ZERO = [{"heavy_ratio": 0}, {"heavy_ratio": 0.0}, {"heavy_tokens": 0}]
RECENT_ZERO = [{"recent_ratio": 0}, {"recent_ratio": 0.0}, {"recent_tokens": 0}]


@pytest.mark.parametrize("heavy", HEAVY_ZERO)
@pytest.mark.parametrize("recent", RECENT_ZERO)
def test_zero_total_budget_rejected(heavy, recent):
    msg = _error({**heavy, **recent})
    assert "h2o" in msg
    assert "heavy" in msg and "recent" in msg
    assert "zero" in msg


@pytest.mark.parametrize("part", ["heavy", "recent"])
def test_both_ratio_and_tokens_for_one_part_rejected(part):
    msg = _error({f"{part}_ratio": 0.1, f"{part}_tokens": 8})
    assert f"h2o.{part}_ratio" in msg and f"h2o.{part}_tokens" in msg


def test_unknown_keys_rejected_and_accepted_keys_listed():
    msg = _error({"heavy_ratio": 0.1, "budget": 0.2, "hevy_ratio": 0.1})
    assert "h2o" in msg
    assert "budget" in msg and "hevy_ratio" in msg
    for key in KEYS:
        assert key in msg


def test_unknown_keys_of_mixed_types_rejected():
    msg = _error({1: 2, "x": 3, (1, 2): 4})
    assert "accepted keys" in msg
    for key in KEYS:
        assert key in msg


@pytest.mark.parametrize("data", [[("heavy_ratio", 0.1)], "heavy_ratio=0.1", 0.1, 3, ("a",), object()])
def test_non_dict_rejected(data):
    msg = _error(data)
    assert "h2o" in msg
    assert "dict" in msg


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="h2o.heavy_ratio"):
        H2OConfig(heavy_ratio=1.5)


# --------------------------------------------------------------------------- acceptance


@pytest.mark.parametrize("data", [
    {},
    None,
    {"heavy_ratio": 0.1, "recent_ratio": 0.1},
    {"heavy_ratio": 0.2, "recent_tokens": 32},
    {"heavy_tokens": 16, "recent_ratio": 0.05},
    {"heavy_tokens": 16, "recent_tokens": 16, "interval": 1},
    {"heavy_ratio": 0, "recent_ratio": 0.2},          # recent-only "Local" baseline
    {"heavy_ratio": 0.0, "recent_tokens": 1},
    {"heavy_tokens": 0, "recent_tokens": 4},
    {"heavy_ratio": 0.3},                              # recent defaults to DEFAULT_RATIO
    {"recent_ratio": 0},                               # heavy defaults to DEFAULT_RATIO
    {"heavy_ratio": 1, "recent_ratio": 1},
    {"interval": 10**9},
])
def test_valid_configs_accepted(data):
    cfg = H2OConfig.from_dict(data)
    assert isinstance(cfg, H2OConfig)


def test_defaults_are_the_papers_budget():
    cfg = H2OConfig.from_dict({})
    assert cfg.budget(1000, 16) == Budget(heavy=100, recent=100, interval=16)
    assert cfg.budget(1000, 16).tokens == 200
    assert DEFAULT_RATIO == 0.1


def test_mixed_heavy_ratio_recent_tokens_budget():
    cfg = H2OConfig.from_dict({"heavy_ratio": 0.25, "recent_tokens": 7, "min_tokens": 0})
    assert cfg.budget(100, 16) == Budget(heavy=25, recent=7, interval=16)
    assert cfg.budget(3, 16) == Budget(heavy=1, recent=7, interval=16)


def test_recent_only_budget():
    cfg = H2OConfig.from_dict({"heavy_ratio": 0, "recent_ratio": 0.2, "min_tokens": 0})
    assert cfg.budget(100, 16) == Budget(heavy=0, recent=20, interval=16)
    assert cfg.budget(1, 16) == Budget(heavy=0, recent=1, interval=16)


@pytest.mark.parametrize("data, floor", [
    ({}, DEFAULT_MIN_TOKENS),                                        # the paper's ratios
    ({"heavy_ratio": 0.25, "recent_tokens": 7}, DEFAULT_MIN_TOKENS),  # one part scales
    ({"heavy_ratio": 0, "recent_ratio": 0.2}, DEFAULT_MIN_TOKENS),   # Local
    ({"heavy_tokens": 2, "recent_tokens": 2}, 0),                    # token counts are taken as given
    ({"heavy_ratio": 0, "recent_tokens": 3}, 0),
    ({"heavy_tokens": 2, "recent_tokens": 2, "min_tokens": 8}, 8),   # an explicit floor always applies
    ({"min_tokens": 0}, 0),                                          # 0: the paper's rule
])
def test_default_floor_only_for_budgets_that_scale_with_the_prompt(data, floor):
    cfg = H2OConfig.from_dict(data)
    assert cfg.floor_tokens() == floor
    tiny = cfg.budget(10, 16)
    assert tiny.tokens == max(floor, cfg.part_budget("heavy", 10) + cfg.part_budget("recent", 10))
    # The floor grows the recent window only.
    assert tiny.heavy == cfg.part_budget("heavy", 10)
    parts = cfg.part_budget("heavy", 4000) + cfg.part_budget("recent", 4000)
    assert cfg.budget(4000, 16).tokens == max(floor, parts)


# --------------------------------------------------------------------------- dict round trip


@pytest.mark.parametrize("data", [
    {},
    {"heavy_ratio": 0.1, "recent_ratio": 0.1},
    {"heavy_ratio": 0.2, "recent_tokens": 32, "interval": 16},
    {"heavy_tokens": 0, "recent_tokens": 4, "interval": 1},
])
def test_from_dict_to_dict_round_trip(data):
    cfg = H2OConfig.from_dict(data)
    assert cfg.to_dict() == data
    assert H2OConfig.from_dict(cfg.to_dict()) == cfg


def test_with_overrides_replaces_part_given_other_way():
    base = H2OConfig.from_dict({"heavy_ratio": 0.1, "recent_tokens": 32, "interval": 16})
    cfg = base.with_overrides({"heavy_tokens": 8})
    assert cfg.heavy_ratio is None and cfg.heavy_tokens == 8
    assert cfg.recent_tokens == 32 and cfg.interval == 16
    cfg = base.with_overrides({"recent_ratio": 0.5})
    assert cfg.recent_tokens is None and cfg.recent_ratio == 0.5
    assert cfg.heavy_ratio == 0.1
    # Same-way override replaces the value; other keys untouched; base is unchanged.
    cfg = base.with_overrides({"heavy_ratio": 0.3, "interval": 1})
    assert cfg.to_dict() == {"heavy_ratio": 0.3, "recent_tokens": 32, "interval": 1}
    assert base.to_dict() == {"heavy_ratio": 0.1, "recent_tokens": 32, "interval": 16}


def test_with_overrides_validates():
    base = H2OConfig.from_dict({"heavy_ratio": 0, "recent_tokens": 32})
    with pytest.raises(ValueError, match="h2o"):
        base.with_overrides({"recent_ratio": 0})  # zero total budget
    with pytest.raises(ValueError, match="h2o.heavy_ratio"):
        base.with_overrides({"heavy_ratio": 2})
    with pytest.raises(ValueError, match="accepted keys"):
        base.with_overrides({"bogus": 1})
    with pytest.raises(ValueError, match="h2o.recent_ratio and h2o.recent_tokens"):
        base.with_overrides({"recent_ratio": 0.1, "recent_tokens": 3})


# --------------------------------------------------------------------------- short-prompt floor


@pytest.mark.parametrize("ratio, prompt_len, expected", [
    (0.1, 20, 2),
    (0.3, 10, 3),     # 0.3 * 10 == 2.9999999999999996 in fp: must still give 3
    (0.1, 30, 3),
    (0.7, 10, 7),
    (0.1, 5, 1),      # floor would give 0: an enabled part keeps at least 1 token
    (0.1, 1, 1),
    (0.01, 0, 1),
    (1.0, 37, 37),
    (0.0, 1000, 0),   # ratio 0 disables the part
    (0, 1000, 0),
])
def test_part_budget_floor_rule(ratio, prompt_len, expected):
    cfg = H2OConfig(heavy_ratio=ratio, recent_tokens=4)
    assert cfg.part_budget("heavy", prompt_len) == expected
    cfg = H2OConfig(recent_ratio=ratio, heavy_tokens=4)
    assert cfg.part_budget("recent", prompt_len) == expected


@given(ratio=st.floats(0, 1), prompt_len=st.integers(0, 10**6))
def test_part_budget_properties(ratio, prompt_len):
    cfg = H2OConfig(heavy_ratio=ratio, recent_tokens=1)
    got = cfg.part_budget("heavy", prompt_len)
    if ratio == 0:
        assert got == 0
    else:
        assert got >= 1
        assert got <= max(1, prompt_len)
        assert got == max(1, math.floor(ratio * prompt_len + 1e-9))


@given(tokens=st.integers(0, 10**6), prompt_len=st.integers(0, 10**6))
def test_token_parts_ignore_prompt_len(tokens, prompt_len):
    cfg = H2OConfig(heavy_tokens=tokens, recent_tokens=tokens + 1)
    budget = cfg.budget(prompt_len, 16)
    assert (budget.heavy, budget.recent) == (tokens, tokens + 1)
    assert budget.tokens == 2 * tokens + 1


def test_budget_interval():
    # Unset interval: one KV block, whatever the block size; a set interval wins over it.
    assert H2OConfig().budget(100, 16).interval == 16
    assert H2OConfig().budget(100, 1).interval == 1
    assert H2OConfig().budget(100, 32).interval == 32
    assert H2OConfig(interval=5).budget(100, 16).interval == 5
    assert H2OConfig(interval=5).budget(100, 1).interval == 5
    assert H2OConfig(interval=1).budget(100, 16).interval == 1


def test_budget_is_frozen():
    budget = H2OConfig().budget(100, 16)
    with pytest.raises(AttributeError):
        budget.heavy = 3


# --------------------------------------------------------------------------- fuzz

_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**500), 10**500),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.integers(-3, 40),
    st.text(max_size=5), st.binary(max_size=3), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.tuples(st.integers()),
    st.fractions(), st.decimals(allow_nan=True),
)
_KEY_VALUES = {
    "heavy_ratio": st.one_of(st.floats(0, 1), _ANY),
    "recent_ratio": st.one_of(st.floats(0, 1), _ANY),
    "heavy_tokens": st.one_of(st.integers(0, 64), _ANY),
    "recent_tokens": st.one_of(st.integers(0, 64), _ANY),
    "interval": st.one_of(st.integers(1, 64), _ANY),
}
_EXTRA_KEYS = st.one_of(st.text(max_size=8), st.integers(), st.none(), st.booleans(),
                        st.tuples(st.integers()), st.floats(allow_nan=False))


@st.composite
def _config_dicts(draw):
    data = draw(st.fixed_dictionaries({}, optional=_KEY_VALUES))
    if draw(st.booleans()):
        data.update(draw(st.dictionaries(_EXTRA_KEYS, _ANY, max_size=3)))
    return data


@settings(max_examples=400, deadline=None)
@given(data=st.one_of(_config_dicts(), _ANY))
def test_from_dict_returns_config_or_raises_value_error_mentioning_h2o(data):
    try:
        cfg = H2OConfig.from_dict(data)
    except ValueError as exc:
        assert "h2o" in str(exc)
        return
    assert isinstance(cfg, H2OConfig)
    assert H2OConfig.from_dict(cfg.to_dict()) == cfg
    budget = cfg.budget(100, 16)
    assert budget.heavy >= 0 and budget.recent >= 0 and budget.tokens >= 1
    assert budget.interval >= 1


# --------------------------------------------------------------------------- score modes


@pytest.mark.parametrize("data, match", [
    ({"decay": 0}, "h2o.decay"), ({"decay": 1.5}, "h2o.decay"), ({"decay": True}, "h2o.decay"),
    ({"sink_tokens": -1}, "h2o.sink_tokens"), ({"obs_window": 0}, "h2o.obs_window"),
    ({"min_tokens": 2.5}, "h2o.min_tokens"),
    ({"pool_kernel": 0}, "h2o.pool_kernel"), ({"pool_kernel": 4}, "must be odd"),
    ({"pool_kernel": True}, "h2o.pool_kernel"), ({"pool_kernel": 7.0}, "h2o.pool_kernel"),
])
def test_mode_values_rejected(data, match):
    assert match in _error(data)


def test_modes_resolve_into_the_budget():
    plain = H2OConfig().budget(100, 16)
    assert (plain.sink_tokens, plain.scoring) == (0, ())
    budget = H2OConfig(decay=0.9, sink_tokens=4, obs_window=16, pool_kernel=15).budget(200, 16)
    assert (budget.sink_tokens, budget.scoring) == (4, (Decay(0.9), ObsWindow(16), Pooling(15)))
    # A mode set to its neutral value is the paper's rule: the budget runs without it.
    assert H2OConfig(decay=1.0, pool_kernel=1).budget(200, 16).scoring == ()
    assert budget.tokens == 4 + 20 + 20
    assert H2OConfig(pool_kernel=1).budget(100, 16) == plain
