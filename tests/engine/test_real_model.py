"""H2O inside vLLM equals the dense oracle on a real trained model: SmolLM2-135M-Instruct
(fp32, GQA 9/3 heads, 30 layers) on real English text (the GPL-3), token for token."""
import pytest
import torch

from budgets import extra_args, oracle
from engines import generate_ids, greedy, vllm_engine
from h2o_vllm.oracle import H2OOracle

BLOCK = 32
MAX_TOKENS = 32
BUDGETS = {
    "ratio-0.1+0.1-interval1": {"heavy_ratio": 0.1, "recent_ratio": 0.1, "interval": 1, "min_tokens": 0},
    "ratio-0.1+0.1-block": {"heavy_ratio": 0.1, "recent_ratio": 0.1},  # with the default floor
}


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer
    with open("/usr/share/common-licenses/GPL-3") as f:
        ids = AutoTokenizer.from_pretrained(smollm2_dir)(" ".join(f.read().split())).input_ids
    return [ids[i * 500:i * 500 + n] for i, n in enumerate((40, 120, 250, 400))]


@pytest.fixture(scope="module")
def oracle_outputs(smollm2_dir, prompts):
    """{budget name or "full": outputs}, computed before any engine runs in this process
    (the oracle is several times slower once an engine has shared the process)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    outputs = {name: oracle(model, budget, BLOCK).generate(prompts, MAX_TOKENS)
               for name, budget in BUDGETS.items()}
    outputs["full"] = H2OOracle(model, None).generate(prompts, MAX_TOKENS)
    return outputs


@pytest.fixture(scope="module")
def vllm_outputs(smollm2_dir, prompts, oracle_outputs):
    params = [greedy(MAX_TOKENS, extra_args=extra_args(b)) for b in BUDGETS.values() for _ in prompts]
    with vllm_engine(smollm2_dir, block_size=BLOCK, additional_config={"h2o": {}}) as llm:
        outputs = generate_ids(llm, prompts * len(BUDGETS), params)
    return {name: outputs[i * len(prompts):(i + 1) * len(prompts)] for i, name in enumerate(BUDGETS)}


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_smollm2_h2o_matches_dense_oracle(oracle_outputs, vllm_outputs, budget):
    assert vllm_outputs[budget] == oracle_outputs[budget]
    assert oracle_outputs[budget] != oracle_outputs["full"], "eviction changed nothing: the comparison proves little"
