"""frontend.settings: what the engine-args hook settles before vLLM builds its config.

On vLLM's real ``EngineArgs`` (nothing is built or loaded); the engine-level check that the
built config carries the result is tests/engine/test_conflicts_refused_before_load.py.
"""
import pytest
from vllm.engine.arg_utils import EngineArgs

from h2o_vllm.frontend import settings


def _args(h2o=None, **kwargs):
    return EngineArgs(model="unused", additional_config={} if h2o is None else {"h2o": h2o}, **kwargs)


@pytest.mark.parametrize("given", [None, True, False])
def test_settle_engine_args_leaves_prefix_caching_as_given(given, caplog):
    """H2O keeps prefix caching exact: vLLM's default (None: on) and an explicit choice stay,
    without a warning."""
    args = _args({"heavy_ratio": 0.1}, enable_prefix_caching=given)
    with caplog.at_level("WARNING", logger="h2o_vllm"):
        config = settings.settle_engine_args(args)
    assert config is not None and config.heavy_ratio == 0.1
    assert args.enable_prefix_caching is given
    assert "prefix caching" not in caplog.text


def test_settle_engine_args_leaves_stock_engines_alone():
    args = _args()
    assert settings.settle_engine_args(args) is None
    assert args.enable_prefix_caching is None
    settings.check_engine_config(object(), None)  # nothing to check: no attribute is read


def test_settle_engine_args_refuses_bad_h2o_before_anything():
    with pytest.raises(ValueError, match="heavy_ratio"):
        settings.settle_engine_args(_args({"heavy_ratio": 2.0}))


@pytest.mark.parametrize("interval, warned", [(1, True), (8, False), (None, False)])
def test_interval_one_with_a_speculator_warns_that_no_draft_fits(monkeypatch, caplog, interval, warned):
    from types import SimpleNamespace

    from h2o_vllm.config import H2OConfig
    monkeypatch.setattr(settings.conflicts, "has_full_attention", lambda model: True)
    monkeypatch.setattr(settings.conflicts, "check_vllm_config", lambda *args: None)
    monkeypatch.setattr(settings.cuda_config, "check_vllm_config", lambda *args: None)
    built = SimpleNamespace(model_config=object(),
                            speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens=3))
    with caplog.at_level("WARNING", logger="vllm.h2o_vllm"):
        settings.check_engine_config(built, H2OConfig(heavy_tokens=8, recent_tokens=8, interval=interval))
    assert ("every draft is cut" in caplog.text) is warned
