"""frontend.cuda_config: the engine settings the CUDA path needs, chosen or refused before load.

Runs without a GPU: ``is_cuda`` is passed in, and the built configs are vLLM's own
``CompilationConfig`` inside stand-ins.
"""
import dataclasses
import os
from types import SimpleNamespace

import pytest


def _engine_args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model="unused", additional_config={"h2o": {}}, **kwargs)


def test_cuda_config_defaults_backend_v1_sync_piecewise(monkeypatch, caplog):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm.frontend import cuda_config
    monkeypatch.delenv(cuda_config.V2_ENV, raising=False)
    args = _engine_args()
    with caplog.at_level("WARNING", logger="h2o_vllm"):
        cuda_config.adjust_engine_args(args, is_cuda=True)
    assert args.attention_backend == AttentionBackendEnum.CUSTOM
    assert os.environ[cuda_config.V2_ENV] == "0"
    assert args.async_scheduling is False
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    text = caplog.text
    for words in ("attention backend", "V1 model runner", "async scheduling", "PIECEWISE"):
        assert words in text


def test_cuda_config_keeps_explicit_compatible_choices(monkeypatch):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm.frontend import cuda_config
    monkeypatch.setenv(cuda_config.V2_ENV, "0")
    args = _engine_args(attention_backend="CUSTOM", async_scheduling=False, enforce_eager=True)
    cuda_config.adjust_engine_args(args, is_cuda=True)
    assert args.attention_backend in ("CUSTOM", AttentionBackendEnum.CUSTOM)
    assert args.compilation_config.cudagraph_mode is None  # eager: vLLM sets NONE
    args = _engine_args(compilation_config={"cudagraph_mode": "PIECEWISE"})
    cuda_config.adjust_engine_args(args, is_cuda=True)
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("kwargs, env, words", [
    (dict(attention_backend="FLASH_ATTN"), None, "--attention-backend FLASH_ATTN"),
    (dict(compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}), None, "FULL_AND_PIECEWISE"),
    (dict(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}), None, "--enforce-eager"),
    (dict(), "1", "VLLM_USE_V2_MODEL_RUNNER=1"),
])
def test_cuda_config_refuses_explicit_conflicts(monkeypatch, kwargs, env, words):
    from h2o_vllm.frontend import cuda_config
    if env is None:
        monkeypatch.delenv(cuda_config.V2_ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_config.V2_ENV, env)
    with pytest.raises(ValueError, match="H2O KV eviction") as info:
        cuda_config.adjust_engine_args(_engine_args(**kwargs), is_cuda=True)
    assert words in str(info.value)


def test_cuda_config_leaves_other_platforms_alone(monkeypatch):
    from h2o_vllm.frontend import cuda_config
    monkeypatch.delenv(cuda_config.V2_ENV, raising=False)
    args = _engine_args()
    before = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
    cuda_config.adjust_engine_args(args, is_cuda=False)
    cuda_config.check_vllm_config(SimpleNamespace(use_v2_model_runner=False), is_cuda=False)
    assert cuda_config.V2_ENV not in os.environ
    assert (dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))) == before


def _built(mode="PIECEWISE", splitting_ops=None, v2=False, cache_dtype="auto"):
    from vllm.config import CompilationConfig
    ops = list(CompilationConfig._attention_ops) if splitting_ops is None else splitting_ops
    return SimpleNamespace(use_v2_model_runner=v2, cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           compilation_config=CompilationConfig(cudagraph_mode=mode, splitting_ops=ops))


@pytest.mark.parametrize("built, words", [
    (dict(v2=True), "V2 model runner"),
    (dict(mode="FULL"), "cudagraph_mode=FULL"),
    (dict(splitting_ops=[]), "splitting ops"),
    (dict(cache_dtype="fp8"), "--kv-cache-dtype fp8"),
])
def test_cuda_config_refuses_built_configs_h2o_cannot_run(built, words):
    from h2o_vllm.frontend import cuda_config
    with pytest.raises(ValueError, match="H2O KV eviction") as info:
        cuda_config.check_vllm_config(_built(**built), is_cuda=True)
    assert words in str(info.value)


def test_cuda_config_accepts_piecewise_and_eager():
    from h2o_vllm.frontend import cuda_config
    cuda_config.check_vllm_config(_built(), is_cuda=True)
    cuda_config.check_vllm_config(_built(mode="NONE", splitting_ops=[]), is_cuda=True)


def test_v1_runner_follows_the_env_var(monkeypatch):
    """What cuda_config relies on: VllmConfig.use_v2_model_runner reads the env var first."""
    from vllm.config import VllmConfig
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    stand_in = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None))
    prop = VllmConfig.__dict__["use_v2_model_runner"]
    getter = getattr(prop, "fget", None) or getattr(prop, "func")
    assert getter(stand_in) is False


@pytest.mark.parametrize("is_cuda", [False, True], ids=["cpu", "cuda"])
def test_the_v2_runner_is_refused_on_every_platform(is_cuda):
    """On the V2 runner no step plan reaches the builders: H2O would run silently off (issue
    25: the CPU V2 runner under H2O_VLLM_TRITON_ON_CPU gave stock tokens). Refused until the
    runner hook covers V2."""
    from h2o_vllm.frontend import cuda_config
    with pytest.raises(ValueError, match="V2 model runner.*VLLM_USE_V2_MODEL_RUNNER=0"):
        cuda_config.check_vllm_config(SimpleNamespace(use_v2_model_runner=True), is_cuda=is_cuda)
