"""Odd requests on one H2O engine (tiny Llama, block 32, in process): parallel sampling,
1-token prompts, prompts far past the budget, prompts at block boundaries, ``max_tokens=1``,
empty stop lists, stop / max_tokens hit right at a compaction step, prompt logprobs.
Greedy outputs are compared with the dense oracle wherever exactness applies.
"""
import pytest
import torch

from budgets import extra_args, oracle
from engines import greedy, random_prompts, scheduler_of, vllm_engine
from h2o_vllm.config import H2OConfig
from h2o_vllm.policy import kv_len_after

BLOCK = 32
ENGINE_H2O = {"heavy_ratio": 0.1, "recent_ratio": 0.1}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with vllm_engine(tiny_llama_dir, in_process=True, block_size=BLOCK,
                     additional_config={"h2o": ENGINE_H2O}) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _oracle(hf_model, prompts, max_tokens, budget=None):
    return oracle(hf_model, budget or ENGINE_H2O, BLOCK).generate(prompts, max_tokens)


def _free(llm) -> int:
    return scheduler_of(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_odd_prompt_lengths_and_max_tokens_1_match_the_oracle(llm, hf_model):
    """1 token, exactly 1 and 2 blocks, either side of a block, far past the budget."""
    free = _free(llm)
    lengths = [1, 31, 32, 33, 64, 65, 700]
    prompts = random_prompts(lengths, seed=11)
    for max_tokens in (1, 40):
        got = [list(o.outputs[0].token_ids) for o in _generate(llm, prompts, greedy(max_tokens))]
        assert got == _oracle(hf_model, prompts, max_tokens), f"max_tokens={max_tokens}"
    assert _free(llm) == free


def test_prompt_far_longer_than_the_budget_matches_the_oracle(llm, hf_model):
    """A 4+4-token budget on prompts 60-100x longer: compacted at the prompt's end."""
    budget = {"heavy_tokens": 4, "recent_tokens": 4, "interval": 1}
    prompts = random_prompts([500, 800], seed=12)
    got = [list(o.outputs[0].token_ids)
           for o in _generate(llm, prompts, greedy(30, extra_args=extra_args(budget)))]
    assert got == _oracle(hf_model, prompts, 30, budget)


def test_parallel_sampling_greedy_gives_n_identical_oracle_samples(llm, hf_model):
    """vLLM refuses n > 1 at temperature 0; top_k=1 is greedy by another name."""
    from vllm import SamplingParams
    prompts = random_prompts([5, 90], seed=13)
    outputs = _generate(llm, prompts, SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=30,
                                                     ignore_eos=True))
    expected = _oracle(hf_model, prompts, 30)
    for output, want in zip(outputs, expected):
        assert len(output.outputs) == 3
        assert all(list(sample.token_ids) == want for sample in output.outputs)


def test_parallel_sampling_with_seed_completes_and_repeats(llm):
    from vllm import SamplingParams
    free = _free(llm)
    prompts = random_prompts([3, 70, 200], seed=14)
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=7, max_tokens=50, ignore_eos=True)
    first = _generate(llm, prompts, params)
    again = _generate(llm, prompts, params)
    for out in first:
        assert sorted(s.index for s in out.outputs) == [0, 1, 2, 3]
        assert all(len(s.token_ids) == 50 and s.finish_reason == "length" for s in out.outputs)
        assert len({tuple(s.token_ids) for s in out.outputs}) > 1, "temperature 1 gave 4 equal samples"
    assert [[s.token_ids for s in o.outputs] for o in first] == [[s.token_ids for s in o.outputs] for o in again]
    assert _free(llm) == free


def test_empty_stop_lists_change_nothing(llm):
    prompts = random_prompts([10, 50], seed=15)
    plain = [o.outputs[0].token_ids for o in _generate(llm, prompts, greedy(25))]
    empty = [o.outputs[0].token_ids for o in _generate(llm, prompts, greedy(25, stop=[], stop_token_ids=[]))]
    assert plain == empty and all(len(o) == 25 for o in plain)


# --------------------------------------------------------------------------- finishing at a compaction

PROMPT_LEN = 40
STOP_BUDGET = {"heavy_tokens": 8, "recent_tokens": 8}        # interval: one block (32)
# First compaction once 8 + 8 + 32 = 48 tokens are in the cache: the decode step that writes
# generated token 8 (the prompt's 40 + tokens 1..8) and samples token 9.
FINISH_AT = 9


def _step_until_finished(llm, request_id, prompt, params):
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0]


def _finishing_step_compacts():
    budget = H2OConfig.from_dict(STOP_BUDGET).budget(PROMPT_LEN, BLOCK)
    processed = PROMPT_LEN + FINISH_AT - 1
    assert kv_len_after(processed - 1, PROMPT_LEN, budget) == processed - 1
    assert kv_len_after(processed, PROMPT_LEN, budget) < processed


@pytest.mark.parametrize("how", ["max_tokens", "stop_token_ids", "stop"])
def test_finishing_at_a_compaction_step_returns_blocks_at_once(llm, how):
    _finishing_step_compacts()
    [prompt] = random_prompts([PROMPT_LEN], seed=16)
    xargs = extra_args(STOP_BUDGET)
    free = _free(llm)
    full = _step_until_finished(llm, f"full-{how}", prompt, greedy(20, extra_args=xargs))
    assert _free(llm) == free
    tokens = list(full.token_ids)
    if how == "max_tokens":
        params = greedy(FINISH_AT, extra_args=xargs)
    elif how == "stop_token_ids":
        assert tokens[FINISH_AT - 1] not in tokens[:FINISH_AT - 1], "pick another prompt seed"
        params = greedy(20, extra_args=xargs, stop_token_ids=[tokens[FINISH_AT - 1]])
    else:
        tokenizer = llm.get_tokenizer()
        before, upto = tokenizer.decode(tokens[:FINISH_AT - 1]), tokenizer.decode(tokens[:FINISH_AT])
        assert upto.startswith(before)
        stop = next(upto[-n:] for n in range(1, len(upto) + 1) if upto[-n:] not in before)
        params = greedy(20, extra_args=xargs, stop=[stop])
    out = _step_until_finished(llm, f"stopped-{how}", prompt, params)
    assert list(out.token_ids) == tokens[:FINISH_AT]
    assert out.finish_reason == ("length" if how == "max_tokens" else "stop")
    assert _free(llm) == free, "blocks of a request finished at a compaction step were not returned"
    assert not scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers[0].num_evicted


# --------------------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_are_supported_and_exact(llm, hf_model):
    """Supported: no token is evicted before the prompt is done, so prompt logprobs are the
    dense model's, whatever the budget; the continuation still follows the oracle."""
    budget = {"heavy_tokens": 4, "recent_tokens": 4, "interval": 1}
    prompts = random_prompts([1, 33, 150], seed=17)
    outputs = _generate(llm, prompts, greedy(20, prompt_logprobs=1, logprobs=1,
                                             extra_args=extra_args(budget)))
    assert [list(o.outputs[0].token_ids) for o in outputs] == _oracle(hf_model, prompts, 20, budget)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        got = torch.tensor([output.prompt_logprobs[i][token].logprob for i, token in enumerate(prompt) if i])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert len(output.outputs[0].logprobs) == 20
