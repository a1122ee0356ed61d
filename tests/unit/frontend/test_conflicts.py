"""Conflicts H2O refuses before the model loads (h2o_vllm.frontend.conflicts): pure logic over vLLM's
config objects, real ones where they build without a model, stand-ins for the model's attention.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from h2o_vllm.frontend import conflicts
from h2o_vllm.config import H2OConfig

H2O = H2OConfig()


def _model(**overrides):
    """A ModelConfig stand-in: plain causal full attention unless overridden."""
    hf = overrides.pop("hf", {})
    fields = dict(model="m", is_encoder_decoder=False, is_attention_free=False, is_hybrid=False,
                  use_mla=False, uses_alibi=False, architectures=["LlamaForCausalLM"],
                  hf_text_config=SimpleNamespace(**{"model_type": "llama", **hf}), max_model_len=1024,
                  sliding_window=None)
    fields.update(overrides)
    model = SimpleNamespace(**fields)
    model.get_sliding_window = lambda: model.sliding_window
    return model


def _vllm_config(model=None, block_size=16, **overrides):
    fields = dict(speculative_config=None, kv_transfer_config=None,
                  parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
                  scheduler_config=SimpleNamespace(async_scheduling=False),
                  cache_config=SimpleNamespace(block_size=block_size), model_config=model or _model())
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _refusal(check, *args) -> str:
    with pytest.raises(ValueError) as info:
        check(*args)
    return str(info.value)


# --------------------------------------------------------------------------- engine args


def _args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model="unused", **kwargs)


def test_plain_engine_args_pass():
    conflicts.check_engine_args(_args(), H2O)
    conflicts.check_engine_args(_args(tensor_parallel_size=2), H2O)


@pytest.mark.parametrize("kwargs", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}},
    {"spec_method": "ngram", "spec_tokens": 3},
    {"speculative_config": {"model": "draft", "num_speculative_tokens": 2}},
    {"speculative_config": {"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}},
    {"spec_model": "draft"},
    {"speculative_config": {"method": "eagle", "model": "head", "num_speculative_tokens": 3}},
    {"speculative_config": {"method": "eagle3", "model": "head", "num_speculative_tokens": 3}},
    {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
    {"speculative_config": {"method": "mimo_mtp", "num_speculative_tokens": 1}},  # vLLM's older name
    {"spec_method": "mtp", "spec_tokens": 2},
])
def test_ngram_draft_model_eagle_and_mtp_speculation_pass(kwargs):
    conflicts.check_engine_args(_args(**kwargs), H2O)


@pytest.mark.parametrize("kwargs, flag, words", [
    ({"speculative_config": {"method": "medusa", "model": "m", "num_speculative_tokens": 2}},
     "--speculative-config", "'medusa'"),
    ({"spec_method": "suffix"}, "--spec-method", "'suffix'"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 16}}, "--speculative-config",
     "num_speculative_tokens=16"),
])
def test_speculators_h2o_cannot_run_exactly_are_refused_naming_the_way_out(kwargs, flag, words):
    message = _refusal(conflicts.check_engine_args, _args(**kwargs), H2O)
    assert flag in message and words in message and "turn H2O KV eviction off" in message
    if "num_speculative_tokens" not in words:
        assert all(f'"method": "{m}"' in message for m in ("ngram", "eagle3", "draft_model"))
        assert f"drop {flag}" in message


@pytest.mark.parametrize("name", ["NixlPushConnector", "OffloadingConnector", "LMCacheConnectorV1",
                                  "MultiConnector", "SimpleCPUOffloadConnector"])
def test_connectors_that_move_blocks_by_position_are_refused_naming_h2os(name):
    from vllm.config import KVTransferConfig
    kv = KVTransferConfig(kv_connector=name, kv_role="kv_both")
    message = _refusal(conflicts.check_engine_args, _args(kv_transfer_config=kv), H2O)
    assert name in message and "--kv-transfer-config" in message
    assert '"NixlConnector"' in message and '"ExampleConnector"' in message
    assert "by token position" in message and "turn H2O KV eviction off" in message


def test_nixl_connector_settings_run_h2os_nixl_connector_or_name_the_install(monkeypatch):
    from h2o_vllm.kv_transfer import transfer_config
    args = _args(kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    monkeypatch.setattr(transfer_config, "nixl_missing", lambda: "ImportError: No module named 'nixl'")
    message = _refusal(conflicts.check_engine_args, args, H2O)
    assert "NixlConnector" in message and "pip install 'h2o-vllm[nixl]'" in message and "No module" in message
    assert "turn H2O KV eviction off" in message
    monkeypatch.setattr(transfer_config, "nixl_missing", lambda: None)
    conflicts.check_engine_args(args, H2O)
    assert transfer_config.settle(args) == "H2ONixlConnector"
    assert args.kv_transfer_config["kv_connector"] == "H2ONixlConnector"


@pytest.mark.parametrize("as_dict", [True, False])
def test_example_connector_settings_run_h2os_connector(as_dict):
    from vllm.config import KVTransferConfig

    from h2o_vllm.kv_transfer import transfer_config
    fields = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": "/somewhere"}}
    args = _args(kv_transfer_config=dict(fields) if as_dict else KVTransferConfig(**fields))
    conflicts.check_engine_args(args, H2O)
    assert transfer_config.settle(args)
    settled = args.kv_transfer_config
    name = settled["kv_connector"] if as_dict else settled.kv_connector
    assert name == "H2OStorageConnector"
    assert not transfer_config.settle(args)  # settled once; named directly it passes as it is
    conflicts.check_engine_args(args, H2O)


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "draft_model", "eagle", "eagle3", "mtp"])
def test_a_connector_runs_with_every_speculator(method):
    """n-gram lookup has no KV layers of its own; a drafter's own layers travel whole beside
    the H2O state (``kv_transfer.connector``; too many H2O groups beside them are refused when
    the engine starts: tests/unit/kv_transfer/test_groups.py)."""
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    conflicts.check_engine_args(_args(kv_transfer_config=kv, speculative_config=spec), H2O)
    built = SimpleNamespace(method=method, num_speculative_tokens=3, draft_model_config=None)
    conflicts.check_vllm_config(_vllm_config(kv_transfer_config=kv, speculative_config=built,
                                             use_v2_model_runner=True), H2O)


def test_a_connector_on_a_sliding_window_model_is_refused():
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    hybrid = _model(hf={"layer_types": ["sliding_attention", "full_attention"]})
    message = _refusal(conflicts.check_vllm_config, _vllm_config(hybrid, kv_transfer_config=kv), H2O)
    assert "sliding-window layers" in message and "--kv-transfer-config" in message


def test_pipeline_parallel_refused_with_the_way_out():
    message = _refusal(conflicts.check_engine_args, _args(pipeline_parallel_size=2), H2O)
    assert "--pipeline-parallel-size 2" in message and "--pipeline-parallel-size 1" in message


# --------------------------------------------------------------------------- built config


def test_plain_config_passes():
    conflicts.check_vllm_config(_vllm_config(), H2O)


DRAFT = {"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}


@pytest.mark.parametrize("drafter", [DRAFT, {"method": "eagle", "model": "head", "num_speculative_tokens": 3},
                                     {"method": "eagle3", "model": "head", "num_speculative_tokens": 3},
                                     {"method": "mimo_mtp", "num_speculative_tokens": 1}])
@pytest.mark.parametrize("async_scheduling", [None, True])
def test_a_worker_side_drafter_runs_with_async_scheduling_as_vllm_sets_it(drafter, async_scheduling):
    """A draft model's, EAGLE head's or MTP layer's drafts are made by the worker after the
    step, and under async scheduling the next step is scheduled before they are verified: H2O
    holds a compaction back behind them and plans on the verified counts, so the flag (or
    vLLM's default) stands."""
    args = _args(speculative_config=drafter, async_scheduling=async_scheduling)
    conflicts.check_engine_args(args, H2O)
    assert args.async_scheduling is async_scheduling
    spec = SimpleNamespace(method=drafter["method"], num_speculative_tokens=3)
    conflicts.check_vllm_config(_vllm_config(speculative_config=spec,
                                             scheduler_config=SimpleNamespace(async_scheduling=True)), H2O)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp"])
def test_supported_speculation_configs_pass(method):
    spec = SimpleNamespace(method=method, num_speculative_tokens=3,
                           draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="mimo_mtp")))
    conflicts.check_vllm_config(_vllm_config(speculative_config=spec), H2O)


@pytest.mark.parametrize("model_type, words", [("gemma4_mtp", "KV sharing"),
                                               ("step3p5_mtp", "per KV-cache group")])
def test_mtp_layers_drafting_through_a_proposer_of_their_own_are_refused(model_type, words):
    """vLLM drafts with these MTP layers through proposers other than its EAGLE one: Gemma 4's
    read the target's KV cache, which H2O compacts."""
    spec = SimpleNamespace(method="mtp", num_speculative_tokens=1,
                           draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)))
    message = _refusal(conflicts.check_vllm_config, _vllm_config(speculative_config=spec), H2O)
    assert model_type in message and words in message and "--speculative-config" in message
    assert '"method": "ngram"' in message and "turn H2O KV eviction off" in message


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_device_ngram_drafts_run_on_model_runner_v2_and_are_refused_on_v1(v2):
    """V1's ngram_gpu proposer cannot be built on a CPU-only torch (pinned memory), so H2O with
    it is untested; V2 drafts with a kernel of its own, engine-tested
    (``test_cuda_speculative.py::test_speculative_h2o_on_the_cuda_path_equals_the_oracle[ngram_gpu-v2-async]``)."""
    spec = SimpleNamespace(method="ngram_gpu", num_speculative_tokens=3, draft_model_config=None)
    config = _vllm_config(speculative_config=spec, use_v2_model_runner=v2)
    if v2:
        conflicts.check_vllm_config(config, H2O)
        return
    message = _refusal(conflicts.check_vllm_config, config, H2O)
    assert "'ngram_gpu'" in message and "Model Runner V1" in message and "pinned host memory" in message
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in message and '"method": "ngram"' in message
    assert "turn H2O KV eviction off" in message


def test_async_scheduling_passes():
    """H2O's scheduler cuts each step's compaction when it schedules the step."""
    conflicts.check_vllm_config(_vllm_config(scheduler_config=SimpleNamespace(async_scheduling=True)), H2O)


@pytest.mark.parametrize("overrides, setting", [
    ({"speculative_config": SimpleNamespace(method="medusa", num_speculative_tokens=2)},
     "--speculative-config"),
    ({"kv_transfer_config": object()}, "--kv-transfer-config"),
    ({"parallel_config": SimpleNamespace(pipeline_parallel_size=2)}, "--pipeline-parallel-size"),
    ({"parallel_config": SimpleNamespace(pipeline_parallel_size=1, enable_dbo=True)}, "--enable-dbo"),
    ({"parallel_config": SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=2)},
     "--decode-context-parallel-size"),
    ({"parallel_config": SimpleNamespace(pipeline_parallel_size=1, prefill_context_parallel_size=2)},
     "--prefill-context-parallel-size"),
])
def test_settings_vllm_derived_are_refused_too(overrides, setting):
    # e.g. a speculator checkpoint makes vLLM set speculative_config itself.
    assert setting in _refusal(conflicts.check_vllm_config, _vllm_config(**overrides), H2O)


@pytest.mark.parametrize("model, words", [
    (_model(is_encoder_decoder=True), "encoder-decoder"),
    (_model(is_attention_free=True), "attention-free"),
    (_model(is_hybrid=True), "hybrid"),
    (_model(use_mla=True), "MLA"),
    (_model(uses_alibi=True), "ALiBi"),
    (_model(hf={"layer_types": ["full_attention", "chunked_attention"]}), "chunked_attention"),
])
def test_models_h2o_cannot_handle_are_refused(model, words):
    message = _refusal(conflicts.check_model, model)
    assert words in message and "cannot be combined with H2O KV eviction" in message
    assert "turn H2O KV eviction off" in message


def test_hybrid_sliding_window_models_pass_and_all_sliding_ones_have_nothing_to_evict():
    """H2O evicts from a hybrid model's full-attention layers (vLLM keeps the window of the
    others); a model whose every layer slides leaves it nothing: H2O stays off with a warning
    naming --disable-sliding-window (settings.check_engine_config)."""
    hybrid = _model(sliding_window=512, hf={"layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    conflicts.check_model(hybrid)
    assert conflicts.has_full_attention(hybrid) and conflicts.has_full_attention(_model())
    for sliding in (_model(sliding_window=512),
                    _model(sliding_window=512, hf={"layer_types": ["sliding_attention"] * 4})):
        assert not conflicts.has_full_attention(sliding)
        assert "--disable-sliding-window" in conflicts.nothing_to_evict_warning(sliding)


def test_an_all_sliding_model_turns_h2o_off_with_a_warning(caplog):
    from h2o_vllm.frontend import settings
    config = _vllm_config(_model(sliding_window=512))
    config.additional_config = {"h2o": {}}
    with caplog.at_level("WARNING", logger="vllm.h2o_vllm"):
        settings.check_engine_config(config, H2O)
    assert config.additional_config == {} and "nothing to evict" in caplog.text


def test_full_attention_layer_types_pass():
    conflicts.check_model(_model(hf={"layer_types": ["full_attention"] * 4, "attn_logit_softcapping": None}))


def test_soft_capped_logits_pass():
    """Gemma 2's cap is in H2O's scores on both devices' paths (test_architectures.py)."""
    conflicts.check_model(_model(hf={"attn_logit_softcapping": 50.0}))


def test_real_model_config_of_a_sliding_window_model(tiny_llama_dir, tmp_path):
    """The real ModelConfig reads the window from the HF config; --disable-sliding-window
    (the way out the warning names) clears it."""
    import json
    import shutil

    from vllm.config import ModelConfig
    model_dir = tmp_path / "swa"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    (model_dir / "config.json").write_text(json.dumps(config))
    assert not conflicts.has_full_attention(ModelConfig(str(model_dir)))
    assert conflicts.has_full_attention(ModelConfig(str(model_dir), disable_sliding_window=True))
    assert conflicts.has_full_attention(ModelConfig(str(tiny_llama_dir)))


# --------------------------------------------------------------------------- budget vs max_model_len


@pytest.mark.parametrize("h2o, max_model_len, block_size, fits", [
    ({}, 1024, 16, True),                                   # ratios: a 1-token prompt keeps 1 + 1
    ({"heavy_tokens": 500, "recent_tokens": 508}, 1024, 16, True),  # 1024 exactly: evicts at 1024
    ({"heavy_tokens": 500, "recent_tokens": 509}, 1024, 16, False),
    # A set interval wins over the block size (which alone would give the other answer).
    ({"heavy_tokens": 500, "recent_tokens": 500, "interval": 24}, 1024, 64, True),
    ({"heavy_tokens": 500, "recent_tokens": 500, "interval": 25}, 1024, 16, False),
    ({"heavy_tokens": 2000, "recent_ratio": 0.1}, 1024, 16, False),
    ({"heavy_ratio": 1.0, "recent_ratio": 1.0}, 1024, 16, True),  # ratio parts grow with the prompt
    ({"heavy_ratio": 0.0, "recent_tokens": 1000}, 1024, 32, False),
])
def test_budget_must_fit_max_model_len(h2o, max_model_len, block_size, fits):
    config = H2OConfig.from_dict(h2o)
    if fits:
        conflicts.check_budget_fits(config, max_model_len, block_size)
        return
    message = _refusal(conflicts.check_budget_fits, config, max_model_len, block_size)
    assert f"max_model_len={max_model_len}" in message and "never evict" in message
    assert "--max-model-len" in message and "h2o.heavy_tokens" in message


@settings(max_examples=300, deadline=None)
@given(heavy=st.integers(0, 3000), recent=st.integers(0, 3000),
       interval=st.one_of(st.none(), st.integers(1, 3000)),
       block_size=st.sampled_from([1, 16, 32, 256, 2048]), max_model_len=st.integers(1, 4096))
def test_budget_refused_exactly_when_no_sequence_can_be_evicted(heavy, recent, interval, block_size,
                                                                max_model_len):
    """The refusal agrees with the policy: some sequence of at most max_model_len tokens is
    compacted (the longest prompt is the earliest chance) iff the check passes."""
    from h2o_vllm.policy import kv_len_after
    if heavy == recent == 0:
        return
    config = H2OConfig(heavy_tokens=heavy, recent_tokens=recent, interval=interval)
    budget = config.budget(max_model_len, block_size)
    evicts = kv_len_after(max_model_len, max_model_len, budget) < max_model_len
    try:
        conflicts.check_budget_fits(config, max_model_len, block_size)
        refused = False
    except ValueError:
        refused = True
    assert refused == (not evicts)


def test_budget_checked_on_the_built_config():
    config = H2OConfig(heavy_tokens=600, recent_tokens=600)
    message = _refusal(conflicts.check_vllm_config, _vllm_config(_model(max_model_len=1024)), config)
    assert "max_model_len=1024" in message
    conflicts.check_vllm_config(_vllm_config(_model(max_model_len=2048)), config)


# --------------------------------------------------------------------------- the engine-args hook


def test_engine_args_hook_refuses_before_the_config_is_built():
    """The wrapper runs the EngineArgs checks before vLLM's create_engine_config."""
    from h2o_vllm.vllm_hooks.engine_args import _create_engine_config_wrapper
    called = []
    wrapped = _create_engine_config_wrapper(lambda self, *a, **k: called.append(self))
    args = _args(additional_config={"h2o": {}}, spec_method="suffix")
    with pytest.raises(ValueError, match="--spec-method"):
        wrapped(args)
    assert not called
    # H2O off: nothing is checked.
    wrapped(_args(spec_method="suffix"))
    assert called
