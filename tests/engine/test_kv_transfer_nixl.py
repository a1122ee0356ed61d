"""KV transfer with H2O over NIXL (docs/kv-transfer.md): vLLM's ``NixlConnector`` settings run
H2O's NIXL connector. A producer engine prefills and compacts each prompt sent for remote
decode and packs what it kept into its staging memory; a consumer engine, given the original
prompt and the producer's ``kv_transfer_params`` (vLLM's disaggregation proxy protocol), reads
that state with NIXL before the request is admitted, loads it and decodes. The pair equals
the dense oracle token for token.

The producer runs in its own processes (its NIXL agent serves reads while the test drives
the consumer in this process: block lists checked after every step, the pool drained). Then
the faults: bytes that are not the state named (the producer's space reused), a producer
that is gone, an abort while the read is in flight, and the producer's space given back
once read.
"""
import base64
import math

import pytest
import torch

from budgets import BUDGETS, extra_args, oracle
from engines import drive_checked, greedy, random_prompts, scheduler_of, vllm_engine
from h2o_vllm.kv_transfer.transfer_config import nixl_missing

pytestmark = pytest.mark.skipif(nixl_missing() is not None,
                                reason=f"nixl does not import here ({nixl_missing()}): pip install 'h2o-vllm[nixl]'")

BLOCK = 16
MAX_TOKENS = 10
NUM_BLOCKS = 64
STAGING_MIB = 1
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8}
CASES = {
    "engine": {},
    "tokens-8+8-interval1": BUDGETS["tokens-8+8-interval1"],
    "ratio-0.1+0.1-block": BUDGETS["ratio-0.1+0.1-block"],
    "chunk-24-tokens-8+8-interval1": {**BUDGETS["tokens-8+8-interval1"], "prefill_chunk": 24},
}
PROMPT_LENGTHS = (3, 17, 40, 100, 300)
PROMPTS = random_prompts(PROMPT_LENGTHS, seed=7)
REQUESTS = [(case, i) for case in CASES for i in range(len(PROMPTS))]
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _kv_transfer() -> dict:
    """vLLM's NixlConnector settings (H2O runs its own in its place)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"h2o_staging_mib": STAGING_MIB, "h2o_nixl_timeout_s": 150}}


def _engine(model_dir, in_process: bool):
    return vllm_engine(model_dir, in_process=in_process, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                       max_model_len=512, max_num_batched_tokens=64, max_num_seqs=32, enable_prefix_caching=True,
                       additional_config={"h2o": ENGINE_H2O}, kv_transfer_config=_kv_transfer())


def _config(case: str) -> dict:
    from h2o_vllm.config import H2OConfig
    return H2OConfig.from_dict(ENGINE_H2O).with_overrides(CASES[case]).to_dict()


def _xargs(case: str) -> dict:
    return extra_args(CASES[case]) if CASES[case] else {}


@pytest.fixture(scope="module")
def producer(tiny_llama_dir):
    with _engine(tiny_llama_dir, in_process=False) as llm:
        yield llm


def _produce(producer, requests) -> dict:
    """Each request prefilled as vLLM's proxy sends it (``max_tokens`` 1, ``do_remote_decode``):
    {request: its ``kv_transfer_params``}."""
    from vllm import SamplingParams
    params = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                             extra_args={**_xargs(case), "kv_transfer_params": dict(REMOTE_DECODE)})
              for case, _ in requests]
    outputs = producer.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in requests], params, use_tqdm=False)
    return {request: out.kv_transfer_params for request, out in zip(requests, outputs)}


@pytest.fixture(scope="module")
def produced(producer):
    return _produce(producer, REQUESTS)


@pytest.fixture(scope="module")
def consumer(tiny_llama_dir, produced):
    with _engine(tiny_llama_dir, in_process=True) as llm:
        yield llm


def _drive(llm, prompts, params, **kwargs):
    """``drive_checked``, and no fetch left behind."""
    outputs, seen = drive_checked(llm, prompts, params, ENGINE_H2O, BLOCK, **kwargs)
    transfer = scheduler_of(llm).connector.transfer
    assert not transfer.fetching and not transfer.named, "the consumer holds fetches of finished requests"
    return outputs, seen


def _decode(consumer, requests, params_of, **kwargs):
    """The decoder's requests as vLLM's proxy sends them: the original prompt, the producer's params."""
    params = [greedy(MAX_TOKENS, extra_args={**_xargs(case), "kv_transfer_params": params_of[(case, i)]})
              for case, i in requests]
    return _drive(consumer, [PROMPTS[i] for _, i in requests], params, **kwargs)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return {(case, i): out for case in CASES
            for i, out in enumerate(oracle(model, _config(case), BLOCK).generate(PROMPTS, MAX_TOKENS))}


@pytest.fixture(scope="module")
def consumed(consumer, produced):
    transfer = scheduler_of(consumer).connector.transfer
    before = transfer.num_loaded
    outputs, seen = _decode(consumer, REQUESTS, produced)
    seen["loaded"] = transfer.num_loaded - before
    return {request: outputs[str(n)] for n, request in enumerate(REQUESTS)}, seen


@pytest.mark.parametrize("case", CASES)
def test_nixl_pair_equals_the_dense_oracle(consumed, expected, case):
    outputs, _ = consumed
    for i, length in enumerate(PROMPT_LENGTHS):
        assert outputs[(case, i)] == expected[(case, i)], f"{case}, prompt of {length} tokens"


def test_every_decoder_request_read_and_loaded_the_producers_state(consumed, produced):
    """None computed its prompt here; the 300-token ones held cdiv(budget + interval, block)
    blocks at most (stock vLLM: 19)."""
    _, seen = consumed
    assert seen["loaded"] == len(REQUESTS)
    assert max(seen["evicted"]) > 0
    from h2o_vllm.config import H2OConfig
    for n, (case, i) in enumerate(REQUESTS):
        if PROMPT_LENGTHS[i] == 300 and case in ("engine", "tokens-8+8-interval1"):
            budget = H2OConfig.from_dict(_config(case)).budget(300, BLOCK)
            assert max(seen["held"][str(n)]) <= math.ceil((budget.tokens + budget.interval) / BLOCK)


def test_bytes_read_follow_the_budget(produced, tiny_llama_dir):
    """What crosses is K, V and scores of the kept positions between two 32-byte seals: for
    the 300-token prompts under a 16-token budget, under 0.1x vLLM's KV of the prompt."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    heads, head_size = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * heads * (2 * head_size + 1) * 4
    for (case, i), params in produced.items():
        assert params["h2o_nixl"]["nbytes"] == 64 + params["h2o_kv_tokens"] * per_position, (case, i)
        if PROMPT_LENGTHS[i] == 300 and case in ("engine", "tokens-8+8-interval1"):
            stock = config.num_hidden_layers * 300 * heads * 2 * head_size * 4
            assert params["h2o_nixl"]["nbytes"] < 0.1 * stock


def test_the_producers_space_comes_back_once_read(producer, produced, consumed, consumer, expected):
    """A second round of the same requests fits the producer's staging only if the first
    round's space was given back when the decoder read it; it decodes exactly again."""
    round_bytes = sum(p["h2o_nixl"]["nbytes"] for p in produced.values())
    assert 2 * round_bytes > STAGING_MIB * 2**20, "the test needs rounds that cannot both fit"
    again = _produce(producer, REQUESTS)
    assert all("h2o_nixl" in p for p in again.values()), "the first round's space was not given back"
    outputs, _ = _decode(consumer, REQUESTS, again)
    for n, request in enumerate(REQUESTS):
        assert outputs[str(n)] == expected[request], request


def test_bytes_that_are_not_the_state_named_or_a_producer_gone_recompute_exactly(consumed, consumer, produced,
                                                                                expected):
    """A ticket that does not match what the bytes were sealed with (the producer's space given
    back and written again), and a producer NIXL cannot reach: each request computes
    its prompt here, exactly, and says why."""
    transfer = scheduler_of(consumer).connector.transfer
    before = (transfer.num_loaded, transfer.num_recomputed)
    requests = [("engine", 3), ("tokens-8+8-interval1", 4)]
    params = {r: {**produced[r], "h2o_nixl": dict(produced[r]["h2o_nixl"])} for r in requests}
    params[requests[0]]["h2o_nixl"]["ticket"] += 1000
    gone = base64.b64encode(b"an agent that is no more").decode()
    params[requests[1]]["h2o_nixl"]["peers"] = [["h2o-gone", gone, 4096]]
    outputs, _ = _decode(consumer, requests, params)
    for n, request in enumerate(requests):
        assert outputs[str(n)] == expected[request], request
    assert (transfer.num_loaded, transfer.num_recomputed) == (before[0], before[1] + 2)


def test_a_request_aborted_while_its_state_is_read_leaves_nothing(consumed, consumer, produced):
    """Aborted at its first step (its read just ordered): no fetch kept, the pool drained
    (``_drive``); the request beside it completes."""
    requests = [("engine", 4), ("ratio-0.1+0.1-block", 4)]
    outputs, _ = _decode(consumer, requests, produced, abort_after=(1, ["0"]))
    assert "0" not in outputs and len(outputs["1"]) == MAX_TOKENS
    assert not scheduler_of(consumer).connector.transfer.fetching
