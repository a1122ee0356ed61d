"""Engine-tier helpers (imported by the engine tests): real vLLM engines on the CPU, started once per module."""
import contextlib
import gc
import os
import random

import pytest

# Any plugin name but ours: the spawned engine core and workers then run stock vLLM.
from h2o_vllm.tools.soak import STOCK_PLUGINS


@contextlib.contextmanager
def vllm_engine(model_dir, *, plugins: bool = True, in_process: bool = False,
                env: dict[str, str] | None = None, **llm_kwargs):
    """A ``vllm.LLM`` on the CPU in fp32; ``in_process`` keeps the scheduler inspectable
    (``scheduler_of``); ``plugins=False`` runs stock vLLM in its spawned processes; ``env`` is
    set while the engine starts (its spawned processes keep it)."""
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    assert plugins or not in_process, "stock vLLM must run in fresh processes"
    # Load ours into this process now: plugins load once per process, and a stock engine
    # created first would otherwise load them under its VLLM_PLUGINS, without h2o.
    load_general_plugins()
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
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


def run_steps(llm, prompts, params, on_step=None, abort_after=None) -> dict[str, list[int]]:
    """Drive an engine step by step; ``params`` is one SamplingParams or one per prompt;
    ``on_step()`` runs after every step; returns {request_id: output token ids}."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           params[i] if isinstance(params, list) else params)
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if on_step is not None:
            on_step()
        if abort_after is not None and step == abort_after[0]:
            engine.abort_request(abort_after[1])
    return outputs


def model_runner_of(llm):
    """The model runner of an in-process engine's (only) worker."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def check_block_lists(llm, engine_h2o: dict, block_size: int) -> list[int]:
    """After a step: every running request holds cdiv(live KV length, block) blocks in the
    scheduler, the same list as the worker's request state and block-table row. Returns the
    tokens each running request has evicted so far (a check that saw no eviction proves
    nothing). No explicit remove_skipped_blocks: the update_from_output hook has already
    freed the tail blocks this step's compaction emptied."""
    from vllm.utils.math_utils import cdiv

    from h2o_vllm.config import H2OConfig
    from h2o_vllm.policy import kv_len_after
    scheduler, runner = scheduler_of(llm), model_runner_of(llm)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    evicted = []
    for request in scheduler.running:
        rid = request.request_id
        config = H2OConfig.from_dict(engine_h2o).with_overrides(
            {k[4:]: v for k, v in (request.sampling_params.extra_args or {}).items()})
        budget = config.budget(request.num_prompt_tokens, block_size)
        kv_len = kv_len_after(request.num_computed_tokens, request.num_prompt_tokens, budget)
        held = [b.block_id for b in manager.req_to_blocks[rid]]
        assert len(held) == cdiv(kv_len, block_size)
        assert held == runner.requests[rid].block_ids[0]
        row = runner.input_batch.req_id_to_index[rid]
        assert runner.input_batch.block_table[0].num_blocks_per_row[row] == len(held)
        evicted.append(request.num_computed_tokens - kv_len)
    return evicted
