"""frontend.cuda_config: the engine settings the CUDA path needs, chosen or refused before load.

Runs without a GPU: ``is_cuda`` is passed in, and the built configs are vLLM's own
``CompilationConfig`` inside stand-ins.
"""
import dataclasses
import os
from types import SimpleNamespace

import pytest

V2 = "VLLM_USE_V2_MODEL_RUNNER"


def _engine_args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model="unused", additional_config={"h2o": {}}, **kwargs)


def test_cuda_config_defaults_backend_piecewise_and_leaves_runner_and_scheduling_to_vllm(monkeypatch, caplog):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm.frontend import cuda_config
    monkeypatch.delenv(V2, raising=False)
    args = _engine_args()
    with caplog.at_level("WARNING", logger="h2o_vllm"):
        cuda_config.adjust_engine_args(args, is_cuda=True)
    assert args.attention_backend == AttentionBackendEnum.CUSTOM
    assert V2 not in os.environ  # vLLM's choice: V2 on CUDA
    assert args.async_scheduling is None  # vLLM's default: on
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    text = caplog.text
    for words in ("attention backend", "PIECEWISE"):
        assert words in text
    assert "async" not in text and "runner" not in text


def test_cuda_config_keeps_explicit_compatible_choices(monkeypatch):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm.frontend import cuda_config
    monkeypatch.setenv(V2, "0")
    args = _engine_args(attention_backend="CUSTOM", async_scheduling=False, enforce_eager=True)
    cuda_config.adjust_engine_args(args, is_cuda=True)
    assert args.attention_backend in ("CUSTOM", AttentionBackendEnum.CUSTOM)
    assert args.compilation_config.cudagraph_mode is None  # eager: vLLM sets NONE
    args = _engine_args(compilation_config={"cudagraph_mode": "PIECEWISE"})
    cuda_config.adjust_engine_args(args, is_cuda=True)
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("kwargs, words", [
    (dict(attention_backend="FLASH_ATTN"), "--attention-backend FLASH_ATTN"),
    (dict(compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}), "FULL_AND_PIECEWISE"),
    (dict(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}), "--enforce-eager"),
])
def test_cuda_config_refuses_explicit_conflicts(kwargs, words):
    from h2o_vllm.frontend import cuda_config
    with pytest.raises(ValueError, match="H2O KV eviction") as info:
        cuda_config.adjust_engine_args(_engine_args(**kwargs), is_cuda=True)
    assert words in str(info.value)


def test_cuda_config_leaves_other_platforms_alone(monkeypatch):
    from h2o_vllm.frontend import cuda_config
    monkeypatch.delenv(V2, raising=False)
    args = _engine_args()
    before = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
    cuda_config.adjust_engine_args(args, is_cuda=False)
    cuda_config.check_vllm_config(_built(), is_cuda=False)
    assert V2 not in os.environ
    assert (dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))) == before


def _built(mode="PIECEWISE", splitting_ops=None, v2=False, cache_dtype="auto", block_size=32, head_size=64):
    from vllm.config import CompilationConfig
    ops = list(CompilationConfig._attention_ops) if splitting_ops is None else splitting_ops
    return SimpleNamespace(use_v2_model_runner=v2,
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block_size),
                           model_config=SimpleNamespace(get_head_size=lambda: head_size),
                           compilation_config=CompilationConfig(cudagraph_mode=mode, splitting_ops=ops))


@pytest.mark.parametrize("built, words", [
    (dict(mode="FULL"), "cudagraph_mode=FULL"),
    (dict(splitting_ops=[]), "splitting ops"),
    (dict(cache_dtype="fp8_per_token_head"), "Use --kv-cache-dtype fp8"),
    (dict(cache_dtype="fp8_e5m2"), "fp8_e5m2 is untested"),
    (dict(cache_dtype="int8_per_token_head"), "per-token-head"),
])
def test_cuda_config_refuses_built_configs_h2o_cannot_run(built, words):
    from h2o_vllm.frontend import cuda_config
    with pytest.raises(ValueError, match="H2O KV eviction") as info:
        cuda_config.check_vllm_config(_built(**built), is_cuda=True)
    assert words in str(info.value)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3"])
def test_an_fp8_cache_with_per_tensor_scales_passes_where_vllm_reads_it(monkeypatch, cache_dtype):
    from h2o_vllm.config import TRITON_ON_CPU_SWITCH
    from h2o_vllm.frontend import cuda_config
    cuda_config.check_vllm_config(_built(cache_dtype=cache_dtype, block_size=16), is_cuda=True)
    monkeypatch.delenv(TRITON_ON_CPU_SWITCH, raising=False)
    monkeypatch.setattr(cuda_config, "_cpu_reads_fp8", lambda: True)
    cuda_config.check_vllm_config(_built(cache_dtype=cache_dtype), is_cuda=False)  # the CPU backend
    monkeypatch.setenv(TRITON_ON_CPU_SWITCH, "1")  # the CUDA path on the CPU: any block size
    cuda_config.check_vllm_config(_built(cache_dtype=cache_dtype, block_size=16), is_cuda=False)


@pytest.mark.parametrize("block_size, head_size, isa, words", [
    (16, 64, True, "--block-size a multiple of 32 (got 16"),
    (32, 80, True, "a head size that is a multiple of 32 (this model's is 80)"),
    (32, 64, False, "AVX-512 or AMX"),
])
def test_an_fp8_cache_on_the_cpu_backend_is_refused_where_vllms_cpu_attention_cannot_read_it(
        monkeypatch, block_size, head_size, isa, words):
    from h2o_vllm.config import TRITON_ON_CPU_SWITCH
    from h2o_vllm.frontend import cuda_config
    monkeypatch.delenv(TRITON_ON_CPU_SWITCH, raising=False)
    monkeypatch.setattr(cuda_config, "_cpu_reads_fp8", lambda: isa)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 on the CPU backend needs") as info:
        cuda_config.check_vllm_config(_built(cache_dtype="fp8", block_size=block_size, head_size=head_size),
                                      is_cuda=False)
    assert words in str(info.value) and "Drop --kv-cache-dtype" in str(info.value)


def test_cuda_config_accepts_piecewise_and_eager_on_either_runner():
    from h2o_vllm.frontend import cuda_config
    for v2 in (False, True):
        cuda_config.check_vllm_config(_built(v2=v2), is_cuda=True)
        cuda_config.check_vllm_config(_built(mode="NONE", splitting_ops=[], v2=v2), is_cuda=True)


@pytest.mark.parametrize("is_cuda", [False, True], ids=["cpu", "cuda"])
def test_the_v2_runner_passes_on_every_platform(is_cuda):
    """Model Runner V2 has its own hook (vllm_hooks/runner_v2.py): no longer refused."""
    from h2o_vllm.frontend import cuda_config
    cuda_config.check_vllm_config(_built(v2=True), is_cuda=is_cuda)


@pytest.mark.parametrize("is_cuda, switch", [(True, None), (False, "1")], ids=["cuda", "cuda-path-on-cpu"])
def test_every_speculator_passes_on_both_runners_of_the_cuda_path(monkeypatch, is_cuda, switch):
    """V2's n-gram drafter was refused while its kernel failed under the interpreter
    (``triton_on_cpu._keep_splat_boolean``); it is engine-tested on V2 now, like the others.
    Beside a KV connector too: a drafter with layers was refused there while a preemption's
    recompute was taken for its divergence (tests/engine/test_cuda.py's transfer pair now
    runs one)."""
    from h2o_vllm.config import TRITON_ON_CPU_SWITCH
    from h2o_vllm.frontend import cuda_config
    if switch:
        monkeypatch.setenv(TRITON_ON_CPU_SWITCH, switch)
    for v2 in (False, True):
        for method in ("ngram", "draft_model", "eagle", "eagle3", "mtp"):
            for connector in (None, SimpleNamespace(kv_connector="ExampleConnector")):
                built = _built(v2=v2)
                built.speculative_config = SimpleNamespace(method=method, num_speculative_tokens=3)
                built.kv_transfer_config = connector
                cuda_config.check_vllm_config(built, is_cuda=is_cuda)
