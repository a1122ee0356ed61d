"""frontend.settings: what the engine-args hook settles before vLLM builds its config.

On vLLM's real ``EngineArgs`` (nothing is built or loaded); the engine-level check that the
built config carries the result is tests/engine/test_conflicts_refused_before_load.py.
"""
import pytest
from vllm.engine.arg_utils import EngineArgs

from h2o_vllm.frontend import settings


def _args(h2o=None, **kwargs):
    return EngineArgs(model="unused", additional_config={} if h2o is None else {"h2o": h2o}, **kwargs)


def test_settle_engine_args_turns_default_prefix_caching_off_loudly(caplog):
    args = _args({"heavy_ratio": 0.1})
    with caplog.at_level("WARNING", logger="h2o_vllm"):
        config = settings.settle_engine_args(args)
    assert config is not None and config.heavy_ratio == 0.1
    assert args.enable_prefix_caching is False
    assert "prefix caching is turned off" in caplog.text


def test_settle_engine_args_refuses_explicit_prefix_caching():
    with pytest.raises(ValueError, match="--enable-prefix-caching"):
        settings.settle_engine_args(_args({}, enable_prefix_caching=True))


def test_settle_engine_args_leaves_stock_engines_alone():
    args = _args()
    assert settings.settle_engine_args(args) is None
    assert args.enable_prefix_caching is None
    settings.check_engine_config(object(), None)  # nothing to check: no attribute is read


def test_settle_engine_args_refuses_bad_h2o_before_anything():
    with pytest.raises(ValueError, match="heavy_ratio"):
        settings.settle_engine_args(_args({"heavy_ratio": 2.0}))
