"""A hybrid real model behind `h2o-vllm serve --kv-eviction h2o`: Gemma 3 270M (15 sliding-window
layers and 3 global ones) answers a prompt of twice its window exactly as the dense oracle does,
and evicts from its global layers."""
import pytest
import torch
from harness import Server

from budgets import oracle

BLOCK_SIZE = 32
BUDGET = {"heavy_ratio": 0.1, "recent_ratio": 0.1}
MAX_TOKENS = 24
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-ratio", "0.1", "--h2o-recent-ratio", "0.1",
         "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def server(gemma3_dir):
    server = Server(gemma3_dir, FLAGS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prompt_and_oracle(gemma3_dir, server):
    """<bos> + 1,100 tokens of the GPL-3, and the oracle's answer (computed while the server starts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    with open("/usr/share/common-licenses/GPL-3") as f:
        prompt = tokenizer(" ".join(f.read().split())).input_ids[:1101]
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    return prompt, oracle(model, BUDGET, BLOCK_SIZE).generate([prompt], MAX_TOKENS)[0]


def test_gemma3_served_completion_equals_oracle_and_evicts(server, prompt_and_oracle):
    prompt, want = prompt_and_oracle
    server.wait_ready()
    before = server.settled_metrics()
    client = server.client()
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert completion.choices[0].token_ids == want
    after = server.settled_metrics()
    assert after["evicted_tokens_total"] > before["evicted_tokens_total"]
