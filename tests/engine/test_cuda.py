"""H2O's CUDA path inside a real vLLM engine: ``H2OTritonAttentionBackend`` (vLLM's Triton
attention + H2O's Triton kernels) generates token for token what the dense oracle does; with
H2O off it equals stock Triton attention (and, on the CPU, stock CPU attention); blocks follow
the live KV length and the pool drains. On both of vLLM's model runners (V1, and V2, the CUDA
default) and with async scheduling (the CUDA default) on and off.

With a GPU the kernels are compiled. Without one the same engines run inside vLLM's CPU engine
with every Triton kernel interpreted (``H2O_VLLM_TRITON_ON_CPU=1`` with ``TRITON_INTERPRET=1``,
set by the top conftest; docs/cuda.md says what that proves), on a smaller matrix: the
interpreter costs ~1-2 s per engine step here.
"""
import os
import time

import pytest
import torch

from budgets import BUDGETS, LARGER_THAN_EVERY_SEQUENCE, MODES, extra_args, oracle
from cuda_path import CUDA_PATH_RUNS, DEVICE, ON_GPU
from engines import (V2_ENV, check_block_lists, generate_ids, greedy, in_fresh_process,
                     model_runner_of, random_prompts, run_steps, scheduler_of, spec_decode_counts,
                     start_in_fresh_process, vllm_engine)
from h2o_vllm.vllm_hooks.triton_on_cpu import SWITCH

BLOCK = 16
ENGINE_H2O = {}  # the paper's default engine-wide; the matrix arrives per request
if ON_GPU:
    MAX_TOKENS = 40
    PROMPT_LENGTHS = (1, 15, 16, 17, 33, 100, 300)
    BUDGET_NAMES = list(BUDGETS) + list(MODES)
    CHUNKED = dict(in_process=True, enforce_eager=True, max_num_batched_tokens=64, max_num_seqs=8)
    ENGINES = {"piecewise-graphs": dict(enforce_eager=False),  # vLLM's defaults: V2, async
               "v2-eager-chunked-async": CHUNKED,
               "v2-eager-chunked-sync": dict(CHUNKED, async_scheduling=False),
               "v1-eager-chunked-async": dict(CHUNKED, env={V2_ENV: "0"}),
               "v1-eager-chunked-sync": dict(CHUNKED, async_scheduling=False, env={V2_ENV: "0"})}
    STOCK_TRITON = dict(plugins=False)
    H2O_OFF = {}
else:
    MAX_TOKENS = 16
    # Shorter than the budget, past one block, and long enough to be prefilled in two chunks
    # while the short ones decode.
    PROMPT_LENGTHS = (1, 17, 40)
    # Absolute and ratio, Local, interval 1 and one block.
    # Plus every score mode at once: the weighted Triton score kernels and sink selection;
    # and pooling, which ranks the prompt's compaction on the device; and KeyDiff, which ranks
    # from the keys the device gathers from its cache; and Expected Attention, which also reads
    # the values and the step's queries.
    BUDGET_NAMES = ["tokens-8+8-interval1", "ratio-0.1+0.1-block", "local-0+0.2-interval1",
                    "all-modes-tokens-6+6-interval1", "pool-5-window-8-tokens-8+8-interval1",
                    "expected-pool-5-sinks-2-tokens-8+8-interval1", "keydiff-pool-5-sinks-2-tokens-8+8-interval1"]
    # The engine core in process, so the blocks and the mixed prefill + decode steps are
    # checked after every step: with the scheduler a step ahead of the worker (async) and
    # without, on both model runners. A pool of 11 blocks (176 tokens) makes the matrix preempt:
    # seen on each of the four chunked engines below, Expected Attention's 17-token request after its
    # first compaction, whose recompute must replay its steps (docs/semantics.md, "Expected
    # Attention"; without that it left the oracle at its fourth token, on V1 as on V2), and the
    # engine default's 40-token one before its first. (At 12 blocks, with Expected Attention
    # last, V1 sync preempted nothing.)
    CHUNKED = dict(in_process=True, max_num_batched_tokens=32, max_num_seqs=16, max_model_len=128,
                   num_gpu_blocks_override=11)
    ENGINES = {"v1-chunked-async": dict(CHUNKED, async_scheduling=True),
               "v1-chunked-sync": dict(CHUNKED, async_scheduling=False),
               "v2-chunked-async": dict(CHUNKED, async_scheduling=True, env={V2_ENV: "1"}),
               "v2-chunked-sync": dict(CHUNKED, async_scheduling=False, env={V2_ENV: "1"}),
               # vLLM's CUDA defaults under the switch (V2, async scheduling, a separate
               # engine-core process, unchunked prompts), in the interpreter's other right
               # dtype (bf16 is refused); the peaky model keeps greedy tokens clear of fp16
               # rounding, so the fp32 oracle still applies
               "defaults-fp16": dict(dtype="float16", env={V2_ENV: "1"})}
    # The plugin's seams select TRITON_ATTN on the CPU; H2O stays off. The control and the
    # H2O-off engine run their engine core in this process: a CPU engine in its own processes
    # spawns an engine core and a worker, ~30 s of start-up each time (in process: ~7 s).
    # Spawned processes under the switch stay covered: the prefix-cache case (V1) and
    # defaults-fp16 (V2) start theirs.
    STOCK_TRITON = dict(in_process=True)
    H2O_OFF = dict(in_process=True)
if not CUDA_PATH_RUNS:
    pytest.skip("no GPU and TRITON_INTERPRET != 1", allow_module_level=True)
PROMPTS = random_prompts(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """Two layers, not the suite's four: the interpreter's cost grows with every layer, and the
    second layer already attends over what the first one's eviction left."""
    from h2o_devtools import models
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2-layers"),
                                   num_layers=2)


def _engine(model_dir, **kwargs):
    env = {**DEVICE.get("env", {}), **kwargs.pop("env", {})}
    return vllm_engine(model_dir, **{"block_size": BLOCK, **DEVICE, **kwargs, "env": env})


def _v2(kwargs) -> bool:
    """Whether an engine of ENGINES runs Model Runner V2 (vLLM's choice on a GPU unless told)."""
    env = {**DEVICE.get("env", {}), **kwargs.get("env", {})}
    return env.get(V2_ENV, os.environ.get(V2_ENV, "1" if ON_GPU else "0")) == "1"


def _serve(fn, model_dir, kwargs, *args, fresh: bool = False):
    """``fn(model_dir, kwargs, *args)``; in a fresh process when ``fresh``, and without a GPU for
    a V2 engine: V2's own Triton kernels must be defined with the real (interpreted) Triton,
    which only a process that has not yet imported vLLM's runners can do
    (vllm_hooks/triton_on_cpu.py)."""
    if fresh or (_v2(kwargs) and not ON_GPU):  # the process starts with the switch and V2 asked for
        env = {**DEVICE.get("env", {}), **kwargs.get("env", {})}
        return in_fresh_process(fn, model_dir, kwargs, *args, env=env)
    return fn(model_dir, kwargs, *args)


@pytest.fixture(scope="module")
def stock_triton_outputs(tiny_llama_dir):
    # Stock Triton attention: the backend H2O builds on (fp32 rules out FlashAttention anyway).
    with _engine(tiny_llama_dir, attention_backend="TRITON_ATTN", **STOCK_TRITON) as llm:
        assert "H2O" not in llm.llm_engine.vllm_config.attention_config.backend.get_path()
        return generate_ids(llm, PROMPTS, greedy(MAX_TOKENS))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


MATRIX = BUDGET_NAMES + ["larger", "engine-default"]


@pytest.fixture(scope="module", params=list(ENGINES))
def h2o_outputs(request, tiny_llama_dir):
    """{budget name: outputs} from one H2O engine serving the whole matrix per request."""
    if _v2(ENGINES[request.param]) and not ON_GPU:
        result = request.getfixturevalue("v2_matrix_outputs")[request.param]
        if isinstance(result, str):  # this engine failed in the shared process: its traceback
            pytest.fail(f"{request.param} (shared V2 process):\n{result}", pytrace=False)
        outputs = result
    else:
        outputs = _serve(serve_matrix, tiny_llama_dir, ENGINES[request.param])
    n = len(PROMPTS)
    return {name: outputs[i * n:(i + 1) * n] for i, name in enumerate(MATRIX)}


V2_CPU_ENGINES = [name for name, kwargs in ENGINES.items() if _v2(kwargs)] if not ON_GPU else []


@pytest.fixture(scope="module", autouse=True)
def v2_matrix_future(tiny_llama_dir):
    """Without a GPU: every V2 engine of ENGINES served in turn by one fresh process, which
    imports torch, vLLM and Triton once for all of them; {name: outputs, or the traceback it
    failed with}, so that a failing engine fails its own tests only. Started with the module
    and read when the V2 tests come: the interpreter runs a kernel on one core, so the V2
    process and this one's engines share the two cores for most of the module."""
    if not V2_CPU_ENGINES:
        return None
    envs = {name: {**DEVICE.get("env", {}), **ENGINES[name].get("env", {})} for name in V2_CPU_ENGINES}
    env = envs[V2_CPU_ENGINES[0]]
    assert all(e == env for e in envs.values()), "the V2 engines need one process environment"
    return start_in_fresh_process(serve_matrices, tiny_llama_dir, V2_CPU_ENGINES, env=env)


@pytest.fixture(scope="module")
def v2_matrix_outputs(v2_matrix_future):
    return v2_matrix_future.result()


def serve_matrices(model_dir, names) -> dict[str, list[list[int]] | str]:
    """``serve_matrix`` for each named engine in turn, in this process."""
    import traceback
    results = {}
    for name in names:
        try:
            results[name] = serve_matrix(model_dir, ENGINES[name])
        except Exception:
            results[name] = traceback.format_exc()
    return results


def serve_matrix(model_dir, kwargs) -> list[list[int]]:
    """The matrix's outputs, in order; an engine whose core runs in this process is driven
    step by step with the block lists checked after every step, and one more request is
    aborted mid-run."""
    budgets = {**BUDGETS, **MODES, "larger": LARGER_THAN_EVERY_SEQUENCE, "engine-default": {}}
    params = [greedy(MAX_TOKENS, extra_args=extra_args(budgets[name]) or None)
              for name in MATRIX for _ in PROMPTS]
    with _engine(model_dir, additional_config={"h2o": ENGINE_H2O}, **dict(kwargs)) as llm:
        config = llm.llm_engine.vllm_config
        assert config.attention_config.backend.get_path().endswith("H2OTritonAttentionBackend")
        assert config.use_v2_model_runner == _v2(kwargs)
        assert config.scheduler_config.async_scheduling == kwargs.get("async_scheduling", True)
        assert not config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        if kwargs.get("in_process"):
            return _run_checking_blocks(llm, PROMPTS * len(MATRIX), params)
        return generate_ids(llm, PROMPTS * len(MATRIX), params)


def _run_checking_blocks(llm, prompts, params) -> list[list[int]]:
    layers = model_runner_of(llm).compilation_config.static_forward_context.values()
    assert {type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")} == {"H2OTritonImpl"}
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    evicted, mixed_steps, ahead, preempted = [], 0, 0, set()

    def check():
        nonlocal mixed_steps, ahead
        evicted.extend(check_block_lists(llm, ENGINE_H2O, BLOCK))
        states = {r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running}
        mixed_steps += states == {True, False}  # a prompt chunk and a decode in one batch
        # Async: the next step is already scheduled (its tokens counted, its output not processed).
        ahead += any(r.num_in_flight_tokens for r in scheduler.running)
        preempted.update(r.request_id for r in scheduler.running if r.num_preemptions)

    aborted = str(len(prompts))  # one more request, aborted mid-run
    cached = {}
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:  # admit greedily, as stock vLLM does, so that the small pool preempts
            from h2o_vllm.scheduler.manager import H2OManager
            mp.setattr(H2OManager, "admission_headroom", lambda self, *args: 0)
        by_id = run_steps(llm, prompts + [prompts[-1]], params + [params[-1]], on_step=check,
                          abort_after=(8, [aborted]), cached=cached)
    assert aborted not in by_id
    assert max(evicted) > 0, "no request ever evicted: the block check proved nothing"
    assert mixed_steps > 0, "no step mixed prefill chunks and decodes"
    assert (ahead > 0) == llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    # Prefix caching is on (vLLM's default) and the matrix repeats each prompt per budget.
    assert max(cached.values()) >= BLOCK, "no request hit the prefix cache"
    if not ON_GPU:
        assert preempted, "no request was preempted: the pool check proved less"
    assert pool.get_num_free_blocks() == free_before, "blocks leaked"
    return [by_id[str(i)] for i in range(len(prompts))]


def test_cuda_h2o_off_is_stock_triton_attention(tiny_llama_dir, stock_triton_outputs):
    """Plugin loaded, H2O off, H2O's backend named explicitly: stock vLLM's tokens."""
    with _engine(tiny_llama_dir, attention_backend="CUSTOM", **H2O_OFF) as llm:
        assert generate_ids(llm, PROMPTS, greedy(MAX_TOKENS)) == stock_triton_outputs


@pytest.mark.skipif(ON_GPU, reason="CPU attention is the CPU platform's")
def test_stock_triton_attention_is_stock_cpu_attention(tiny_llama_dir, stock_triton_outputs):
    """The interpreted Triton kernels and vLLM's CPU kernels agree (stock vLLM, no plugin;
    its CPU attention admits multiples of 32 only)."""
    with vllm_engine(tiny_llama_dir, plugins=False, block_size=32) as llm:
        assert generate_ids(llm, PROMPTS, greedy(MAX_TOKENS)) == stock_triton_outputs


def test_cuda_budget_larger_than_every_sequence_is_stock_vllm(request, h2o_outputs,
                                                             stock_triton_outputs):
    if "fp16" in request.node.callspec.id:
        # Seen: without eviction, fp16 departs from the fp32 control. The fp16 engine is held to
        # the (fp32) oracle on the evicting budgets, which it matches token for token.
        pytest.skip("the stock control runs in fp32")
    assert h2o_outputs["larger"] == stock_triton_outputs


#: Budgets the fp32 oracle cannot stand for under fp16 K/V; the fp32 engines check them.
#: The pooled budget diverged at the 40-token prompt under fp16 (not traced; pooling ranks
#: whole plateaus of pool_kernel tokens, so a near-tie between two peaks moves several). The
#: engine default's 32-token floor never evicts the 17-token prompt (17 + 16 < 32 + 16), and
#: fp16 attention over a whole cache meets a near-tie of its greedy logits there: the reason
#: the stock control is fp32-only too.
FP32_ONLY = {"pool-5-window-8-tokens-8+8-interval1", "engine-default"}


@pytest.mark.parametrize("budget", BUDGET_NAMES + ["engine-default"])
def test_cuda_h2o_matches_dense_oracle(request, h2o_outputs, hf_model, budget, stock_triton_outputs):
    if budget in FP32_ONLY and "fp16" in request.node.callspec.id:
        pytest.skip("fp16 K/V: this budget is checked by the fp32 engines (FP32_ONLY)")
    config = {**ENGINE_H2O, **{**BUDGETS, **MODES}.get(budget, {})}
    expected = oracle(hf_model, config, BLOCK).generate(PROMPTS, MAX_TOKENS)
    for length, got, want in zip(PROMPT_LENGTHS, h2o_outputs[budget], expected):
        assert got == want, f"prompt of {length} tokens diverges from the oracle"
    assert h2o_outputs[budget] != stock_triton_outputs  # the control: eviction changed something


# --------------------------------------------------------------------------- fp8 KV cache

FP8_ENGINES = {"v1-chunked-sync": dict(CHUNKED, async_scheduling=False, env={V2_ENV: "0"}),
               "v2-chunked-async": dict(CHUNKED, async_scheduling=True, env={V2_ENV: "1"})}


@pytest.mark.parametrize("engine", list(FP8_ENGINES))
def test_cuda_h2o_with_an_fp8_kv_cache_matches_the_fp8_oracle(tiny_llama_dir, hf_model, engine):
    """``--kv-cache-dtype fp8`` (e4m3, per-tensor scales 1.0): the fused kernel and the score
    kernels read fp8 * scale, compaction moves the bytes, the interpreted write stores what a
    GPU stores. The whole matrix per request, block lists checked after every step, equals an
    oracle whose cache holds the K/V as the fp8 cache gives them back (``oracle.stored_kv``);
    and fp8 shows: some budget's tokens differ from the unquantised oracle's."""
    from h2o_vllm.oracle import FP8_E4M3
    outputs = _serve(serve_matrix, tiny_llama_dir, dict(FP8_ENGINES[engine], kv_cache_dtype="fp8"))
    budgets = {**BUDGETS, **MODES, "larger": LARGER_THAN_EVERY_SEQUENCE, "engine-default": ENGINE_H2O}
    n, quantised = len(PROMPTS), False
    for i, name in enumerate(MATRIX):
        config = {**ENGINE_H2O, **budgets[name]}
        want = oracle(hf_model, config, BLOCK, stored_kv=FP8_E4M3).generate(PROMPTS, MAX_TOKENS)
        assert outputs[i * n:(i + 1) * n] == want, f"{name}: H2O with an fp8 cache left the oracle"
        quantised = quantised or want != oracle(hf_model, config, BLOCK).generate(PROMPTS, MAX_TOKENS)
    assert quantised, "fp8 rounding changed no token: the test cannot tell fp8 from fp32"


@pytest.mark.skipif(ON_GPU, reason="the switch is for a CPU-only vLLM")
@pytest.mark.parametrize("kwargs, words", [
    (dict(dtype="bfloat16"), "--dtype float32"),
    (dict(attention_backend="CPU_ATTN", additional_config={"h2o": {}}),
     f"--attention-backend CPU_ATTN cannot be combined with H2O KV eviction with {SWITCH}=1"),
])
def test_switch_refuses_what_it_cannot_run_before_loading(tiny_llama_dir, kwargs, words):
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        with _engine(tiny_llama_dir, **kwargs):
            pass
    assert words in str(error.value)
    assert time.monotonic() - start < 30, "refused only after the model loaded"


# Hits on every runner and scheduling: the matrix engines above (their requests repeat each
# prompt, prefix caching on, hits asserted); here the shared-prefix pattern, every score mode,
# and an engine core in processes of its own. Hits on an fp8 cache (the hit's K/V bytes copied
# as they are, its fp32 score records beside them) are the fp8 matrix engines' (V1 sync and V2
# async, every budget, hits asserted, tokens the fp8 oracle's): a case of its own here cost CI
# an engine start and checked no pair of these that the others leave out.
def test_cuda_prefix_cache_hits_match_the_oracle(tiny_llama_dir, hf_model):
    """The CUDA path with prefix caching on (V1, async scheduling, every score mode): requests
    sharing a 40-token prefix, one after the other, hit it (the hit copied by vLLM, its scores
    from a record) and still generate the oracle's tokens, through the fused attention and the
    record-writing unfused steps."""
    config = MODES["all-modes-tokens-6+6-interval1"]
    shared = random_prompts([40], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 20], seed=8)]
    expected = oracle(hf_model, config, BLOCK).generate(prompts, MAX_TOKENS)
    kwargs = dict(enable_prefix_caching=True, async_scheduling=True, env={V2_ENV: "0"})
    outputs, hits = _serve(serve_one_by_one, tiny_llama_dir, kwargs, prompts, config)
    assert outputs == expected
    assert max(hits) >= 32, hits  # the control: later requests did hit the shared prefix


def serve_one_by_one(model_dir, kwargs, prompts, config) -> tuple[list[list[int]], list[int]]:
    """Each prompt in turn: (outputs, prefix-cache hit tokens of each)."""
    params = greedy(MAX_TOKENS, extra_args=extra_args(config))
    outputs, hits = [], []
    with _engine(model_dir, additional_config={"h2o": ENGINE_H2O}, **dict(kwargs)) as llm:
        for prompt in prompts:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            outputs.append(list(out.outputs[0].token_ids))
            hits.append(out.num_cached_tokens or 0)
    return outputs, hits


# --------------------------------------------------------------------------- KV transfer

# A producer and a consumer engine in turn over one storage folder (tests/engine/
# test_kv_transfer.py has the CPU path's matrix and faults): V1 synchronous with a draft model
# (the tiny Llama drafting for itself: its layers' blocks travel whole beside H2O's state), and
# V2 with async scheduling and an fp8 cache (the state's K/V travel as the fp8 bytes the cache
# holds); then the V2 one over NIXL (test_kv_transfer_nixl.py has its faults), the producer up
# beside. They keep the 12 blocks they ran with before the matrix's pool shrank to 11 (their
# consumer must not preempt). The drafter's whole blocks share the pool, so that case gets 24
# blocks (vLLM refuses to start on 12). Until admission claimed the drafter group's growth
# (``H2OManager.whole_group_headroom``) the decoder preempted a loaded request there, whose
# recompute may leave the oracle (docs/semantics.md, "Preemption"); ``_decode_loaded`` asserts
# that none is.
TRANSFER_CASES = {"v1-chunked-sync-drafter": dict(CHUNKED, async_scheduling=False, env={V2_ENV: "0"},
                                                  num_gpu_blocks_override=24, drafter=True),
                  # Expected Attention too: the producer's compaction reads its prompt's last
                  # queries, the consumer's its own decode queries, over an fp8 cache.
                  "v2-chunked-async-fp8": dict(CHUNKED, async_scheduling=True, kv_cache_dtype="fp8",
                                               env={V2_ENV: "1"}, num_gpu_blocks_override=12,
                                               budgets=["tokens-8+8-interval1", "all-modes-tokens-6+6-interval1",
                                                        "ratio-0.1+0.1-block",
                                                        "expected-pool-5-sinks-2-tokens-8+8-interval1"]),
                  "v2-chunked-async-fp8-nixl": dict(CHUNKED, async_scheduling=True, kv_cache_dtype="fp8",
                                                    env={V2_ENV: "1"}, nixl=True, num_gpu_blocks_override=12)}
TRANSFER_BUDGETS = ["tokens-8+8-interval1", "all-modes-tokens-6+6-interval1", "ratio-0.1+0.1-block"]


@pytest.mark.parametrize("engine", list(TRANSFER_CASES))
def test_cuda_kv_transfer_pair_matches_the_oracle(tiny_llama_dir, hf_model, tmp_path, engine):
    from h2o_vllm.oracle import FP8_E4M3, StoredKV
    kwargs = dict(TRANSFER_CASES[engine])
    if kwargs.pop("nixl", False):
        from h2o_vllm.kv_transfer.transfer_config import nixl_missing
        if nixl_missing() is not None:
            pytest.skip(f"nixl does not import here ({nixl_missing()}): pip install 'h2o-vllm[nixl]'")
        outputs, loaded = _serve(nixl_transfer_pair, tiny_llama_dir, kwargs)
    else:
        # An engine with a speculator leaves vLLM's speculative kernels registered in its process,
        # which fail the next engine started there (test_cuda_speculative.py).
        outputs, loaded = _serve(transfer_pair, tiny_llama_dir, kwargs, str(tmp_path),
                                 fresh=kwargs.get("drafter", False))
    stored = FP8_E4M3 if kwargs.get("kv_cache_dtype") == "fp8" else StoredKV()
    n, names = len(PROMPTS), kwargs.get("budgets", TRANSFER_BUDGETS)
    for i, name in enumerate(names):
        want = oracle(hf_model, BUDGETS.get(name) or MODES[name], BLOCK, stored_kv=stored)
        assert outputs[i * n:(i + 1) * n] == want.generate(PROMPTS, MAX_TOKENS), name
    assert loaded == n * len(names)


def transfer_pair(model_dir, kwargs, store) -> tuple[list[list[int]], int]:
    """(producer's first token + consumer's tokens for each request, the consumer's loads).
    With ``drafter``: the model drafts for itself on both sides, the producer in processes of its
    own (one process runs one speculative engine), and the consumer accepts drafts."""
    kwargs = dict(kwargs)
    names = kwargs.pop("budgets", TRANSFER_BUDGETS)
    drafts = 3 if kwargs.pop("drafter", False) else 0
    if drafts:
        kwargs.update(speculative_config={"method": "draft_model", "model": str(model_dir),
                                          "num_speculative_tokens": drafts}, disable_log_stats=False)

    def engine(role, **settings):
        kv = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": store}}
        return _engine(model_dir, additional_config={"h2o": ENGINE_H2O}, kv_transfer_config=kv,
                       **{**kwargs, **settings})

    budgets = [extra_args({**BUDGETS, **MODES}[name]) for name in names]
    prompts = PROMPTS * len(budgets)
    with engine("kv_producer", **({"in_process": False} if drafts else {})) as llm:
        firsts = generate_ids(llm, prompts, [greedy(1, extra_args=b) for b in budgets for _ in PROMPTS])
    with engine("kv_consumer") as llm:
        rest, loaded = _decode_loaded(llm, [p + f for p, f in zip(prompts, firsts)],
                                      [greedy(MAX_TOKENS - 1, extra_args=b) for b in budgets for _ in PROMPTS],
                                      drafts)
    return [f + rest[i] for i, f in enumerate(firsts)], loaded


def _decode_loaded(llm, prompts, params, drafts: int = 0) -> tuple[list[list[int]], int]:
    """The consumer's side of a pair: (each request's tokens, the prompts it loaded), block
    lists checked after every step, the pool drained, and no request preempted (a preempted
    loaded request computes its prompt itself, and its recompute may leave the oracle: the
    case's pool is too small). With ``drafts``: some were accepted, so the drafter's blocks
    came over."""
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    preempted = set()

    def check():
        check_block_lists(llm, ENGINE_H2O, BLOCK, drafts)
        preempted.update(r.request_id for r in scheduler.running if r.num_preemptions)
    outputs = run_steps(llm, prompts, params, on_step=check)
    assert pool.get_num_free_blocks() == free, "blocks leaked"
    assert not preempted, f"a loaded request was preempted ({sorted(preempted)}): give the pool room"
    if drafts:
        assert spec_decode_counts(llm)[1] > 0, "no draft accepted: the drafter's blocks did not come over"
    return [outputs[str(i)] for i in range(len(prompts))], scheduler.connector.transfer.num_loaded


def nixl_transfer_pair(model_dir, kwargs) -> tuple[list[list[int]], int]:
    """The same over NIXL, as vLLM's proxy drives it: the producer (its own processes, up while
    the consumer reads) answers each prompt's first token and params; the consumer gets the
    original prompts with them and answers whole."""
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"h2o_staging_mib": 4}}
    budgets = [extra_args({**BUDGETS, **MODES}[name]) for name in TRANSFER_BUDGETS]
    prompts = PROMPTS * len(budgets)
    remote = {"do_remote_decode": True, "do_remote_prefill": False}
    common = dict(additional_config={"h2o": ENGINE_H2O}, kv_transfer_config=kv, **kwargs)
    with _engine(model_dir, **dict(common, in_process=False)) as producer:
        firsts = producer.generate([{"prompt_token_ids": p} for p in prompts],
                                   [greedy(1, extra_args={**b, "kv_transfer_params": remote})
                                    for b in budgets for _ in PROMPTS], use_tqdm=False)
        with _engine(model_dir, **common) as llm:
            return _decode_loaded(llm, prompts, [
                greedy(MAX_TOKENS, extra_args={**b, "kv_transfer_params": out.kv_transfer_params})
                for b, out in zip([b for b in budgets for _ in PROMPTS], firsts)])
