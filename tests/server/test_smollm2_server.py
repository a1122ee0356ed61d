"""A real model behind `h2o-vllm serve`: SmolLM2-135M-Instruct with H2O on answers exactly as
offline `LLM.generate` / `LLM.chat` does with the same greedy request and budget."""
import pytest
from harness import Offline, Server

BLOCK_SIZE = 16
ENGINE_H2O = {"heavy_ratio": 0.1, "recent_ratio": 0.1}
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-ratio", "0.1", "--h2o-recent-ratio", "0.1",
         "--block-size", str(BLOCK_SIZE)]
MAX_TOKENS = 32
XARGS = {"h2o_heavy_ratio": 0.05, "h2o_recent_ratio": 0.05}
TEXT = ("The Heavy-Hitter Oracle keeps a small set of tokens that receive most of the attention, "
        "together with the most recent tokens, and evicts everything else from the key-value cache. "
        "This lets a language model generate long answers with a fraction of the memory. ")
CHAT = [{"role": "user", "content": TEXT + "In one sentence, what does the Heavy-Hitter Oracle keep?"}]
PROMPT = TEXT + "In short, the Heavy-Hitter Oracle"


@pytest.fixture(scope="module")
def served(smollm2_dir):
    server = Server(smollm2_dir, FLAGS)
    offline = Offline({
        "model": str(smollm2_dir),
        "llm": {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "seed": 0,
                "block_size": BLOCK_SIZE, "additional_config": {"h2o": ENGINE_H2O}},
        "completions": [{"prompt": PROMPT, "max_tokens": MAX_TOKENS, "extra_args": XARGS}],
        "chats": [{"messages": CHAT, "max_tokens": MAX_TOKENS, "extra_args": None}],
    })
    try:
        server.wait_ready()
        server.model = server.client().models.list().data[0].id
        yield server, offline.result()
    finally:
        server.stop()


def test_smollm2_chat_and_completion_match_offline(served):
    server, offline = served
    before = server.settled_metrics()
    client = server.client()
    chat = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    completion = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "vllm_xargs": XARGS})
    assert chat.choices[0].token_ids == offline["chats"][0]
    assert completion.choices[0].token_ids == offline["completions"][0]
    assert chat.choices[0].message.content.strip()
    assert server.settled_metrics()["evicted_tokens_total"] > before["evicted_tokens_total"]
