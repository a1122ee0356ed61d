"""The CUDA glue without a GPU: metadata in KV space, one layer's H2O step, config, registration.

The Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported, as in test_kernels.py) on CPU tensors; the vLLM classes of the CPU build
carry the same Python sources as the CUDA wheel's for triton_attn. Not covered here (needs a
GPU; tests/engine/test_cuda.py and benchmarks/gpu_check.sh): the stock Triton attention and
reshape_and_cache kernels, CUDA graphs, and vLLM's CUDA platform selecting the backend.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.worker import cuda_step  # noqa: E402
from h2o_vllm.worker.plan import make_step_plan  # noqa: E402

if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no GPU", allow_module_level=True)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
BLOCK = 16


def _plan(num_computed, query_lens, prompt_lens, heavy=4, recent=4, interval=4):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    n = len(num_computed)
    return make_step_plan(t(num_computed), t(query_lens), t(prompt_lens), t([heavy] * n),
                          t([recent] * n), t([interval] * n))


def _block_table(num_rows, blocks_per_row, seed=0):
    perm = torch.randperm(num_rows * blocks_per_row + 1, generator=torch.Generator().manual_seed(seed))
    perm = perm[perm != 0][: num_rows * blocks_per_row]  # block 0 is never a row's
    return perm.view(num_rows, blocks_per_row).to(torch.int32).to(DEVICE)


def test_kv_slot_mapping_matches_cpu_builder_and_keeps_padding():
    from h2o_vllm.worker.builder import kv_slot_mapping as cpu_kv_slot_mapping
    plan = _plan([30, 5, 0], [1, 7, 3], [20, 12, 3])
    table = _block_table(3, 4)
    padded = torch.zeros(plan.query_lens.sum() + 5, dtype=torch.int64, device=DEVICE)
    slots = cuda_step.kv_slot_mapping(plan, table, padded, BLOCK)
    expected = cpu_kv_slot_mapping(plan, table.cpu(), int(plan.query_lens.sum()), BLOCK)
    assert slots.shape == padded.shape and slots.device == table.device
    assert torch.equal(slots[:11].cpu(), expected)
    assert (slots[11:] == -1).all()
    # Row 0 decodes past its first compaction: its new token sits right after the live window.
    kv_before = int(plan.kv_lens_before[0])
    assert int(slots[0]) == int(table[0, kv_before // BLOCK]) * BLOCK + kv_before % BLOCK


def test_h2o_common_metadata_is_kv_space_with_logical_positions():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from h2o_vllm.worker.cuda import h2o_common_metadata
    plan = _plan([30, 5], [1, 7], [20, 12])
    table = _block_table(3, 4)  # one padding row, as under CUDA-graph padding
    num_tokens = 8
    positions = torch.tensor([30, 5, 6, 7, 8, 9, 10, 11], device=DEVICE)
    logical_seq_lens = torch.tensor([31, 12, 0], dtype=torch.int32, device=DEVICE)
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 8, 8], dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=torch.tensor([0, 1, 8, 8], dtype=torch.int32),
        seq_lens=logical_seq_lens, num_reqs=2, num_actual_tokens=num_tokens, max_query_len=7,
        max_seq_len=31, block_table_tensor=table,
        slot_mapping=torch.zeros(num_tokens + 2, dtype=torch.int64, device=DEVICE),
        positions=positions)
    out, step = h2o_common_metadata(cm, plan, BLOCK)
    assert out.seq_lens.tolist() == plan.kv_seq_lens.tolist() + [0]
    assert out.seq_lens.dtype == torch.int32 and out.max_seq_len == int(plan.kv_seq_lens.max())
    assert out.positions is positions and out.query_start_loc is cm.query_start_loc
    assert torch.equal(logical_seq_lens.cpu(), torch.tensor([31, 12, 0], dtype=torch.int32))
    assert out.slot_mapping.shape == cm.slot_mapping.shape and (out.slot_mapping[8:] == -1).all()
    assert step.kv_seq_lens.tolist() == plan.kv_seq_lens.tolist()
    assert step.decode_rows.tolist() == [0] and step.decode_tokens.tolist() == [0]
    assert step.prefill_rows.tolist() == [1] and step.prefill_tokens.tolist() == list(range(1, 8))
    assert step.prefill_query_start_loc.tolist() == [0, 7]
    # Row 1 ends its 12-token prompt here: compacted to heavy + recent = 8 in this step.
    assert plan.due.tolist() == [False, True]
    assert [(g.rows.tolist(), g.heavy, g.target, g.blocks.shape[1]) for g in step.due] == [([1], 4, 8, 12)]


def _cpu_path_step(plan, query, keys, values, scores_nhb, table, slots, scale):
    """The CPU backend's torch sequence (H2OCPUImpl._update_scores_and_compact) on the same
    [num_blocks, block_size, num_kv_heads, head_size] views: the reference for the CUDA step."""
    from h2o_vllm.worker.compact import compact_row
    from h2o_vllm.worker.scores import accumulate_decode_scores, accumulate_prefill_scores
    scores = scores_nhb.permute(0, 2, 1)  # [num_blocks, block_size, num_kv_heads]
    new = slots[slots >= 0]
    scores[new // BLOCK, new % BLOCK] = 0.0
    starts = torch.cumsum(plan.query_lens, 0) - plan.query_lens
    for row in range(plan.query_lens.shape[0]):
        start, q_len, kv_len = int(starts[row]), int(plan.query_lens[row]), int(plan.kv_seq_lens[row])
        if q_len == 1:
            accumulate_decode_scores(query[start:start + 1], keys.permute(0, 2, 3, 1), scores_nhb,
                                     table[row:row + 1], plan.kv_seq_lens[row:row + 1], scale)
        else:
            accumulate_prefill_scores(query[start:start + q_len], keys.permute(0, 2, 3, 1), scores_nhb,
                                      table[row], kv_len, scale)
    for row in plan.due.nonzero().flatten().tolist():
        compact_row(keys, values, scores, table[row], int(plan.kv_seq_lens[row]),
                    int(plan.kv_lens_after[row]), int(plan.heavy[row]))


@pytest.mark.parametrize("group", [1, 3])
def test_one_layer_h2o_steps_match_the_cpu_path(group):
    """A tiny layer over a whole schedule (chunked prefill beside a prompt, mixed prefill and
    decode steps, compactions at the prompt's end and every interval): write K/V at the KV
    slots, then update_scores_and_compact (Triton kernels); the CPU path's torch ops on a copy
    must give the same live K, V and scores after every step."""
    torch.manual_seed(0)
    num_kv_heads, head_size, prompts = 2, 16, [20, 13]
    scale = head_size ** -0.5
    table = _block_table(2, 2, seed=1)
    num_blocks = int(table.max()) + 1
    shape = (num_blocks, BLOCK, num_kv_heads, head_size)
    keys, values = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    scores = torch.rand(num_blocks, num_kv_heads, BLOCK, device=DEVICE)  # stale values
    ref = [t.clone().cpu() for t in (keys, values, scores)]
    # (tokens already computed, tokens this step) per row: A's prompt at once, B's in chunks.
    schedule = [[(0, 20), (0, 8)], [(20, 1), (8, 5)]] + [[(21 + i, 1), (13 + i, 1)] for i in range(7)]
    compacted = 0
    for step_rows in schedule:
        plan = _plan([c for c, _ in step_rows], [q for _, q in step_rows], prompts)
        num_tokens = int(plan.query_lens.sum())
        query = torch.randn(num_tokens + 3, num_kv_heads * group, head_size, device=DEVICE)  # padded
        slot_shape = torch.zeros(num_tokens + 3, dtype=torch.int64, device=DEVICE)
        slots = cuda_step.kv_slot_mapping(plan, table, slot_shape, BLOCK)
        new_k = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        new_v = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
        for k_cache, v_cache in ((keys, values), (ref[0], ref[1])):  # reshape_and_cache
            s = slots[:num_tokens].to(k_cache.device)
            k_cache[s // BLOCK, s % BLOCK] = new_k.to(k_cache.device)
            v_cache[s // BLOCK, s % BLOCK] = new_v.to(k_cache.device)
        step = cuda_step.make_cuda_step(plan, table, slots, BLOCK)
        mass = cuda_step.update_scores_and_compact(step, query, keys, values, scores, table, scale)
        _cpu_path_step(plan, query.cpu(), ref[0], ref[1], ref[2], table.cpu(), slots.cpu(), scale)
        compacted += int(plan.due.sum())
        for row in range(2):
            kv_len = int(plan.kv_lens_after[row])
            pos = torch.arange(kv_len)
            blk, off = table.cpu()[row].long()[pos // BLOCK], pos % BLOCK
            torch.testing.assert_close(keys.cpu()[blk, off], ref[0][blk, off], rtol=0, atol=0)
            torch.testing.assert_close(values.cpu()[blk, off], ref[1][blk, off], rtol=0, atol=0)
            torch.testing.assert_close(scores.cpu()[blk, :, off], ref[2][blk, :, off],
                                       rtol=1e-5, atol=1e-5)
        if plan.due.any():
            assert 0 < float(mass[1]) <= float(mass[0])
        else:
            assert mass.tolist() == [0.0, 0.0]
    assert compacted >= 4  # both rows compacted after their prompt and again on the cadence


def _engine_args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model="unused", additional_config={"h2o": {}}, **kwargs)


def test_cuda_config_defaults_backend_v1_sync_piecewise(monkeypatch, caplog):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm import cuda_config
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

    from h2o_vllm import cuda_config
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
    from h2o_vllm import cuda_config
    if env is None:
        monkeypatch.delenv(cuda_config.V2_ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_config.V2_ENV, env)
    with pytest.raises(ValueError, match="H2O KV eviction") as info:
        cuda_config.adjust_engine_args(_engine_args(**kwargs), is_cuda=True)
    assert words in str(info.value)


def test_cuda_config_leaves_other_platforms_alone(monkeypatch):
    from h2o_vllm import cuda_config
    monkeypatch.delenv(cuda_config.V2_ENV, raising=False)
    args = _engine_args()
    before = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
    cuda_config.adjust_engine_args(args, is_cuda=False)
    cuda_config.check_vllm_config(SimpleNamespace(use_v2_model_runner=True), is_cuda=False)
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
    from h2o_vllm import cuda_config
    with pytest.raises(ValueError, match="H2O KV eviction") as info:
        cuda_config.check_vllm_config(_built(**built), is_cuda=True)
    assert words in str(info.value)


def test_cuda_config_accepts_piecewise_and_eager():
    from h2o_vllm import cuda_config
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


def test_custom_backend_registered_on_cuda_only():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from h2o_vllm import plugin
    from h2o_vllm.worker.cuda import H2OTritonAttentionBackend
    saved = dict(registry._ATTN_OVERRIDES)
    try:
        registry._ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
        plugin._register_cuda_backend(is_cuda=False)
        assert AttentionBackendEnum.CUSTOM not in registry._ATTN_OVERRIDES
        plugin._register_cuda_backend(is_cuda=True)
        backend = AttentionBackendEnum.CUSTOM.get_class()
        assert backend is H2OTritonAttentionBackend
        assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
        # What CudaPlatform.get_attn_backend_cls does with a selected backend (Hopper, bf16).
        reasons = backend.validate_configuration(
            head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
            use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
            attn_type="decoder")
        assert reasons == []
    finally:
        registry._ATTN_OVERRIDES.clear()
        registry._ATTN_OVERRIDES.update(saved)


def test_builder_refuses_full_graphs_only_with_h2o():
    from vllm.v1.attention.backend import AttentionCGSupport

    from h2o_vllm.worker.cuda import H2OTritonMetadataBuilder
    on = SimpleNamespace(additional_config={"h2o": {}})
    off = SimpleNamespace(additional_config={})
    assert H2OTritonMetadataBuilder.get_cudagraph_support(on, None) == AttentionCGSupport.NEVER
    assert H2OTritonMetadataBuilder.get_cudagraph_support(off, None) == AttentionCGSupport.ALWAYS
