"""H2O inside vLLM is token-for-token the dense oracle (fp32, peaky tiny Llama).

One engine per block-size/chunking setting serves the whole budget matrix through
per-request budgets; the stock engine (plugin left out) is the control for H2O off and for
a budget larger than every sequence.
"""
import pytest
import torch

from budgets import BUDGETS, LARGER_THAN_EVERY_SEQUENCE, MODES, extra_args, oracle
from engines import generate_ids, greedy, random_prompts, vllm_engine

MAX_TOKENS = 40
# Shorter than the budget, at and around block boundaries, and several blocks long.
PROMPT_LENGTHS = (1, 3, 15, 16, 17, 33, 64, 100, 160, 300)
PROMPTS = random_prompts(PROMPT_LENGTHS)

ENGINES = {
    "block16": dict(block_size=16),
    # Long prompts are prefilled in chunks of at most 64 tokens across several steps.
    "block32-chunked": dict(block_size=32, max_num_batched_tokens=64, max_num_seqs=8),
    "block128": dict(block_size=128),
}


@pytest.fixture(scope="module")
def stock_outputs(tiny_llama_dir):
    with vllm_engine(tiny_llama_dir, plugins=False, block_size=32) as llm:
        return generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(ENGINES))
def h2o_outputs(request, tiny_llama_dir):
    """{budget name: outputs} from one H2O engine; the engine-wide config is the paper's
    default and every budget of the matrix arrives per request."""
    kwargs = ENGINES[request.param]
    names = list(BUDGETS) + list(MODES) + ["larger", "engine-default"]
    budgets = {**BUDGETS, **MODES, "larger": LARGER_THAN_EVERY_SEQUENCE, "engine-default": {}}
    params = [greedy(MAX_TOKENS, extra_args=extra_args(budgets[name]) or None)
              for name in names for _ in PROMPTS]
    with vllm_engine(tiny_llama_dir, additional_config={"h2o": {}}, **kwargs) as llm:
        outputs = generate_ids(llm, PROMPTS * len(names), params)
    n = len(PROMPTS)
    return kwargs["block_size"], {name: outputs[i * n:(i + 1) * n] for i, name in enumerate(names)}


def test_h2o_off_is_stock_vllm(tiny_llama_dir, stock_outputs):
    with vllm_engine(tiny_llama_dir, block_size=32) as llm:
        assert generate_ids(llm, PROMPTS, greedy(MAX_TOKENS)) == stock_outputs


def test_budget_larger_than_every_sequence_is_stock_vllm(h2o_outputs, stock_outputs):
    _, outputs = h2o_outputs
    assert outputs["larger"] == stock_outputs


@pytest.mark.parametrize("budget", list(BUDGETS) + list(MODES) + ["engine-default"])
def test_h2o_matches_dense_oracle(h2o_outputs, hf_model, budget, stock_outputs):
    block_size, outputs = h2o_outputs
    config = {**BUDGETS, **MODES}.get(budget, {})
    expected = oracle(hf_model, config, block_size).generate(PROMPTS, MAX_TOKENS)
    for length, got, want in zip(PROMPT_LENGTHS, outputs[budget], expected):
        assert got == want, f"prompt of {length} tokens diverges from the oracle"
    # The control: eviction really changed something, so this test could have failed.
    assert outputs[budget] != stock_outputs
