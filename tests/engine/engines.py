"""Engine-tier helpers (imported by the engine tests): real vLLM engines on the CPU, started once per module."""
import contextlib
import gc
import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor

import pytest

# Any plugin name but ours: the spawned engine core and workers then run stock vLLM.
from h2o_devtools.soak import STOCK_PLUGINS

V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


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
    if in_process:
        freeze_heap()
    try:
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
    finally:
        # A clean shutdown has unfrozen the heap already; a start refused before load or a
        # shutdown that raised has not.
        gc.unfreeze()
        gc.collect()


def freeze_heap() -> None:
    """Collect, then hide every live object from later collections, as vLLM's engine core
    does once it has started (``freeze_gc_heap``), only sooner: vLLM collects the whole heap
    twice per model it loads and again when it freezes, and a test process's heap (vLLM,
    transformers, pytest, the oracle's model) makes each such pass take seconds. An in-process
    engine's shutdown unfreezes it all (``EngineCore.shutdown``): nothing stays hidden past the
    engine. (An engine core in its own process starts from a small heap: nothing to gain.)"""
    gc.collect()
    gc.freeze()


def in_fresh_process(fn, *args, env: dict[str, str] | None = None):
    """``fn(*args)`` (a module-level function) in a new Python process, started with ``env``
    added to this one's; returns its result."""
    return start_in_fresh_process(fn, *args, env=env).result()


def start_in_fresh_process(fn, *args, env: dict[str, str] | None = None):
    """``in_fresh_process`` without waiting: a future of ``fn(*args)``, so that this process
    can do other work meanwhile (the process exits once the result is read)."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with pytest.MonkeyPatch.context() as mp:  # the child process copies the environment now
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def stock_admission(managers, whole_groups, base, *args):
    """In place of ``scheduler.scheduling.admission_watermark``: vLLM's watermark alone, no room
    kept for running sequences' growth, so that a small pool preempts as stock vLLM's does."""
    return base


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


def run_steps(llm, prompts, params, on_step=None, abort_after=None,
              cached: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Drive an engine step by step; ``params`` is one SamplingParams or one per prompt;
    ``on_step()`` runs after every step; returns {request_id: output token ids}; ``cached``
    receives each finished request's prefix-cache hit tokens."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           params[i] if isinstance(params, list) else params)
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                if cached is not None:
                    cached[out.request_id] = out.num_cached_tokens or 0
        step += 1
        if on_step is not None:
            on_step()
        if abort_after is not None and step == abort_after[0]:
            engine.abort_request(abort_after[1])
    return outputs


def model_runner_of(llm):
    """The model runner of an in-process engine's (only) worker."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def worker_block_ids(runner, request_id: str, group: int = 0) -> list[int]:
    """A request's blocks in the worker (KV-cache group ``group``). V1: its request state, whose
    block-table row has as many; V2: its slot's block-table row, or the fresh blocks it
    becomes at the next step (``RunnerState.rewrites``, ``vllm_hooks.runner_v2._rewrite_row``)."""
    if hasattr(runner, "req_states"):  # Model Runner V2
        pending = runner.h2o_state.rewrites.get((request_id, group))
        if pending is not None:
            return list(pending)
        slot = runner.req_states.req_id_to_index[request_id]
        tables = runner.block_tables
        return tables.block_tables[group].gpu[slot, :int(tables.num_blocks.np[group, slot])].tolist()
    held = list(runner.requests[request_id].block_ids[group])
    # A running request the last step did not schedule (the token budget ran out) has left
    # V1's input batch; its state keeps the blocks.
    row = runner.input_batch.req_id_to_index.get(request_id)
    if row is not None:
        assert runner.input_batch.block_table[group].num_blocks_per_row[row] == len(held)
    return held


def h2o_groups(scheduler) -> list:
    """[(index, manager)] of the scheduler's H2O KV-cache groups: one for most models; a hybrid
    model gets one per sliding-window group's worth of full-attention layers (vLLM groups
    layers in equal numbers), beside vLLM's sliding-window groups."""
    from h2o_vllm.scheduler.manager import H2OManager
    return [(i, m) for i, m in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers)
            if isinstance(m, H2OManager)]


def h2o_group(scheduler):
    """(index, manager) of a model's one H2O KV-cache group."""
    (group, manager), = h2o_groups(scheduler)
    return group, manager


def check_block_lists(llm, engine_h2o: dict, block_size: int, draft_tokens: int = 0,
                      history: dict[str, list[tuple[int, int]]] | None = None) -> list[int]:
    """After a step: every running request holds cdiv(live KV length, block) blocks in the
    scheduler, the same list as the worker's (``worker_block_ids``). Returns the
    tokens each running request has evicted so far (a check that saw no eviction proves
    nothing). The schedule hook has already cut each list to what its last scheduled step's
    compaction leaves (``cut_scheduled``). Under async scheduling that step is still in flight
    for the scheduler (its tokens counted, its output not processed), but the in-process
    worker has run it: the lists still agree. Every H2O group of a hybrid model is checked (its
    sliding-window groups are vLLM's). With speculative decoding (``draft_tokens`` per step) a
    request may also hold the blocks its last step's rejected drafts were written to, and
    those vLLM reserves ahead for a draft model's drafts in every group, as in stock vLLM: up to
    cdiv(live length + draft_tokens + lookahead, block). ``history`` ({request id: [(tokens
    computed past the prompt, tokens evicted)]}) gets each running request's pair appended."""
    from vllm.utils.math_utils import cdiv

    from h2o_vllm.config import H2OConfig
    from h2o_vllm.policy import kv_len_after
    scheduler, runner = scheduler_of(llm), model_runner_of(llm)
    groups = h2o_groups(scheduler)
    assert groups, "no H2O KV-cache group"
    slack = draft_tokens + scheduler.num_lookahead_tokens
    evicted = []
    for request in scheduler.running:
        rid = request.request_id
        config = H2OConfig.from_dict(engine_h2o).with_overrides(
            {k[4:]: v for k, v in (request.sampling_params.extra_args or {}).items() if k.startswith("h2o_")})
        prompt_len = groups[0][1].prompt_len_of(request)  # a KV-transfer consumer's is shorter
        budget = config.budget(prompt_len, block_size)
        kv_len = kv_len_after(request.num_computed_tokens, prompt_len, budget)
        for group, manager in groups:
            held = [b.block_id for b in manager.req_to_blocks[rid]]
            assert cdiv(kv_len, block_size) <= len(held) <= cdiv(kv_len + slack, block_size), (rid, group, kv_len, len(held))
            assert held == worker_block_ids(runner, rid, group)
        evicted.append(request.num_computed_tokens - kv_len)
        if history is not None:
            history.setdefault(rid, []).append((request.num_computed_tokens - prompt_len, evicted[-1]))
    return evicted


def spec_decode_counts(llm) -> tuple[int, int]:
    """(draft tokens, accepted tokens) so far, from vLLM's own counters (an engine made with
    ``disable_log_stats=False``)."""
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (int(metrics["vllm:spec_decode_num_draft_tokens"]),
            int(metrics["vllm:spec_decode_num_accepted_tokens"]))


def repeated_passages(model_dir, shapes) -> list[list[int]]:
    """Prompts a model that copies makes n-gram drafts right on: passages of the GPL-3, each
    (words, repeats) of ``shapes`` repeated and cut half a passage short."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open("/usr/share/common-licenses/GPL-3") as f:
        words = f.read().split()
    prompts = []
    for i, (n, repeats) in enumerate(shapes):
        passage = tokenizer(" ".join(words[i * 400:i * 400 + n])).input_ids
        prompts.append((passage * repeats)[:len(passage) * repeats - len(passage) // 2])
    return prompts


def drive_checked(llm, prompts, params, engine_h2o: dict, block_size: int, **kwargs):
    """``run_steps`` with the block lists checked after every step and the pool drained after;
    returns (outputs, seen): ``seen["evicted"]`` per check, ``seen["held"]`` each request's
    block counts (by the id it was added with)."""
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    seen = {"evicted": [], "held": {}}
    _, manager = h2o_group(scheduler)

    def check():
        seen["evicted"].extend(check_block_lists(llm, engine_h2o, block_size))
        for request in scheduler.running:
            held = seen["held"].setdefault(request.request_id.rsplit("-", 1)[0], [])  # vLLM adds a suffix
            held.append(len(manager.req_to_blocks[request.request_id]))
    outputs = run_steps(llm, prompts, params, on_step=check, **kwargs)
    assert pool.get_num_free_blocks() == free_before, "blocks leaked"
    return outputs, seen
