"""Speculative decoding (n-gram, draft model, EAGLE / EAGLE-3, MTP) with H2O: greedy H2O with a speculator generates
exactly what the dense oracle (H2O without one) generates, with drafts accepted and rejected
along the way (docs/semantics.md, "Speculative decoding"); block lists agree after every step
(in every H2O KV-cache group: a draft model's layers stay whole in groups of their own, and
vLLM then splits the target's layers into several), pools drain, and preemption, aborts and
prefix-cache hits keep working.

Real text on SmolLM2 (its induction heads copy a repeated passage, so n-gram drafts are
accepted; as its own draft model, with a whole KV cache, it drafts what dense attention would
generate, so drafts are rejected exactly where eviction changed a token), and the tiny random
Llama for the memory checks.

Every engine with a speculator runs in a fresh process: one in this process would register
vLLM's speculative-decoding Triton kernels here, and vLLM's kernel dispatcher then fails the
next engine this process starts (``register_triton_kernel_overrides``: '_lib_fn_wrapper' object
has no attribute 'get'), in this module or the next one pytest-xdist runs here.
"""
import pytest
import torch

from budgets import extra_args, oracle_matrix
from engines import (V2_ENV, check_block_lists, greedy, in_fresh_process, random_prompts, repeated_passages,
                     run_steps, scheduler_of, spec_decode_counts, stock_admission, vllm_engine)
from h2o_vllm.vllm_hooks.triton_on_cpu import SWITCH

BLOCK = 32
#: Enough for every budget below to compact while decoding, between steps with drafts: the
#: one-block interval (32) of the ratio budget first compacts after 32 decode tokens, so from
#: 34 tokens on (``_run_matrix`` asserts it); the others compact every 6-10 tokens (interval 1
#: every step). More tokens repeat the same cycle (48 did: CI time).
MAX_TOKENS = 36
DRAFTS = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Intervals above 1 (room for drafts between compactions), the score modes, chunked prompts;
# interval 1 leaves no room: drafts are all cut, and the tokens are still the oracle's.
BUDGETS = {
    "ratio-0.1+0.1-block": {"heavy_ratio": 0.1, "recent_ratio": 0.1},
    "tokens-16+16-interval8": {"heavy_tokens": 16, "recent_tokens": 16, "interval": 8},
    "decay-window-tokens-12+12-interval6": {"heavy_tokens": 12, "recent_tokens": 12, "interval": 6,
                                            "decay": 0.9, "obs_window": 8},
    "sinks-4-tokens-12+12-interval10": {"heavy_tokens": 12, "recent_tokens": 12, "interval": 10,
                                        "sink_tokens": 4},
    "chunk-64-tokens-16+16-interval8": {"heavy_tokens": 16, "recent_tokens": 16, "interval": 8,
                                        "prefill_chunk": 64},
    "tokens-16+16-interval1": {"heavy_tokens": 16, "recent_tokens": 16, "interval": 1},
}
#: The key scorers (docs/semantics.md, "KeyDiff", "Expected Attention"), each with room for
#: drafts between its compactions: scores from the live keys (and, for Expected Attention, the
#: compacting step's queries: its token runs alone, so they are one decode query, as in the
#: oracle). On the n-gram engine and its KV transfer only (CI time): the drafter does not
#: enter the target's scoring.
KEY_SCORER_BUDGETS = {
    "keydiff-pool-5-sinks-2-tokens-12+12-interval6": {"heavy_tokens": 12, "recent_tokens": 12, "interval": 6,
                                                      "score": "keydiff", "pool_kernel": 5, "sink_tokens": 2},
    "expected-pool-5-sinks-2-tokens-16+16-interval8": {"heavy_tokens": 16, "recent_tokens": 16, "interval": 8,
                                                       "score": "expected", "pool_kernel": 5, "sink_tokens": 2},
}
NGRAM_BUDGETS = BUDGETS | KEY_SCORER_BUDGETS


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """Passages of the GPL-3 repeated once and a half: the model copies, n-gram guesses. The
    second is cut to one token past a block (161 = 5 x 32 + 1): when it hits the prefix cache,
    one token is left to compute, and vLLM pads that row with dummy drafts (the step compacts:
    ``scheduler.scheduling.drop_padding`` takes them off)."""
    first, second, third = repeated_passages(smollm2_dir, ((60, 2), (100, 2), (40, 4)))
    assert len(second) > 5 * BLOCK + 1
    return [first, second[:5 * BLOCK + 1], third]


@pytest.fixture(scope="module")
def oracle_outputs(smollm2_dir, prompts):
    """Before any engine runs in this process (the oracle is slower after)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return oracle_matrix(model, NGRAM_BUDGETS, BLOCK, prompts, MAX_TOKENS, full=prompts)


def _smollm2_rounds(model_dir, prompts, speculative_config=NGRAM, budgets=BUDGETS):
    """In a fresh process (see the module note): the matrix twice on one engine, the second
    round admitted on the first's prefix-cache hits; and the engine's KV-cache groups."""
    with vllm_engine(model_dir, in_process=True, block_size=BLOCK, speculative_config=speculative_config,
                     disable_log_stats=False, additional_config={"h2o": {}}) as llm:
        managers = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers
        groups = [type(m).__name__ for m in managers]
        return (_run_matrix(llm, prompts, budgets, decode_compactions=True),
                _run_matrix(llm, prompts, budgets, decode_compactions=True), groups)


@pytest.fixture(scope="module")
def smollm2_rounds(smollm2_dir, prompts, oracle_outputs):
    return in_fresh_process(_smollm2_rounds, smollm2_dir, prompts, NGRAM, NGRAM_BUDGETS)


@pytest.fixture(scope="module")
def draft_model_rounds(smollm2_dir, prompts, oracle_outputs):
    # SmolLM2 cut to its first layers drafts nothing right (4 or 12 layers: under 1% accepted,
    # stock vLLM alike); as its own drafter it is right wherever H2O did not change a token.
    draft = {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": DRAFTS}
    return in_fresh_process(_smollm2_rounds, smollm2_dir, prompts, draft)


def _run_matrix(llm, prompts, budgets=BUDGETS, block=BLOCK, max_tokens=MAX_TOKENS, firsts=None, kv_params=None,
                decode_compactions=False):
    """{budget: outputs} of every budget at once (per-request budgets), block lists checked
    after every step; (drafts, accepted) of the run; the pool drains. With ``firsts`` ({budget: each prompt's first token}) each request continues
    its prompt from that token, as a KV transfer's decoder does, and its outputs start with it.
    ``kv_params`` ({budget: each prompt's ``kv_transfer_params``}): sent as vLLM's P/D proxy
    sends them. ``decode_compactions``: assert that every budget compacted some request after
    its prompt, while drafts were accepted and rejected around it."""
    scheduler = scheduler_of(llm)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    drafts_before, accepted_before = spec_decode_counts(llm)
    firsts = firsts or {name: [[]] * len(prompts) for name in budgets}
    kv_params = kv_params or {name: [None] * len(prompts) for name in budgets}
    requests = [(p + first, greedy(max_tokens - len(first), extra_args={
                    **extra_args(b), **({"kv_transfer_params": kv} if kv is not None else {})}))
                for name, b in budgets.items() for p, first, kv in zip(prompts, firsts[name], kv_params[name])]
    evicted, history = [], {}
    outputs = run_steps(llm, [p for p, _ in requests], [params for _, params in requests],
                        on_step=lambda: evicted.extend(check_block_lists(llm, {}, block, DRAFTS, history)))
    assert max(evicted) > 0, "nothing was evicted: the block checks proved little"
    if decode_compactions:
        # A request's evicted count grew from one step to the next once its prompt was in.
        compacted = {int(rid.rsplit("-", 1)[0]) // len(prompts) for rid, seen in history.items()
                     if any(past >= 0 and later > now for (past, now), (_, later) in zip(seen, seen[1:]))}
        assert compacted == set(range(len(budgets))), \
            f"no compaction while decoding under {sorted(set(budgets) - {list(budgets)[i] for i in compacted})}"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    drafts, accepted = spec_decode_counts(llm)
    n = len(prompts)
    by_budget = {name: [firsts[name][j] + outputs[str(i * n + j)] for j in range(n)]
                 for i, name in enumerate(budgets)}
    return by_budget, drafts - drafts_before, accepted - accepted_before


def test_ngram_h2o_equals_the_dense_oracle_with_drafts_accepted(smollm2_rounds, oracle_outputs):
    (outputs, drafts, accepted), _, _ = smollm2_rounds
    print(f"n-gram with H2O: {accepted}/{drafts} draft tokens accepted")
    assert accepted > 0 and accepted < drafts, "no draft accepted (or none rejected): the test proves little"
    for name in NGRAM_BUDGETS:
        assert outputs[name] == oracle_outputs[name], f"{name}: H2O with n-gram drafts left the oracle"
    changed = [name for name in NGRAM_BUDGETS if oracle_outputs[name] != oracle_outputs["full"]]
    assert len(changed) >= 3, f"eviction changed the tokens of {changed} only"


def test_ngram_h2o_after_prefix_cache_hits_equals_the_oracle(smollm2_rounds, oracle_outputs):
    """The same prompts again: admitted on prefix-cache hits, then decoded with drafts."""
    _, (outputs, _, accepted), _ = smollm2_rounds
    assert accepted > 0
    for name in NGRAM_BUDGETS:
        assert outputs[name] == oracle_outputs[name], f"{name}: after a prefix-cache hit"


def test_draft_model_h2o_equals_the_dense_oracle_with_drafts_accepted(draft_model_rounds, oracle_outputs):
    """SmolLM2 drafts for SmolLM2: the drafter's KV cache stays whole (a KV-cache group of
    vLLM's own), and the budget matrix, both rounds (the second on prefix-cache hits), equals
    the oracle token for token."""
    first, second, groups = draft_model_rounds
    assert sorted(groups) == ["FullAttentionManager", "H2OManager"], groups
    for outputs, drafts, accepted in (first, second):
        print(f"draft model with H2O: {accepted}/{drafts} draft tokens accepted")
        assert 0 < accepted < drafts, "no draft accepted (or none rejected): the test proves little"
        for name in BUDGETS:
            assert outputs[name] == oracle_outputs[name], f"{name}: H2O with a draft model left the oracle"


def _transferred_matrix(model_dir, prompts, store, speculative_config=NGRAM, budgets=BUDGETS):
    """Disaggregated prefill and decode through one engine in both KV-transfer roles
    (``kv_both``, as NIXL deployments run each side): the matrix prefilled for its first
    token (each compacted prompt saved), then continued from the saved states, as vLLM's P/D
    examples run a decoder. Prefix caching off, so that every continuation loads. Returns the
    continuation's matrix, the states loaded and the engine's KV-cache groups."""
    kv_transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    with vllm_engine(model_dir, in_process=True, block_size=BLOCK, speculative_config=speculative_config,
                     disable_log_stats=False, enable_prefix_caching=False, kv_transfer_config=kv_transfer,
                     additional_config={"h2o": {}}) as llm:
        produced, _, _ = _run_matrix(llm, prompts, budgets, max_tokens=1)
        continued = _run_matrix(llm, prompts, budgets, firsts=produced)
        scheduler = scheduler_of(llm)
        managers = [type(m).__name__ for m in scheduler.kv_cache_manager.coordinator.single_type_managers]
        return continued, scheduler.connector.transfer.num_loaded, managers


def test_ngram_h2o_decoding_transferred_prompts_equals_the_dense_oracle(smollm2_dir, prompts, oracle_outputs,
                                                                      tmp_path):
    """Speculation beside a KV connector: n-gram drafts need no KV of their own, so the H2O
    state the connector carries is all a decoder drafting with them needs. Every continuation
    loads its prompt's compacted state and equals the oracle over the budget matrix, with
    drafts accepted and rejected (vLLM's counters)."""
    (outputs, drafts, accepted), loaded, _ = in_fresh_process(_transferred_matrix, smollm2_dir, prompts, tmp_path,
                                                              NGRAM, NGRAM_BUDGETS)
    print(f"n-gram with H2O after a KV transfer: {accepted}/{drafts} draft tokens accepted")
    assert loaded == len(prompts) * len(NGRAM_BUDGETS)
    assert 0 < accepted < drafts, "no draft accepted (or none rejected): the test proves little"
    for name in NGRAM_BUDGETS:
        assert outputs[name] == oracle_outputs[name], f"{name}: decoding a transferred prompt with n-gram drafts"


SMALL_DRAFTER_BUDGETS = {name: BUDGETS[name] for name in ("tokens-16+16-interval8", "chunk-64-tokens-16+16-interval8")}


def _smollm2_small_drafter_round(model_dir, prompts, speculative_config):
    with vllm_engine(model_dir, in_process=True, block_size=BLOCK, speculative_config=speculative_config,
                     disable_log_stats=False, additional_config={"h2o": {}}) as llm:
        managers = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers
        return (_run_matrix(llm, prompts, SMALL_DRAFTER_BUDGETS, decode_compactions=True),
                [type(m).__name__ for m in managers])


def test_a_smaller_draft_model_splitting_the_target_into_several_h2o_groups_equals_the_oracle(
        smollm2_dir, smollm2_4_layers_dir, prompts, oracle_outputs):
    """SmolLM2's first four layers drafting for SmolLM2: vLLM groups layers in equal numbers, so
    the target's 30 layers become eight H2O KV-cache groups beside the drafter's whole one; every
    group runs the same plan, and the tokens are the oracle's."""
    draft = {"method": "draft_model", "model": str(smollm2_4_layers_dir), "num_speculative_tokens": DRAFTS}
    (outputs, drafts, _), groups = in_fresh_process(_smollm2_small_drafter_round, smollm2_dir, prompts, draft)
    assert groups.count("H2OManager") > 1 and "FullAttentionManager" in groups, groups
    assert drafts > 0
    for name in SMALL_DRAFTER_BUDGETS:
        assert outputs[name] == oracle_outputs[name], f"{name}: H2O beside a smaller draft model left the oracle"


def test_a_smaller_draft_model_decoding_transferred_prompts_equals_the_oracle(
        smollm2_dir, smollm2_4_layers_dir, prompts, oracle_outputs, tmp_path):
    """A drafter with layers of its own beside a KV connector, on a target vLLM splits into
    eight H2O KV-cache groups (SmolLM2 beside its first four layers): each group's kept state
    moves by its own blocks, the drafter's by the blocks that hold the prompt; every
    continuation loads, and the tokens are the oracle's (every layer counts here, unlike the
    tiny EAGLE-3 target's, so a group's state in another's blocks would show)."""
    draft = {"method": "draft_model", "model": str(smollm2_4_layers_dir), "num_speculative_tokens": DRAFTS}
    (outputs, drafts, _), loaded, groups = in_fresh_process(
        _transferred_matrix, smollm2_dir, prompts, tmp_path, draft, SMALL_DRAFTER_BUDGETS)
    assert groups.count("H2OManager") > 1 and "FullAttentionManager" in groups, groups
    assert loaded == len(prompts) * len(SMALL_DRAFTER_BUDGETS) and drafts > 0
    for name in SMALL_DRAFTER_BUDGETS:
        assert outputs[name] == oracle_outputs[name], f"{name}: decoding a transferred prompt beside a draft model"


# --------------------------------------------------------------------------- EAGLE, tiny models

EAGLE_BLOCK = 16
EAGLE_TOKENS = 40
EAGLE_BUDGETS = {
    "tokens-8+8-interval8": {"heavy_tokens": 8, "recent_tokens": 8, "interval": 8},
    "tokens-12+12-interval4": {"heavy_tokens": 12, "recent_tokens": 12, "interval": 4},
    "ratio-0.15+0.15-interval5": {"heavy_ratio": 0.15, "recent_ratio": 0.15, "interval": 5},
    "decay-window-sinks-tokens-8+8-interval6": {"heavy_tokens": 8, "recent_tokens": 8, "interval": 6,
                                                "decay": 0.9, "obs_window": 8, "sink_tokens": 2},
    "tokens-8+8-interval1": {"heavy_tokens": 8, "recent_tokens": 8, "interval": 1},
}


@pytest.fixture(scope="module")
def eagle_prompts():
    return [p * 3 for p in random_prompts([20, 30, 40, 25], seed=4)]  # 60-120 tokens, past every budget


#: The key scorers beside a model drafter, with room for drafts between compactions, one
#: drafter each (CI time: a drafter proposes tokens only, the target's scoring is the same):
#: Expected Attention beside EAGLE-3 (a Llama target), KeyDiff beside MTP (the MTP target, a
#: MiMo, has a model type whose RoPE Expected Attention does not read: refused).
EAGLE_SCORERS = {
    "eagle3": {"expected-pool-5-sinks-2-tokens-12+12-interval4": {
        "heavy_tokens": 12, "recent_tokens": 12, "interval": 4, "score": "expected", "pool_kernel": 5,
        "sink_tokens": 2}},
    "mtp": {"keydiff-pool-5-sinks-2-tokens-8+8-interval6": {
        "heavy_tokens": 8, "recent_tokens": 8, "interval": 6, "score": "keydiff", "pool_kernel": 5,
        "sink_tokens": 2}},
}


def _eagle_budgets(method: str) -> dict:
    return EAGLE_BUDGETS | EAGLE_SCORERS.get(method, {})


def _eagle_oracle(target, prompts, budgets=EAGLE_BUDGETS) -> dict[str, list[list[int]]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return oracle_matrix(model, budgets, EAGLE_BLOCK, prompts, EAGLE_TOKENS, full=prompts)


def _eagle_matrix(target, prompts, speculative_config, budgets=EAGLE_BUDGETS):
    """In a fresh process (see the module note): the budget matrix on one engine, and its
    KV-cache groups."""
    with vllm_engine(target, in_process=True, block_size=EAGLE_BLOCK, max_model_len=512,
                     speculative_config=speculative_config, disable_log_stats=False,
                     additional_config={"h2o": {}}) as llm:
        managers = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers
        return (_run_matrix(llm, prompts, budgets, EAGLE_BLOCK, EAGLE_TOKENS),
                sorted({type(m).__name__ for m in managers}))


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_model_drafters_h2o_equal_the_dense_oracle_with_drafts_accepted(mirrored_drafter, eagle_prompts, method):
    """An EAGLE-1 head, an EAGLE-3 head (it reads the target's hidden states, not the token's
    embedding, in its residual) and a model's own MTP layer (a tiny MiMo), each mirroring a
    one-layer target built for it (``h2o_devtools.models.drafters``), its layer's KV cache
    whole in a KV-cache group of its own, over the budget matrix (and a key scorer beside
    EAGLE-3 and MTP: ``EAGLE_SCORERS``): token for token the oracle's, with drafts accepted
    and rejected."""
    target, spec = mirrored_drafter(method, DRAFTS)
    budgets = _eagle_budgets(method)
    expected = _eagle_oracle(target, eagle_prompts, budgets)
    (outputs, drafts, accepted), groups = in_fresh_process(_eagle_matrix, target, eagle_prompts, spec, budgets)
    print(f"{method} with H2O: {accepted}/{drafts} draft tokens accepted")
    assert groups == ["FullAttentionManager", "H2OManager"], groups
    assert 0 < accepted < drafts, "no draft accepted (or none rejected): the test proves little"
    for name in budgets:
        assert outputs[name] == expected[name], f"{name}: H2O with {method} drafts left the oracle"
    changed = [name for name in budgets if expected[name] != expected["full"]]
    assert len(changed) >= 3, f"eviction changed the tokens of {changed} only"


REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


#: Three of the five EAGLE budgets (CI time): a token budget, the score modes, interval 1.
NIXL_BUDGETS = {name: EAGLE_BUDGETS[name] for name in
                ("tokens-8+8-interval8", "decay-window-sinks-tokens-8+8-interval6", "tokens-8+8-interval1")}


def _eagle_over_nixl(target, prompts, speculative_config):
    """KV transfer over NIXL, as vLLM's P/D proxy runs it: a producer engine (its own processes,
    its NIXL agent serving reads) prefills each request for remote decode; a decoder here gets
    the original prompt and the producer's ``kv_transfer_params``, reads the state and loads
    it; then again with each ticket spoiled, so every state read is refused by its seal and
    the decoder computes the prompt itself. Returns both runs and the loads and recomputes."""
    from vllm import SamplingParams
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"h2o_staging_mib": 16, "h2o_nixl_timeout_s": 150}}
    engine = dict(block_size=EAGLE_BLOCK, max_model_len=512, speculative_config=speculative_config,
                  disable_log_stats=False, enable_prefix_caching=False, kv_transfer_config=kv,
                  additional_config={"h2o": {}})
    with vllm_engine(target, **engine) as producer:
        params = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                 extra_args={**extra_args(b), "kv_transfer_params": dict(REMOTE_DECODE)})
                  for b in NIXL_BUDGETS.values() for _ in prompts]
        outs = producer.generate([{"prompt_token_ids": p} for _ in NIXL_BUDGETS for p in prompts], params,
                                 use_tqdm=False)
        named = {name: [outs[i * len(prompts) + j].kv_transfer_params for j in range(len(prompts))]
                 for i, name in enumerate(NIXL_BUDGETS)}
        spoiled = {name: [{**p, "h2o_nixl": {**p["h2o_nixl"], "ticket": p["h2o_nixl"]["ticket"] + 1000}}
                          for p in ps] for name, ps in named.items()}
        with vllm_engine(target, in_process=True, **engine) as consumer:
            runs = [_run_matrix(consumer, prompts, NIXL_BUDGETS, EAGLE_BLOCK, EAGLE_TOKENS, kv_params=p)
                    for p in (named, spoiled)]
            scheduler = scheduler_of(consumer)
            managers = [type(m).__name__ for m in scheduler.kv_cache_manager.coordinator.single_type_managers]
            return runs, scheduler.connector.transfer.num_loaded, scheduler.connector.transfer.num_recomputed, managers


def test_a_model_drafter_decoding_prompts_read_over_nixl_drafts_as_over_its_own_prefill(eagle_prompts, tmp_path):
    """P/D with EAGLE-3 over NIXL, the usual GPU deployment: the connector carries the
    target's H2O state and the drafter's own layers, whole, as the blocks that hold the prompt
    (packed after the H2O layers' state in the producer's staging run, sized from the KV-cache
    spec). The target has three layers beside the head's one, so vLLM splits it into three H2O
    KV-cache groups, as it splits a real target (``build_mirrored_eagle3_pair``'s dead layers;
    the SmolLM2 test above shows each group's state in its own blocks, where every layer
    counts). Every request loads and equals the oracle over three budgets. Outputs are exact
    whatever the drafter's cache holds, so acceptance is what shows its KV came over: a
    decoder that loads accepts exactly the drafts of one that computes the prompt itself (21;
    with the drafter's blocks not loaded, 13). vLLM counts the dummy drafts it pads
    a loaded request's first step with (``scheduler.scheduling.drop_padding``) as drafted, so the
    loading run drafts up to ``DRAFTS`` more per request, all rejected."""
    from h2o_devtools.models import drafters
    target, head = drafters.build_mirrored_eagle3_pair(tmp_path / "target", tmp_path / "head", dead_layers=2)
    spec = {"method": "eagle3", "num_speculative_tokens": DRAFTS, "model": str(head)}
    expected = _eagle_oracle(target, eagle_prompts)
    (loaded, computed), num_loaded, num_computed, managers = in_fresh_process(
        _eagle_over_nixl, target, eagle_prompts, spec)
    print(f"EAGLE-3 with H2O over NIXL: {loaded[2]}/{loaded[1]} draft tokens accepted; "
          f"over the prompt computed again: {computed[2]}/{computed[1]}")
    assert sorted(managers) == ["FullAttentionManager"] + ["H2OManager"] * 3, managers
    assert num_loaded == num_computed == len(eagle_prompts) * len(NIXL_BUDGETS)
    for outputs, _, _ in (loaded, computed):
        for name in NIXL_BUDGETS:
            assert outputs[name] == expected[name], f"{name}: decoding a prompt read over NIXL with EAGLE-3 drafts"
    assert 0 < loaded[2] < loaded[1]
    assert loaded[2] == computed[2], "the drafter's KV cache did not come over whole"
    assert 0 <= loaded[1] - computed[1] <= DRAFTS * num_loaded


# --------------------------------------------------------------------------- memory, tiny model

TINY_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 8}
TINY_NGRAM = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _tiny_ngram(model_dir, speculative_config=TINY_NGRAM, blocks_per_group=48, max_model_len=512, **engine):
    # A pool of `blocks_per_group` blocks per KV-cache group: a draft model's (or EAGLE head's,
    # or MTP) one layer beside the target's four makes five groups (four of them H2O's, on
    # either model runner), which share the pool.
    groups = 1 if speculative_config["method"] == "ngram" else 5
    return vllm_engine(model_dir, in_process=True, block_size=16, num_gpu_blocks_override=blocks_per_group * groups,
                       max_model_len=max_model_len, speculative_config=speculative_config,
                       additional_config={"h2o": TINY_H2O}, **engine)


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    """A one-layer tiny Llama with the tiny model's tokenizer: a draft model."""
    from h2o_devtools import models
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), num_layers=1)


#: The CUDA path (interpreted) with Model Runner V2 and async scheduling, vLLM's CUDA defaults:
#: each step scheduled while the previous step's drafts are unverified.
CUDA_ASYNC = {runner: {"async_scheduling": True, "env": {SWITCH: "1", V2_ENV: flag}}
              for runner, flag in (("v1", "0"), ("v2", "1"))}


@pytest.fixture(scope="module")
def tiny_speculator_of(tiny_draft_dir, tiny_llama_dir, tmp_path_factory):
    """(target, speculative config, engine settings) by name: the tiny Llama, or a four-layer
    tiny MiMo for its own MTP layer (four target layers and one drafter layer either way: five
    KV-cache groups)."""
    from h2o_devtools.models import drafters

    def make(name):
        if name == "ngram":
            return tiny_llama_dir, TINY_NGRAM, {}
        if name.startswith("mtp"):
            target = drafters.build_mtp_target(tmp_path_factory.mktemp("tiny-mimo"), num_layers=4)
            # "mtp-cuda-v1-async": the CUDA path with that runner, scheduling a step ahead.
            return (target, {"method": "mtp", "num_speculative_tokens": DRAFTS},
                    CUDA_ASYNC[name.split("-")[2]] if name.endswith("async") else {})
        if name == "eagle":
            head = drafters.build_eagle_head(tiny_llama_dir, tmp_path_factory.mktemp("tiny-eagle"))
            return tiny_llama_dir, {"method": "eagle", "model": str(head), "num_speculative_tokens": DRAFTS}, {}
        return (tiny_llama_dir, {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": DRAFTS},
                {})
    return make


#: (prompt lengths before the threefold repeat, tokens generated, H2O budget, blocks per
#: KV-cache group, max_model_len) that overflow the pool. "short" preempts within a few dozen
#: steps, for the interpreted CUDA path.
PREEMPTING = {
    "long": ([50] * 8, 100, {"h2o_heavy_tokens": 96, "h2o_recent_tokens": 96, "h2o_interval": 64}, 48, 512),
    "short": ([16] * 4, 40, {"h2o_heavy_tokens": 24, "h2o_recent_tokens": 24, "h2o_interval": 16}, 14, 128),
}


def _preempted_run(model_dir, speculative_config, engine, size="long", aborts_first=False):
    """In a fresh process: the admission headroom off (the process is this test's alone), so
    the pool overflows and vLLM preempts. ``aborts_first``: on the same engine, the abort run
    first (with H2O's admission), its result returned beside (one engine start, not two)."""
    lengths, max_tokens, budget, blocks, max_model_len = PREEMPTING[size]
    with _tiny_ngram(model_dir, speculative_config, blocks, max_model_len, **engine) as llm:
        aborted = _abort_two_of_four(llm, ABORTED[size]) if aborts_first else None
        from h2o_vllm.scheduler import scheduling  # once the plugin has loaded
        scheduling.admission_watermark = stock_admission
        scheduler = scheduler_of(llm)
        free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        # Each preemption, with the output placeholders its request held at the step before
        # (more than one: drafts in flight).
        preempted, placeholders, preemptions = [], {}, {}
        prompts = [p * 3 for p in random_prompts(lengths, seed=3)]  # repeats: the lookup drafts

        def on_step():
            check_block_lists(llm, TINY_H2O, 16, DRAFTS)
            for r in list(scheduler.running) + list(scheduler.waiting):
                if r.num_preemptions > preemptions.get(r.request_id, 0):
                    preempted.append(placeholders.get(r.request_id, 0))
                preemptions[r.request_id] = r.num_preemptions
            placeholders.update((r.request_id, r.num_output_placeholders) for r in scheduler.running)

        outputs = run_steps(llm, prompts, greedy(max_tokens, extra_args=budget), on_step=on_step)
        return (preempted, outputs, free_before, scheduler.kv_cache_manager.block_pool.get_num_free_blocks()), aborted


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle", "mtp"])
def preempted_and_aborted(request, tiny_speculator_of):
    """Per speculator, one engine in a fresh process: two of four requests aborted mid-run,
    then a pool that overflows and preempts."""
    return _preempted_in_fresh_process(tiny_speculator_of(request.param), "long", aborts_first=True)


def _preempted_in_fresh_process(speculator, size, aborts_first=False):
    """``_preempted_run`` in a fresh process started with the speculator's environment."""
    return in_fresh_process(_preempted_run, *speculator, size, aborts_first, env=speculator[2].get("env"))


def _check_preempted_run(preemption, size, drafts_in_flight=False):
    preempted, outputs, free_before, free_after = preemption
    lengths, max_tokens = PREEMPTING[size][:2]
    assert preempted, "the pool was large enough: no preemption happened"
    assert not drafts_in_flight or max(preempted) > 1, f"no preemption with drafts in flight: {preempted}"
    assert len(outputs) == len(lengths) and all(len(o) == max_tokens for o in outputs.values())
    assert free_after == free_before


def test_preempted_requests_with_drafts_complete_without_leaking(preempted_and_aborted):
    """vLLM's preemption (free everything, recompute later) under speculation: every request
    completes, block lists agree after every step, the pool drains."""
    _check_preempted_run(preempted_and_aborted[0], "long")


@pytest.fixture(scope="module")
def v2_in_flight(tiny_speculator_of):
    """Model Runner V2 with async scheduling on the CUDA path (vLLM's CUDA defaults, interpreted),
    one engine in a fresh process: two of four requests aborted with drafts in flight, then a
    pool that overflows and preempts."""
    return _preempted_in_fresh_process(tiny_speculator_of("mtp-cuda-v2-async"), "short", aborts_first=True)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_requests_preempted_with_drafts_in_flight_complete_without_leaking(tiny_speculator_of, runner, request):
    """The same under async scheduling, on the CUDA path: requests are preempted while their
    drafts are unverified (asserted), and the block lists still agree after every step."""
    runs = (request.getfixturevalue("v2_in_flight") if runner == "v2"
            else _preempted_in_fresh_process(tiny_speculator_of("mtp-cuda-v1-async"), "short"))
    _check_preempted_run(runs[0], "short", drafts_in_flight=True)


#: Prompt lengths before the threefold repeat of the abort run, on each size's engine.
ABORTED = {"long": [20, 30, 40, 25], "short": [10, 16, 12, 14]}


def _abort_two_of_four(llm, lengths=ABORTED["long"]):
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    prompts = [p * 3 for p in random_prompts(lengths, seed=4)]
    outputs = run_steps(llm, prompts, greedy(40), abort_after=(15, ["1", "3"]),
                        on_step=lambda: check_block_lists(llm, TINY_H2O, 16, DRAFTS))
    return outputs, free_before, pool.get_num_free_blocks()


def _check_aborted(outputs, free_before, free_after):
    assert sorted(outputs) == ["0", "2"]
    assert free_after == free_before


def test_aborted_requests_with_drafts_return_their_blocks(preempted_and_aborted):
    """Two of four requests aborted mid-run: the block lists agree after every step and the
    pool drains."""
    _check_aborted(*preempted_and_aborted[1])


def test_aborted_requests_with_drafts_in_flight_return_their_blocks(v2_in_flight):
    """The same under async scheduling on the CUDA path (Model Runner V2): drafts in flight."""
    _check_aborted(*v2_in_flight[1])
