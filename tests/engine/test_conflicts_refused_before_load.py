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
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_max": 3}}, "--speculative-config"),
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
     "--kv-transfer-config"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2"),
    ({"additional_config": {"h2o": {"heavy_tokens": 600, "recent_tokens": 600}}}, "max_model_len=1024"),
])
def test_conflicting_settings_refused_before_loading(tiny_llama_dir, kwargs, words):
    kwargs = {"additional_config": H2O, **kwargs}
    message = _refused(tiny_llama_dir, **kwargs)
    assert words in message and "H2O" in message


def test_sliding_window_model_refused_before_loading(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "mistral-swa"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    (model_dir / "config.json").write_text(json.dumps(config))
    message = _refused(model_dir, additional_config=H2O)
    assert "sliding_window=64" in message and "--disable-sliding-window" in message


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
