"""Engine-tier helpers (imported by the engine tests): real vLLM engines on the CPU, started once per module."""
import contextlib
import gc
import os
import random

import pytest

# Any plugin name but ours: the spawned engine core and workers then run stock vLLM.
STOCK_PLUGINS = "lora_filesystem_resolver"


@contextlib.contextmanager
def vllm_engine(model_dir, *, plugins: bool = True, in_process: bool = False, **llm_kwargs):
    """A ``vllm.LLM`` on the CPU in fp32; ``in_process`` keeps the scheduler inspectable
    (``scheduler_of``); ``plugins=False`` runs stock vLLM in its spawned processes."""
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    assert plugins or not in_process, "stock vLLM must run in fresh processes"
    # Load ours into this process now: plugins load once per process, and a stock engine
    # created first would otherwise load them under its VLLM_PLUGINS, without h2o.
    load_general_plugins()
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if not plugins:
        env["VLLM_PLUGINS"] = STOCK_PLUGINS
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kwargs = dict(dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    kwargs.update(llm_kwargs)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        llm = LLM(str(model_dir), **kwargs)
    try:
        yield llm
    finally:
        # pytest still holds fixture values at teardown: shut the engine down explicitly.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def scheduler_of(llm):
    """The engine-core scheduler of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def random_prompts(lengths, seed: int = 0, vocab: tuple[int, int] = (5, 500)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int, **kwargs):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate_ids(llm, prompts, params) -> list[list[int]]:
    """Token ids per prompt; ``params`` is one SamplingParams or one per prompt."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
