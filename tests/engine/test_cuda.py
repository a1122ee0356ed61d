"""H2O on CUDA (vLLM's Triton attention + H2O's Triton kernels): token-for-token the dense oracle,
H2O off equals stock vLLM, blocks follow the live KV length and the pool drains.

GPU only (marker ``gpu``, skipped without CUDA); ``benchmarks/gpu_check.sh`` runs this file.
The engines keep H2O's CUDA defaults (h2o_vllm.cuda_config): backend CUSTOM, V1 runner, no
async scheduling, piecewise CUDA graphs with attention outside them (torch.compile on), except
one eager engine. fp32 on the peaky tiny Llama, as the CPU exactness tests.
"""
import pytest
import torch

from budgets import BUDGETS, LARGER_THAN_EVERY_SEQUENCE, extra_args, oracle_config
from engines import generate_ids, greedy, random_prompts, scheduler_of, vllm_engine
from h2o_vllm.reference import H2OReference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 40
PROMPT_LENGTHS = (1, 15, 16, 17, 33, 100, 300)
PROMPTS = random_prompts(PROMPT_LENGTHS)
BLOCK = 16
# A small pool and a fraction of the GPU: H2O's fp32 score buffers (4 bytes per token, KV head
# and layer) are allocated outside the KV memory vLLM budgets (docs/cuda.md).
GPU = dict(gpu_memory_utilization=0.3, num_gpu_blocks_override=512)


def _cuda_engine(model_dir, **kwargs):
    return vllm_engine(model_dir, **{"enforce_eager": False, **GPU, **kwargs})


@pytest.fixture(scope="module")
def stock_outputs(tiny_llama_dir):
    # Stock Triton attention: the backend H2O builds on (fp32 rules out FlashAttention anyway).
    with _cuda_engine(tiny_llama_dir, plugins=False, block_size=BLOCK,
                      attention_backend="TRITON_ATTN") as llm:
        return generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["piecewise-graphs", "eager-chunked"])
def h2o_outputs(request, tiny_llama_dir):
    """{budget name: outputs} from one H2O engine serving the whole matrix per request."""
    kwargs = dict(block_size=BLOCK)
    if request.param == "eager-chunked":
        kwargs.update(enforce_eager=True, max_num_batched_tokens=64, max_num_seqs=8)
    names = list(BUDGETS) + ["larger", "engine-default"]
    budgets = {**BUDGETS, "larger": LARGER_THAN_EVERY_SEQUENCE, "engine-default": {}}
    params = [greedy(MAX_TOKENS, extra_args=extra_args(budgets[name]) or None)
              for name in names for _ in PROMPTS]
    with _cuda_engine(tiny_llama_dir, additional_config={"h2o": {}}, **kwargs) as llm:
        config = llm.llm_engine.vllm_config
        assert not config.use_v2_model_runner
        assert not config.scheduler_config.async_scheduling
        assert not config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        assert config.attention_config.backend.name == "CUSTOM"
        outputs = generate_ids(llm, PROMPTS * len(names), params)
    n = len(PROMPTS)
    return {name: outputs[i * n:(i + 1) * n] for i, name in enumerate(names)}


def test_cuda_h2o_off_is_stock_vllm(tiny_llama_dir, stock_outputs):
    """Plugin loaded, H2O off, our backend named explicitly: still stock vLLM's tokens."""
    with _cuda_engine(tiny_llama_dir, block_size=BLOCK, attention_backend="CUSTOM") as llm:
        assert generate_ids(llm, PROMPTS, greedy(MAX_TOKENS)) == stock_outputs


def test_cuda_budget_larger_than_every_sequence_is_stock_vllm(h2o_outputs, stock_outputs):
    assert h2o_outputs["larger"] == stock_outputs


@pytest.mark.parametrize("budget", list(BUDGETS) + ["engine-default"])
def test_cuda_h2o_matches_dense_oracle(h2o_outputs, hf_model, budget, stock_outputs):
    config = oracle_config(BUDGETS.get(budget, {}), BLOCK)
    expected = H2OReference(hf_model, config).generate(PROMPTS, MAX_TOKENS)
    for length, got, want in zip(PROMPT_LENGTHS, h2o_outputs[budget], expected):
        assert got == want, f"prompt of {length} tokens diverges from the oracle"
    assert h2o_outputs[budget] != stock_outputs  # the control: eviction changed something


def test_cuda_blocks_follow_live_kv_length_and_drain(tiny_llama_dir):
    from vllm.utils.math_utils import cdiv

    from h2o_vllm.config import H2OConfig
    from h2o_vllm.policy import kv_len_after
    h2o = {"heavy_ratio": 0.1, "recent_ratio": 0.1}
    with _cuda_engine(tiny_llama_dir, in_process=True, block_size=BLOCK,
                      additional_config={"h2o": h2o}) as llm:
        scheduler, engine = scheduler_of(llm), llm.llm_engine
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        for i, prompt in enumerate(random_prompts([20, 64, 100, 200], seed=3)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(80))
        evicted, finished = 0, 0
        while engine.has_unfinished_requests():
            finished += sum(out.finished for out in engine.step())
            for request in scheduler.running:
                scheduler.kv_cache_manager.remove_skipped_blocks(
                    request.request_id, request.num_computed_tokens, request.num_prompt_tokens)
                kv_len = kv_len_after(request.num_computed_tokens, request.num_prompt_tokens,
                                      H2OConfig.from_dict(h2o), BLOCK)
                assert len(manager.req_to_blocks[request.request_id]) == cdiv(kv_len, BLOCK)
                evicted = max(evicted, request.num_computed_tokens - kv_len)
        assert finished == 4 and evicted > 0
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
