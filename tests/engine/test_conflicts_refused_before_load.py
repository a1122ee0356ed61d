"""``LLM(...)`` refuses settings H2O cannot run with before any model weight loads: a
``ValueError`` naming the setting, within seconds (no engine process is started)."""
import json
import logging
import shutil
import time

import pytest

from engines import vllm_engine

H2O = {"h2o": {}}
# Importing vLLM and building the config take a few seconds; loading the model would add
# an engine-core process start (20-30 s). A loaded machine gets some slack.
SECONDS = 30


def _refused(model_dir, **kwargs) -> str:
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        with vllm_engine(model_dir, **kwargs):
            pass
    elapsed = time.monotonic() - start
    assert elapsed < SECONDS, f"refused after {elapsed:.0f} s: the model was probably loaded first"
    return str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"speculative_config": {"method": "medusa", "model": "unused", "num_speculative_tokens": 2}},
     "--speculative-config"),
    # Refused on the built config: this CPU engine runs Model Runner V1.
    ({"speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": 3, "prompt_lookup_max": 4}},
     "'ngram_gpu'"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}},
     "--kv-transfer-config"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2"),
    ({"additional_config": {"h2o": {"heavy_tokens": 600, "recent_tokens": 600}}}, "max_model_len=1024"),
])
def test_conflicting_settings_refused_before_loading(tiny_llama_dir, kwargs, words):
    kwargs = {"additional_config": H2O, **kwargs}
    message = _refused(tiny_llama_dir, **kwargs)
    assert words in message and "H2O" in message


@pytest.mark.parametrize("h2o, words", [
    ({"score": "keydif"}, "h2o.score must be one of 'h2o', 'keydiff', 'expected', got 'keydif'"),
    ({"score": "keydiff", "obs_window": 32}, "h2o.score 'keydiff' cannot be combined with h2o.obs_window"),
])
def test_a_bad_score_is_refused_before_loading(tiny_llama_dir, h2o, words):
    """An unknown score name, and a score that cannot combine with a key: the config's message."""
    assert words in _refused(tiny_llama_dir, additional_config={"h2o": h2o})


def test_all_sliding_window_model_runs_without_h2o_and_says_so(tiny_llama_dir, tmp_path, monkeypatch):
    """Every layer slides (Mistral's window): H2O has nothing to evict, so the engine config
    comes out with H2O off for every process, and a warning names the way to have it on (the
    config alone, no engine). Hybrid models are served with H2O: test_architectures.py."""
    from vllm.engine.arg_utils import EngineArgs
    model_dir = tmp_path / "mistral-swa"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    (model_dir / "config.json").write_text(json.dumps(config))
    from h2o_vllm.frontend import settings
    warnings = []
    monkeypatch.setattr(settings.logger, "warning", lambda fmt, *args: warnings.append(fmt % args))
    built = EngineArgs(model=str(model_dir), max_model_len=1024,
                       additional_config={"h2o": {}}).create_engine_config()
    assert "h2o" not in built.additional_config
    assert len(warnings) == 1 and "nothing to evict" in warnings[0] and "--disable-sliding-window" in warnings[0]
    # vLLM then caps max_model_len at the window.
    small = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 8}  # fits 64 tokens
    with_window_off = EngineArgs(model=str(model_dir), max_model_len=64, disable_sliding_window=True,
                                 additional_config={"h2o": small}).create_engine_config()
    assert with_window_off.additional_config["h2o"] == small


def test_prefix_caching_stays_on_by_default_and_when_asked(tiny_llama_dir, caplog):
    """vLLM's default (on) and an explicit --enable-prefix-caching both stay with H2O on, as
    with H2O off, and nothing warns (the config alone, no engine)."""
    from vllm.engine.arg_utils import EngineArgs
    with caplog.at_level(logging.WARNING, logger="h2o_vllm"):
        for given in (None, True):
            config = EngineArgs(model=str(tiny_llama_dir), max_model_len=1024, additional_config=H2O,
                                enable_prefix_caching=given).create_engine_config()
            assert config.cache_config.enable_prefix_caching is True
    assert not any("prefix caching" in r.getMessage() for r in caplog.records)
    stock = EngineArgs(model=str(tiny_llama_dir), max_model_len=1024).create_engine_config()
    assert stock.cache_config.enable_prefix_caching is True
