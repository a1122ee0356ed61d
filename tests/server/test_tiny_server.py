"""A real `h2o-vllm serve` of the tiny Llama with H2O on: answers equal offline `LLM.generate`,
per-request budgets act as requested, /metrics counts exactly what the engine evicted, bad
per-request values get a 400 and the server keeps serving."""
import openai
import pytest
from harness import TINY_CHAT_TEMPLATE, Offline, Server, expected_counts, wait_for

from h2o_vllm.config import H2OConfig
from h2o_vllm.policy import kv_len_after

BLOCK_SIZE = 16
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 4}
FLAGS = ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8",
         "--h2o-interval", "4", "--block-size", str(BLOCK_SIZE)]
MAX_TOKENS = 40
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch and the "
    "sun sets slowly behind the hills of the quiet valley where nothing ever seems to happen",
    "Free software is a matter of liberty, not price; to understand the concept you should think "
    "of free as in free speech, not as in free beer, and of the freedom to run, copy and study",
]
#: Per-request budgets (vllm_xargs); None: the engine's budget from the flags.
XARGS = [None,
         {"h2o_heavy_tokens": 4, "h2o_recent_tokens": 4, "h2o_interval": 1},
         {"h2o_heavy_ratio": 0.05, "h2o_recent_ratio": 0.05}]
CASES = [(prompt, xargs) for prompt in PROMPTS for xargs in XARGS]
CHAT = [{"role": "user", "content": PROMPTS[0]}]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    server = Server(tiny_llama_dir, [*FLAGS, "--chat-template", TINY_CHAT_TEMPLATE])
    offline = Offline({
        "model": str(tiny_llama_dir),
        "llm": {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "seed": 0,
                "block_size": BLOCK_SIZE, "additional_config": {"h2o": ENGINE_H2O}},
        "completions": [{"prompt": p, "max_tokens": MAX_TOKENS, "extra_args": x} for p, x in CASES],
        "chats": [{"messages": CHAT, "max_tokens": MAX_TOKENS, "extra_args": XARGS[1]}],
        "chat_template": TINY_CHAT_TEMPLATE,
    })
    try:
        server.wait_ready()
        yield server, offline.result()
    finally:
        server.stop()


def _complete(server, prompt, xargs, **kwargs):
    extra_body = {"ignore_eos": True, "return_token_ids": True}
    if xargs:
        extra_body["vllm_xargs"] = xargs
    return server.client().completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0.0, extra_body=extra_body, **kwargs)


@pytest.fixture(scope="module")
def server(served):
    server, _ = served
    server.model = server.client().models.list().data[0].id
    return server


def test_completions_match_offline_generate(server, served):
    _, offline = served
    answers = [_complete(server, prompt, xargs).choices[0].token_ids for prompt, xargs in CASES]
    assert answers == offline["completions"]
    # The budgets are not vacuous: smaller budgets change the greedy answer.
    assert len({tuple(a) for a in answers[:3]}) > 1


def test_chat_completion_matches_offline_chat(server, served):
    _, offline = served
    response = server.client().chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "vllm_xargs": XARGS[1]})
    assert response.choices[0].token_ids == offline["chats"][0]


def test_streaming_completion_matches_non_streaming(server):
    whole = _complete(server, PROMPTS[1], XARGS[2]).choices[0].text
    stream = _complete(server, PROMPTS[1], XARGS[2], stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole


@pytest.mark.parametrize("xargs", XARGS, ids=["engine-budget", "tokens-4+4-interval1", "ratio-0.05+0.05"])
def test_request_budget_sets_evicted_counts_and_metrics(server, xargs):
    config = H2OConfig.from_dict(ENGINE_H2O).with_overrides(
        {k.removeprefix("h2o_"): v for k, v in (xargs or {}).items()})
    before = server.settled_metrics()
    usage = _complete(server, PROMPTS[0], xargs).usage
    expected = expected_counts(usage.prompt_tokens, usage.completion_tokens, config, BLOCK_SIZE)
    assert expected["evicted_tokens"] > 0 and expected["freed_blocks"] > 0

    def delta():
        now = server.metrics()
        got = {name: now[f"{name}_total"] - before[f"{name}_total"] for name in expected}
        return (got, now) if got == expected and now["live_kv_tokens"] == 0 else None
    result = wait_for(delta)
    now = server.metrics()
    assert result is not None, (expected, now, before)
    # The live KV length the request ended with is its budget, as the policy says.
    processed = usage.prompt_tokens + usage.completion_tokens - 1
    budget = config.budget(usage.prompt_tokens, BLOCK_SIZE)
    assert processed - expected["evicted_tokens"] == kv_len_after(processed, usage.prompt_tokens, budget)
    mass = now["attention_mass_total"] - before["attention_mass_total"]
    dropped = now["evicted_attention_mass_total"] - before["evicted_attention_mass_total"]
    assert 0 < dropped < mass
    assert 0 < now["evicted_attention_share"] < 1


@pytest.mark.parametrize("xargs, match", [
    ({"h2o_heavy_ratio": 1.5}, "h2o_heavy_ratio"),
    ({"h2o_interval": 0}, "h2o_interval"),
    ({"h2o_recent_tokens": 8, "h2o_recent_ratio": 0.1}, "recent"),
    ({"h2o_heavy_tokns": 32}, "unknown H2O key h2o_heavy_tokns"),  # a typo is not dropped
])
def test_bad_request_budget_is_400_and_server_keeps_serving(server, xargs, match):
    with pytest.raises(openai.BadRequestError, match=match):
        _complete(server, PROMPTS[0], xargs)
    assert _complete(server, PROMPTS[0], None).choices[0].finish_reason == "length"


def _create(server, endpoint: str, xargs: dict, stream: bool):
    client, extra_body = server.client(), {"vllm_xargs": xargs}
    if endpoint == "completions":
        return client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=8,
                                         stream=stream, extra_body=extra_body)
    if endpoint == "chat":
        return client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8,
                                              stream=stream, extra_body=extra_body)
    return client.responses.create(model=server.model, input=PROMPTS[0], max_output_tokens=8,
                                   stream=stream, extra_body=extra_body)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_bad_budget_is_the_same_400_streaming_or_not(server, endpoint):
    """The openai client raises BadRequestError from create() itself: the status of the response,
    not an error event inside an HTTP 200 stream."""
    bodies = {}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            _create(server, endpoint, {"h2o_heavy_ratio": 1.5}, stream)
        assert error.value.status_code == 400
        bodies[stream] = error.value.body
    assert bodies[True] == bodies[False], bodies
    message = bodies[True]["message"] if "message" in bodies[True] else bodies[True]["error"]["message"]
    assert "h2o_heavy_ratio" in message and "must be in [0, 1], got 1.5" in message, message
    # Read to the end and closed: an open stream keeps a request running and its connection
    # open, and the server's graceful shutdown then waits on it past the harness's 30 s.
    with _complete(server, PROMPTS[0], None, stream=True) as stream:
        assert [chunk.choices[0].text for chunk in stream if chunk.choices]


def test_periodic_stats_log_has_h2o_summary(server):
    """vLLM logs its stats every VLLM_LOG_STATS_INTERVAL (10 s); the H2O line follows."""
    assert wait_for(lambda: "H2O: evicted" in server.tail(10**7), timeout_s=25), server.tail()
