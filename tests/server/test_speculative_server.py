"""`h2o-vllm serve --kv-eviction h2o --speculative-config ...`: a model's own MTP layer drafting
(a tiny MiMo whose MTP layer mirrors its layer, ``h2o_devtools.models.drafters``) behind the
OpenAI API. Greedy completions, engine and per-request budgets, equal the dense oracle; vLLM's
own speculative counters on /metrics show drafts accepted."""
import json

import pytest
import torch
from harness import Server, serving

from budgets import extra_args, oracle

from h2o_devtools.soak.readings import scrape

BLOCK_SIZE = 16
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 8}
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8", "--h2o-interval", "8",
         "--block-size", str(BLOCK_SIZE), "--speculative-config", MTP]
MAX_TOKENS = 32
#: None: the engine's budget from the flags.
BUDGETS = [None, {"heavy_tokens": 12, "recent_tokens": 12, "interval": 4}, {"heavy_tokens": 96, "recent_tokens": 96}]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from h2o_devtools.models import drafters
    return drafters.build_mtp_target(tmp_path_factory.mktemp("mimo-target"))


@pytest.fixture(scope="module")
def prompts():
    """Random token ids repeated three times (60 and 90 tokens), past every budget but the last."""
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(5, 500, (n,), generator=generator).tolist() * 3 for n in (20, 30)]


@pytest.fixture(scope="module")
def expected(target, prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return [oracle(model, budget or ENGINE_H2O, BLOCK_SIZE).generate(prompts, MAX_TOKENS) for budget in BUDGETS]


@pytest.fixture(scope="module")
def server(target, expected):
    with serving(Server(target, FLAGS)) as server:
        yield server


def test_served_mtp_drafts_equal_the_oracle_with_drafts_accepted(server, prompts, expected):
    for budget, outputs in zip(BUDGETS, expected):
        body = {"ignore_eos": True, "return_token_ids": True}
        if budget:
            body["vllm_xargs"] = extra_args(budget)
        for prompt, want in zip(prompts, outputs):
            got = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0.0, extra_body=body).choices[0].token_ids
            assert got == want, f"budget {budget or 'engine'}: served MTP drafts left the oracle"
    counters = scrape(server.url)
    assert counters["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < counters["vllm:spec_decode_num_accepted_tokens_total"] < counters["vllm:spec_decode_num_draft_tokens_total"]
    assert any(o != expected[-1] for o in expected[:-1]), "eviction changed nothing: the test proves little"

