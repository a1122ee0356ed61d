"""Disaggregated prefill and decode served: two `h2o-vllm serve` instances with vLLM's own
``--kv-transfer-config`` (ExampleConnector settings, one storage folder), a prefill one
(``kv_producer``) and a decode one (``kv_consumer``). The client speaks the protocol of
docs/kv-transfer.md: the prefill instance answers the prompt's first token (``max_tokens`` 1),
the decode instance gets the prompt plus that token and loads what the prefill compacted.
The answers equal the dense oracle's (test_kv_transfer_nixl_server.py: the same over NIXL)."""
import json

import pytest
import torch
from harness import Server

from budgets import extra_args, oracle
from h2o_vllm.config import H2OConfig

BLOCK = 16
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 4}
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8",
         "--h2o-interval", "4", "--block-size", str(BLOCK), "--enable-prompt-tokens-details"]
MAX_TOKENS = 24
XARGS = [None, extra_args({"heavy_tokens": 4, "recent_tokens": 6, "interval": 1})]


def _prompts():
    import random
    rng = random.Random(5)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in (30, 120)]


def _kv(role: str, store) -> list[str]:
    config = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    prefill = Server(tiny_llama_dir, [*FLAGS, *_kv("kv_producer", store)])
    decode = Server(tiny_llama_dir, [*FLAGS, *_kv("kv_consumer", store)])
    try:
        prefill.wait_ready(), decode.wait_ready()
        for server in (prefill, decode):
            server.model = server.client().models.list().data[0].id
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def _complete(server, prompt, max_tokens, xargs):
    body = {"ignore_eos": True, "return_token_ids": True, **({"vllm_xargs": xargs} if xargs else {})}
    return server.client().completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0.0, extra_body=body)


def test_prefill_then_decode_served_equals_the_oracle(pair, tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    prefill, decode = pair
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = _prompts()
    for xargs in XARGS:
        config = H2OConfig.from_dict(ENGINE_H2O).with_overrides({k[4:]: v for k, v in (xargs or {}).items()})
        budget = config.budget(1, BLOCK)
        for prompt in prompts:
            first = _complete(prefill, prompt, 1, xargs)
            token = first.choices[0].token_ids[0]
            params = first.kv_transfer_params or (first.model_extra or {}).get("kv_transfer_params")
            assert params and params["h2o_prompt_tokens"] == len(prompt)
            assert params["h2o_kv_tokens"] <= max(len(prompt), budget.tokens + budget.interval)
            rest = _complete(decode, prompt + [token], MAX_TOKENS - 1, xargs).choices[0].token_ids
            dense = config.to_dict()
            assert [token, *rest] == oracle(model, dense, BLOCK).generate([prompt], MAX_TOKENS)[0]
    assert "recomputes its prompt" not in decode.tail(200_000)


def test_vllms_proxy_protocol_original_prompt_with_the_prefills_params(pair, tiny_llama_dir):
    check_proxy_protocol(pair, tiny_llama_dir, "ExampleConnector")


def check_proxy_protocol(pair, tiny_llama_dir, connector: str) -> None:
    """What vLLM's disaggregation proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py
    upstream, not in the wheel) sends: the prefill gets ``kv_transfer_params``
    ``do_remote_decode`` and ``max_tokens`` 1; the decode gets the original request plus the
    prefill's ``kv_transfer_params``, streamed back. The decode's answer is the whole answer,
    the producer's first token included, and equals the oracle's."""
    from transformers import AutoModelForCausalLM
    prefill, decode = pair
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    remote_decode = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
    for stream in (False, True):
        for prompt in _prompts():
            first = prefill.client().completions.create(
                model=prefill.model, prompt=prompt, max_tokens=1, temperature=0.0,
                extra_body={"ignore_eos": True, "kv_transfer_params": remote_decode})
            params = first.kv_transfer_params or (first.model_extra or {}).get("kv_transfer_params")
            assert ("h2o_nixl" in params) == (connector == "NixlConnector")
            body = {"ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params}
            answer = decode.client().completions.create(
                model=decode.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=stream,
                extra_body=body, **({"stream_options": {"include_usage": True}} if stream else {}))
            if stream:
                chunks = list(answer)
                tokens = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
                usage = chunks[-1].usage
            else:
                tokens, usage = answer.choices[0].token_ids, answer.usage
            dense = H2OConfig.from_dict(ENGINE_H2O).to_dict()
            assert tokens == oracle(model, dense, BLOCK).generate([prompt], MAX_TOKENS)[0], (stream, len(prompt))
            assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == len(prompt)
            # The prompt was loaded (vLLM counts loaded tokens as cached), not computed here.
            assert usage.prompt_tokens_details.cached_tokens == len(prompt), usage
    assert "recomputes its prompt" not in decode.tail(200_000)
    # Four prompts each way; each loaded once (its prefill state), none computed on the decoder.
    # (A producer hears of reads at its next step: one more request makes one.)
    _complete(prefill, [5, 6, 7], 2, None)
    produced, consumed = prefill.settled_metrics(), decode.settled_metrics()
    assert consumed["kv_transfer_loaded_prompts_total"] >= 2 * len(_prompts())
    assert consumed.get("kv_transfer_recomputed_prompts_total", 0) == 0
    assert produced["kv_transfer_saved_bytes_total"] > 0
    if connector == "NixlConnector":  # every state was read: the producer's staging is empty
        assert produced["kv_transfer_staging_bytes"] == 0
