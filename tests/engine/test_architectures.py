"""The architecture matrix: a tiny random model of every family in ``models.TINY_FAMILIES``
generates with H2O what the dense oracle does, token for token, under the paper's H2O and the
recommended score mode (observation window + pooling), on the CPU path and on the CUDA path
under the switch (``H2O_VLLM_TRITON_ON_CPU=1``, Triton interpreted; the hybrid Gemma 3 and
gpt-oss on Model Runner V2, the others on V1); after every step each
running request's block list agrees with the scheduler's count, and the pool drains.

The oracle runs each family through its own transformers forward with H2O's attention
installed (``h2o_vllm/oracle/model.py``), so what the families differ in (RoPE, partial rotary
or learned positions, qk-norm, projection biases, fused projections, a parallel residual, MHA
or GQA, soft-capped logits, learned sink logits, mixture-of-experts MLPs) is checked against code that shares nothing with vLLM's. Llama's
full budget matrix is test_exactness.py's and test_cuda.py's; the families here run two layers
(the interpreter's cost grows with every layer).
"""
import pytest
import torch

from budgets import MODES, extra_args, oracle
from engines import (V2_ENV, check_block_lists, greedy, model_runner_of, random_prompts, run_steps,
                     scheduler_of, start_in_fresh_process, vllm_engine)
from h2o_devtools import models
from h2o_vllm.vllm_hooks.triton_on_cpu import SWITCH

FAMILIES = [family for family in models.TINY_FAMILIES if family != "llama"]
# A hybrid model with more full-attention layers than sliding-window ones, the first one full:
# vLLM groups layers in equal numbers, so its two full layers make two H2O KV-cache groups,
# each with its own blocks, prefix-cache records and fresh blocks.
TWO_H2O_GROUPS = "gemma3-two-h2o-groups"
TWO_GROUP_LAYERS = ["full_attention", "full_attention", "sliding_attention"]
CASES = {
    "paper": {"heavy_ratio": 0.1, "recent_ratio": 0.1, "interval": 1, "min_tokens": 0},
    "recommended": {"heavy_ratio": 0.1, "recent_ratio": 0.1, "interval": 1, "min_tokens": 0,
                    "obs_window": 8, "pool_kernel": 5},
}
#: The key scorers, on the CPU path (CI time: the interpreter's cost grows with every row):
#: KeyDiff on every family, Expected Attention on those whose RoPE it moves ahead
#: (``score_modes.rotary``: the rotate-half layout, a rotation by the position alone; OPT has
#: none, GPT-NeoX rotates part of each head, Phi-3 is not in the list, gpt-oss scales it: each
#: refused before the model loads).
SCORER_CASES = {"keydiff": MODES["keydiff-pool-5-sinks-2-tokens-8+8-interval1"],
                "expected": MODES["expected-pool-5-sinks-2-tokens-8+8-interval1"]}
EXPECTED_FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", TWO_H2O_GROUPS)
BLOCK, MAX_TOKENS = 16, 16
PROMPTS = random_prompts((1, 17, 40, 100))
# Chunked prefill mixed with decodes; a pool of 20 blocks that the 8 requests contend for.
ENGINE = dict(in_process=True, block_size=BLOCK, max_model_len=256, max_num_batched_tokens=32,
              max_num_seqs=8, num_gpu_blocks_override=20, additional_config={"h2o": {}})
# A hybrid model's sliding-window group takes its own blocks from the same pool: a pool as
# tight as the others' serialises the requests and evicts every prefix before it is reused.
POOL = {"gemma3": 40, "gpt_oss": 40, TWO_H2O_GROUPS: 60}
CUDA_SWITCH = {SWITCH: "1", V2_ENV: "0"}
IMPLS = {"cpu": "H2OCPUImpl", "cuda": "H2OTritonImpl", "cuda-v2": "H2OTritonImpl"}
# The hybrid models' CUDA path runs on Model Runner V2 (CUDA's default runner; on the CPU vLLM
# runs V2 only with Triton, so only the switch reaches it), with its own per-group block
# tables; their V1 runner hooks are the CPU path's.
V2_FAMILIES = ["gemma3", "gpt_oss", TWO_H2O_GROUPS]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict:
    dirs = {family: models.build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, num_layers=2)
            for family in FAMILIES}
    dirs[TWO_H2O_GROUPS] = models.build_tiny_model(tmp_path_factory.mktemp(TWO_H2O_GROUPS), "gemma3",
                                                   num_layers=3, layer_types=TWO_GROUP_LAYERS)
    return dirs


@pytest.fixture(scope="module", autouse=True)
def engine_futures(family_dirs) -> dict:
    """Every engine of the module, started with it in fresh processes: {(path, family):
    future}. The CPU path's in one process; the CUDA path's (the switch must be set before
    vLLM is imported) in two, each serving half the families one after another, since the
    interpreter runs on one core; V2's in a fourth. Fresh processes also keep this one's transformers
    classes pristine: vLLM serves GPT-NeoX through its Transformers backend, which rebases
    transformers' own model class for torch.compile (the class then builds only inside a vLLM
    config, and the oracle, here or in later test modules, could not build it)."""
    families = list(family_dirs)
    v1 = [f for f in families if f not in V2_FAMILIES]
    jobs = ([("cpu", families, {})] + [("cuda", half, CUDA_SWITCH) for half in (v1[0::2], v1[1::2])]
            + [("cuda-v2", V2_FAMILIES, {**CUDA_SWITCH, V2_ENV: "1"})])
    futures = {}
    for path, names, env in jobs:
        future = start_in_fresh_process(serve_families, {f: family_dirs[f] for f in names}, IMPLS[path], env=env)
        futures.update({(path, f): future for f in names})
    return futures


def cases_of(family: str, path: str) -> dict:
    """The cases a family's engine on ``path`` serves."""
    if path != "cpu":
        return CASES
    scorers = {name: budget for name, budget in SCORER_CASES.items()
               if name != "expected" or family in EXPECTED_FAMILIES}
    return {**CASES, **scorers}


def serve_families(family_dirs: dict, impl: str) -> dict:
    """{family: outputs, or the traceback its engine failed with}."""
    import traceback
    path = next(p for p, name in IMPLS.items() if name == impl)
    results = {}
    for family, model_dir in family_dirs.items():
        try:
            results[family] = serve(model_dir, impl, family, cases_of(family, path))
        except Exception:
            results[family] = traceback.format_exc()
    return results


def serve(model_dir, impl: str, family: str, cases: dict) -> list[list[int]]:
    """Every case's outputs for PROMPTS (case-major), the engine driven step by step with the
    block lists checked after each."""
    prompts = PROMPTS * len(cases)
    params = [greedy(MAX_TOKENS, extra_args=extra_args(budget)) for budget in cases.values() for _ in PROMPTS]
    pool = POOL.get(family, ENGINE["num_gpu_blocks_override"])
    with vllm_engine(model_dir, **{**ENGINE, "num_gpu_blocks_override": pool}) as llm:
        layers = model_runner_of(llm).compilation_config.static_forward_context.values()
        assert {type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")} == {impl}
        managers = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers
        if family == TWO_H2O_GROUPS:
            assert [type(m).__name__ for m in managers].count("H2OManager") == 2
        pool = scheduler_of(llm).kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        evicted, cached = [], {}
        by_id = run_steps(llm, prompts, params, cached=cached,
                          on_step=lambda: evicted.extend(check_block_lists(llm, {}, BLOCK)))
        assert max(evicted) > 0, "no request ever evicted: the block check proved nothing"
        # Prefix caching is on (vLLM's default) and each prompt repeats per case.
        assert max(cached.values()) >= BLOCK, "no request hit the prefix cache"
        assert pool.get_num_free_blocks() == free_before, "blocks leaked"
    return [by_id[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expectations(family_dirs) -> dict:
    """The oracle's outputs of every family (computed while the engines run elsewhere)."""
    return {family: expected(model_dir, cases_of(family, "cpu")) for family, model_dir in family_dirs.items()}


def expected(model_dir, cases: dict) -> dict[str, list[list[int]]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    full = oracle(model, {"heavy_tokens": 4096, "recent_tokens": 4096}, BLOCK).generate(PROMPTS, MAX_TOKENS)
    want = {name: oracle(model, budget, BLOCK).generate(PROMPTS, MAX_TOKENS) for name, budget in cases.items()}
    assert all(want[name] != full for name in CASES), "eviction changed nothing: a weak check"
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)]
    if sinks:  # gpt-oss: an engine that left its sinks out would not pass by chance
        with torch.no_grad():
            for sink in sinks:
                sink.fill_(-1e4)
        sinkless = oracle(model, CASES["paper"], BLOCK).generate(PROMPTS, MAX_TOKENS)
        assert sinkless != want["paper"], "the sink logits changed nothing: a weak check"
    return want


def check(family: str, outputs: list[list[int]], want_by_case: dict, cases: dict) -> None:
    n = len(PROMPTS)
    assert len(outputs) == n * len(cases)
    for i, name in enumerate(cases):
        assert outputs[i * n:(i + 1) * n] == want_by_case[name], f"{family}, {name}: the engine and the oracle differ"


@pytest.mark.parametrize(("family", "path"), [(f, "cpu") for f in FAMILIES + [TWO_H2O_GROUPS]]
                         + [(f, "cuda-v2" if f in V2_FAMILIES else "cuda") for f in FAMILIES + [TWO_H2O_GROUPS]])
def test_family_equals_oracle(family, path, expectations, engine_futures):
    result = engine_futures[path, family].result()[family]
    if isinstance(result, str):
        pytest.fail(f"{family} ({path} path, shared process):\n{result}", pytrace=False)
    check(family, result, expectations[family], cases_of(family, path))
