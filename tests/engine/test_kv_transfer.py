"""KV transfer with H2O (docs/kv-transfer.md): a producer engine prefills and compacts each
prompt and saves what it kept; a consumer engine, given the prompt plus the producer's first
token, loads that state and decodes. The pair equals the dense oracle token for token.

Two in-process engines (CPU path) on vLLM's ``ExampleConnector`` settings, one after the other
over one storage folder: the budget matrix as per-request overrides (``prefill_chunk`` among
them), prompts shorter and much longer than the budget, block lists checked against the
worker's after every step on both sides, the pools drained. Then the faults, on the same
consumer: state files missing or cut short (the request computes its prompt itself, exact),
a local prefix-cache hit first (the same), an abort, preemptions.
"""
import json
import math
from pathlib import Path

import pytest
import torch

from budgets import BUDGETS, MODES, extra_args, oracle
from engines import drive_checked, greedy, random_prompts, scheduler_of, stock_admission, vllm_engine

BLOCK = 16
MAX_TOKENS = 10
NUM_BLOCKS = 64
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8}
CASES = {
    "engine": {},
    "tokens-8+8-interval1": BUDGETS["tokens-8+8-interval1"],
    "ratio-0.1+0.1-block": BUDGETS["ratio-0.1+0.1-block"],
    "all-modes-tokens-6+6-interval1": MODES["all-modes-tokens-6+6-interval1"],
    "pool-5-window-8-tokens-8+8-interval1": MODES["pool-5-window-8-tokens-8+8-interval1"],
    "chunk-24-tokens-8+8-interval1": {**BUDGETS["tokens-8+8-interval1"], "prefill_chunk": 24},
    # The key scorers: the producer's compactions score from its live keys (and its prompt's
    # last queries), the consumer's from the loaded keys (and its own decode queries).
    "keydiff-pool-5-sinks-2-tokens-8+8-interval1": MODES["keydiff-pool-5-sinks-2-tokens-8+8-interval1"],
    "expected-pool-5-sinks-2-tokens-8+8-interval1": MODES["expected-pool-5-sinks-2-tokens-8+8-interval1"],
}
# Shorter than the budget, about it, past it (39 and 40: a ratio budget differs), far past it.
PROMPT_LENGTHS = (3, 17, 39, 40, 100, 300)
PROMPTS = random_prompts(PROMPT_LENGTHS, seed=7)
REQUESTS = [(case, i) for case in CASES for i in range(len(PROMPTS))]


def kv_transfer(role: str, store: Path) -> dict:
    """vLLM's own ExampleConnector settings: H2O runs its connector in its place."""
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


def _params(case: str, max_tokens: int):
    budget = CASES[case]
    return greedy(max_tokens, extra_args=extra_args(budget) if budget else None)


def _config(case: str) -> dict:
    """What a request of ``case`` runs with: the engine's config with its overrides."""
    from h2o_vllm.config import H2OConfig
    return H2OConfig.from_dict(ENGINE_H2O).with_overrides(CASES[case]).to_dict()


def _budget(case: str, prompt_len: int):
    from h2o_vllm.config import H2OConfig
    return H2OConfig.from_dict(_config(case)).budget(prompt_len, BLOCK)


def _key(case: str, prompt) -> str:
    from h2o_vllm.kv_transfer.store import state_key
    return state_key(prompt, _budget(case, len(prompt)), BLOCK)


def _engine(model_dir, role: str, store: Path):
    return vllm_engine(model_dir, in_process=True, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=512,
                       max_num_batched_tokens=64, max_num_seqs=16, enable_prefix_caching=True,
                       additional_config={"h2o": ENGINE_H2O}, kv_transfer_config=kv_transfer(role, store))


def _drive(llm, prompts, params, **kwargs):
    return drive_checked(llm, prompts, params, ENGINE_H2O, BLOCK, **kwargs)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(hf_model):
    """The oracle's MAX_TOKENS tokens for each (case, prompt) of REQUESTS."""
    return {(case, i): out for case in CASES
            for i, out in enumerate(oracle(hf_model, _config(case), BLOCK)
                                    .generate(PROMPTS, MAX_TOKENS))}


#: A producer request aborted in the middle of its prompt (its own prompt: its own key).
ABORTED_PROMPT = random_prompts((300,), seed=8)[0]


@pytest.fixture(scope="module")
def produced(tiny_llama_dir, store):
    """The producer: every request of REQUESTS prefilled (one token each, as vLLM's P/D
    examples run it), 64 tokens a step, so a 300-token prompt takes five steps."""
    with _engine(tiny_llama_dir, "kv_producer", store) as llm:
        # The aborted request first: the first step schedules 64 of its 300 tokens.
        prompts = [ABORTED_PROMPT] + [PROMPTS[i] for _, i in REQUESTS]
        params = [_params("engine", 1)] + [_params(case, 1) for case, _ in REQUESTS]
        outputs, seen = _drive(llm, prompts, params, abort_after=(1, ["0"]))
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    # vLLM keeps the worker's connector in a process global until the worker shuts down; the
    # consumer (and later engines in this process) must get their own.
    assert not has_kv_transfer_group()
    assert "0" not in outputs
    return {request: outputs[str(n + 1)] for n, request in enumerate(REQUESTS)}, seen


@pytest.fixture(scope="module")
def consumer(tiny_llama_dir, store, produced):
    with _engine(tiny_llama_dir, "kv_consumer", store) as llm:
        yield llm


@pytest.fixture(scope="module")
def consumed(consumer, produced):
    """Every request continued on the consumer: prompt + the producer's first token."""
    firsts, _ = produced
    prompts = [PROMPTS[i] + firsts[(case, i)] for case, i in REQUESTS]
    transfer = scheduler_of(consumer).connector.transfer
    loaded_before = transfer.num_loaded
    outputs, seen = _drive(consumer, prompts, [_params(case, MAX_TOKENS - 1) for case, _ in REQUESTS])
    seen["loaded"] = transfer.num_loaded - loaded_before
    return {request: firsts[request] + outputs[str(n)] for n, request in enumerate(REQUESTS)}, seen


def test_the_producer_evicted_and_committed_each_prompt_once_whole(produced, store):
    _, seen = produced
    assert max(seen["evicted"]) > 0
    for case, i in REQUESTS:
        meta = json.loads((store / _key(case, PROMPTS[i]) / "meta.json").read_text())
        from h2o_vllm.policy import kv_len_after
        budget = _budget(case, len(PROMPTS[i]))
        assert meta["kv_len"] == kv_len_after(len(PROMPTS[i]), len(PROMPTS[i]), budget)
    # Aborted mid-prompt: it had no first token, so nothing of it was committed.
    assert not (store / _key("engine", ABORTED_PROMPT) / "meta.json").exists()


@pytest.mark.parametrize("case", CASES)
def test_producer_then_consumer_equals_the_dense_oracle(consumed, expected, case):
    outputs, _ = consumed
    for i, length in enumerate(PROMPT_LENGTHS):
        assert outputs[(case, i)] == expected[(case, i)], f"{case}, prompt of {length} tokens"


def test_every_consumer_request_loaded_and_held_kv_space_only(consumed):
    """Each continuation loaded the producer's state (none recomputed its prompt), and held
    the blocks of its live KV positions, not its prompt's: the 300-token prompts' requests
    held at most cdiv(budget + interval, block) = 2 blocks (stock vLLM: 19)."""
    _, seen = consumed
    assert seen["loaded"] == len(REQUESTS)
    assert max(seen["evicted"]) > 0
    longest = len(PROMPT_LENGTHS) - 1
    for n, (case, i) in enumerate(REQUESTS):
        if i == longest and case in ("engine", "tokens-8+8-interval1"):
            budget = _budget(case, PROMPT_LENGTHS[i])
            assert max(seen["held"][str(n)]) <= math.ceil((budget.tokens + budget.interval) / BLOCK)


def test_stored_bytes_follow_the_budget(produced, store, tiny_llama_dir):
    """Each state holds K, V and scores of the live positions of each layer and KV head, and
    nothing else: for the 300-token prompts under an 16-token budget, under 0.1x what
    vLLM's ExampleConnector stores for the prompt (its K/V, every block-aligned position)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    heads, head_size = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * heads * (2 * head_size + 1) * 4  # fp32 K, V, score
    for case, i in REQUESTS:
        folder = store / _key(case, PROMPTS[i])
        kv_len = json.loads((folder / "meta.json").read_text())["kv_len"]
        data = sum(t.numel() * t.element_size() for t in load_file(folder / "rank0.safetensors").values())
        assert data == kv_len * per_position, (case, i)
        if PROMPT_LENGTHS[i] == 300 and case in ("engine", "tokens-8+8-interval1"):
            stock = config.num_hidden_layers * ((300 - 2) // BLOCK * BLOCK) * heads * 2 * head_size * 4
            total = sum(p.stat().st_size for p in folder.iterdir())
            assert total < 0.1 * stock, (total, stock)


def _damage(store: Path, key: str, how: str) -> None:
    path = store / key / "rank0.safetensors"
    if how == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def test_missing_or_truncated_state_recomputes_exactly_then_hits_the_prefix_cache(
        consumer, consumed, produced, store, expected):
    """A state whose file is gone or cut short is never loaded: the request computes its
    prompt itself, with the producer's prompt length, and gets the same tokens. A second
    request for the same prompt then hits the consumer's own prefix cache (and so does not
    load either): the same tokens again."""
    firsts, _ = produced
    damaged = [("tokens-8+8-interval1", 4, "missing"), ("all-modes-tokens-6+6-interval1", 5, "truncated")]
    for case, i, how in damaged:
        _damage(store, _key(case, PROMPTS[i]), how)
    transfer = scheduler_of(consumer).connector.transfer
    before = (transfer.num_loaded, transfer.num_recomputed)
    prompts = [PROMPTS[i] + firsts[(case, i)] for case, i, _ in damaged]
    params = [_params(case, MAX_TOKENS - 1) for case, _, _ in damaged]
    for attempt in range(2):
        cached = {}
        outputs, _ = _drive(consumer, prompts, params, cached=cached)
        for n, (case, i, _) in enumerate(damaged):
            assert firsts[(case, i)] + outputs[str(n)] == expected[(case, i)], (attempt, case, i)
        if attempt == 1:
            assert all(cached[str(n)] >= BLOCK for n in range(len(damaged))), cached
    assert transfer.num_loaded == before[0]
    assert transfer.num_recomputed == before[1] + len(damaged)


def test_a_consumer_request_aborted_after_its_load_leaves_nothing(consumer, consumed, produced):
    firsts, _ = produced
    case, i = "engine", len(PROMPTS) - 1
    prompts = [PROMPTS[i] + firsts[(case, i)]] * 2
    outputs, _ = _drive(consumer, prompts, [_params(case, 50)] * 2, abort_after=(2, ["0"]))
    assert "0" not in outputs and len(outputs["1"]) == 50


def test_preempted_consumer_requests_recompute_and_drain(consumer, consumed, produced, monkeypatch):
    """Admission headroom off, sixteen loaded copies of a 300-token prompt under a 20% budget
    (60 tokens, up to 5 blocks each) with long outputs overrun the 64-block pool: vLLM
    preempts, the preempted ones compute their prompts themselves (H2O's recompute rule),
    every request completes and the pool drains."""
    from h2o_vllm.scheduler import scheduling
    from h2o_vllm.vllm_shims.introspect import count_preemptions
    monkeypatch.setattr(scheduling, "admission_watermark", stock_admission)
    firsts, _ = produced
    case, i = "ratio-0.1+0.1-block", len(PROMPTS) - 1
    scheduler = scheduler_of(consumer)
    transfer = scheduler.connector.transfer
    before = transfer.num_loaded
    preemptions = count_preemptions(scheduler)
    prompts = [PROMPTS[i] + firsts[(case, i)]] * 16
    outputs, _ = _drive(consumer, prompts, [_params(case, 100)] * 16)
    assert len(outputs) == 16 and all(len(out) == 100 for out in outputs.values())
    assert preemptions() > 0, "nothing was preempted"
    # Each loads at most once: a preempted one recomputes, and a request admitted after that
    # may find the prompt in the consumer's own prefix cache (then it loads nothing).
    assert 0 < transfer.num_loaded - before <= 16


def test_a_consumer_request_asking_for_prompt_logprobs_computes_its_prompt_exactly(consumer, consumed,
                                                                                   produced, expected):
    """vLLM reads no cached token for a request with prompt logprobs (it drops a connector's
    match): such a continuation computes its prompt, H2O's prompt length still the producer's."""
    firsts, _ = produced
    case, i = "tokens-8+8-interval1", 3
    transfer = scheduler_of(consumer).connector.transfer
    loaded = transfer.num_loaded
    params = greedy(MAX_TOKENS - 1, extra_args=extra_args(CASES[case]), prompt_logprobs=1)
    outputs, _ = _drive(consumer, [PROMPTS[i] + firsts[(case, i)]], [params])
    assert firsts[(case, i)] + outputs["0"] == expected[(case, i)]
    assert transfer.num_loaded == loaded


def test_vllms_pd_protocol_the_original_prompt_with_the_producers_params(consumer, consumed, produced,
                                                                        expected, store, hf_model):
    """vLLM's disaggregation proxy sends the decoder the original prompt with the
    producer's ``kv_transfer_params``: the state loads, the producer's first token is emitted
    first, ``max_tokens`` counts it, and the answer equals the oracle's. Params naming another
    budget's state are ignored: the prompt is computed here, exactly."""
    firsts, _ = produced
    transfer = scheduler_of(consumer).connector.transfer
    loaded = transfer.num_loaded
    # Prompts the consumer never computed itself (a prompt in its own prefix cache is a local
    # hit, taken before any load: the fault tests above compute prompts 3-5).
    cases = [("engine", 2), ("all-modes-tokens-6+6-interval1", 1), ("chunk-24-tokens-8+8-interval1", 2)]
    params = []
    for case, i in cases:
        key = _key(case, PROMPTS[i])
        meta = json.loads((store / key / "meta.json").read_text())
        kv = {"h2o_kv_key": key, "h2o_first_token": meta["first_token"], "h2o_prompt_tokens": len(PROMPTS[i]),
              "h2o_kv_tokens": meta["kv_len"], "do_remote_prefill": False}
        params.append(greedy(MAX_TOKENS, extra_args={**extra_args(CASES[case]), "kv_transfer_params": kv}))
    other = {**params[0].extra_args, "h2o_heavy_tokens": 4}  # another budget: another key
    params.append(greedy(MAX_TOKENS, extra_args=other))
    prompts = [PROMPTS[i] for _, i in cases] + [PROMPTS[5]]
    outputs, _ = _drive(consumer, prompts, params)
    for n, (case, i) in enumerate(cases):
        assert outputs[str(n)] == expected[(case, i)], (case, i)
        assert outputs[str(n)][0] == firsts[(case, i)][0]
    assert transfer.num_loaded == loaded + len(cases)
    with_4 = oracle(hf_model, {**_config("engine"), "heavy_tokens": 4}, BLOCK).generate([PROMPTS[5]], MAX_TOKENS)
    assert outputs[str(len(cases))] == with_4[0]


def test_an_expected_attention_continuation_without_its_state_computes_the_window_exactly(
        consumer, consumed, produced, store, expected):
    """Expected Attention's compaction reads its step's last 32 queries. A continuation whose
    state is missing computes its 300-token prompt itself, in 64-token steps that stop at the
    producer's prompt length (one token short of vLLM's), the last of them holding the window
    the producer's compaction read: the oracle's tokens. The consumer's prefix cache is emptied
    first (the fault tests above computed this prompt, which would be a local hit)."""
    firsts, _ = produced
    case, i = "expected-pool-5-sinks-2-tokens-8+8-interval1", len(PROMPTS) - 1
    _damage(store, _key(case, PROMPTS[i]), "missing")
    assert consumer.reset_prefix_cache()
    transfer = scheduler_of(consumer).connector.transfer
    before = (transfer.num_loaded, transfer.num_recomputed)
    outputs, _ = _drive(consumer, [PROMPTS[i] + firsts[(case, i)]], [_params(case, MAX_TOKENS - 1)])
    assert firsts[(case, i)] + outputs["0"] == expected[(case, i)]
    assert (transfer.num_loaded, transfer.num_recomputed) == (before[0], before[1] + 1)
