"""Tensor parallel on the CPU: TP=2 (one core per rank), tiny Llama with 4 query / 2 KV heads,
so each rank holds one KV head and evicts it by itself.

What is TP-sensitive in h2o-vllm, and why it holds: the step plan (``worker.plan``) depends only
on the batch (computed/prompt/query lengths, budgets), never on heads, so every rank computes
the same KV-space lengths and compacts at the same steps; each rank's ``H2OAttentionSpec``
carries its own ``num_kv_heads`` (2 / TP) while the block counts are per token, so the single
scheduler's ``H2OManager`` count is right for every rank; scores and compaction are per KV
head (tests/unit/worker/test_tp_split.py: a head split gives the same keep-sets as the whole).
"""
import pytest

from budgets import MODES, extra_args, oracle
from engines import random_prompts, scheduler_of, vllm_engine

BLOCK = 16
BUDGETS = [{"heavy_ratio": 0.1, "recent_ratio": 0.1},  # with the default floor
           {"heavy_tokens": 8, "recent_tokens": 8, "interval": 1},
           {"heavy_ratio": 0.0, "recent_ratio": 0.2, "interval": 1, "min_tokens": 0},
           # Evicting between prompt chunks: every rank cuts the same chunks.
           {"heavy_tokens": 8, "recent_tokens": 8, "interval": 1, "prefill_chunk": 16},
           # The key scorers: each rank scores its own KV head from its keys (KeyDiff) or from
           # its own query heads' last queries (Expected Attention).
           MODES["keydiff-pool-5-sinks-2-tokens-8+8-interval1"],
           MODES["expected-pool-5-sinks-2-tokens-8+8-interval1"]]
PROMPTS = random_prompts([1, 17, 64, 150], seed=21)
MAX_TOKENS = 40


def _rank_blocks(worker):
    """On each rank: {request id: blocks held}, and the rank's KV heads."""
    runner = worker.model_runner
    heads = {tuple(t.shape)[1] for t in runner.kv_caches} if runner.kv_caches else set()
    return {rid: len(state.block_ids[0]) for rid, state in runner.requests.items()}, sorted(heads)


@pytest.fixture(scope="module")
def tp2(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
        with vllm_engine(tiny_llama_dir, in_process=True, tensor_parallel_size=2, block_size=BLOCK,
                         additional_config={"h2o": {}}) as llm:
            yield llm


def _params(budget):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          extra_args=extra_args(budget))


def test_tp2_ranks_evict_their_own_heads_with_identical_counts_and_match_the_oracle(tp2, hf_model_tp):
    engine, scheduler = tp2.llm_engine, scheduler_of(tp2)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    requests = [(f"{b}-{p}", prompt, budget) for b, budget in enumerate(BUDGETS)
                for p, prompt in enumerate(PROMPTS)]
    for rid, prompt, budget in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, _params(budget))
    outputs, compared = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        (blocks0, heads0), (blocks1, heads1) = tp2.collective_rpc(_rank_blocks)
        assert heads0 == heads1 == [1], "each rank holds one of the two KV heads"
        assert blocks0 == blocks1, "the ranks hold different block counts"
        for request in scheduler.running:  # cut when this step was scheduled
            if request.request_id in blocks0:
                assert len(manager.req_to_blocks[request.request_id]) == blocks0[request.request_id]
                compared += 1
    assert compared and len(outputs) == len(requests)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    for b, budget in enumerate(BUDGETS):
        expected = oracle(hf_model_tp, budget, BLOCK).generate(PROMPTS, MAX_TOKENS)
        got = [outputs[f"{b}-{p}"] for p in range(len(PROMPTS))]
        assert got == expected, f"TP=2 diverges from the oracle (= TP=1, test_exactness) for {budget}"


def test_tp2_matches_tp1_token_for_token(tp2, tiny_llama_dir):
    """The same requests on a TP=1 engine (started after the TP=2 one is checked)."""
    params = [_params(budget) for budget in BUDGETS for _ in PROMPTS]
    prompts = [{"prompt_token_ids": p} for _ in BUDGETS for p in PROMPTS]
    tp2_out = [list(o.outputs[0].token_ids) for o in tp2.generate(prompts, params, use_tqdm=False)]
    with vllm_engine(tiny_llama_dir, in_process=True, block_size=BLOCK, additional_config={"h2o": {}}) as tp1:
        tp1_out = [list(o.outputs[0].token_ids) for o in tp1.generate(prompts, params, use_tqdm=False)]
    assert tp2_out == tp1_out


@pytest.fixture(scope="module")
def hf_model_tp(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_tp2_kv_transfer_pair_saves_a_file_per_rank_and_matches_the_oracle(tiny_llama_dir, hf_model_tp,
                                                                           tmp_path):
    """A TP=2 producer and a TP=2 consumer (docs/kv-transfer.md): each rank saves and loads its
    own KV head's kept state, and the pair equals the oracle."""
    from h2o_vllm.kv_transfer.store import KVStore, state_key
    from h2o_vllm.config import H2OConfig
    budget = BUDGETS[1]
    kv = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    first_params, rest_params = _params(budget), _params(budget)
    first_params.max_tokens, rest_params.max_tokens = 1, MAX_TOKENS - 1
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        common = dict(in_process=True, tensor_parallel_size=2, block_size=BLOCK, additional_config={"h2o": {}})
        with vllm_engine(tiny_llama_dir, kv_transfer_config={**kv, "kv_role": "kv_producer"}, **common) as llm:
            firsts = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, first_params, use_tqdm=False)]
        store = KVStore(tmp_path)
        for prompt in PROMPTS:
            key = state_key(prompt, H2OConfig.from_dict(budget).budget(len(prompt), BLOCK), BLOCK)
            assert store.committed(key).world_size == 2 and store.flaw(key, store.committed(key)) is None
        continued = [{"prompt_token_ids": p + f} for p, f in zip(PROMPTS, firsts)]
        with vllm_engine(tiny_llama_dir, kv_transfer_config={**kv, "kv_role": "kv_consumer"}, **common) as llm:
            rest = [list(o.outputs[0].token_ids) for o in llm.generate(continued, rest_params, use_tqdm=False)]
            assert scheduler_of(llm).connector.transfer.num_loaded == len(PROMPTS)
    got = [f + r for f, r in zip(firsts, rest)]
    assert got == oracle(hf_model_tp, budget, BLOCK).generate(PROMPTS, MAX_TOKENS)


def test_tp2_nixl_pair_reads_each_ranks_share_and_matches_the_oracle(tiny_llama_dir, hf_model_tp):
    """A TP=2 producer and a TP=2 consumer on vLLM's NixlConnector settings, both up at once:
    each consumer rank reads its KV head's kept state from the producer rank of its index
    (two peers in the params, one packed run each), and the pair equals the oracle."""
    from h2o_vllm.kv_transfer.transfer_config import nixl_missing
    if nixl_missing() is not None:
        pytest.skip(f"nixl does not import here ({nixl_missing()}): pip install 'h2o-vllm[nixl]'")
    from vllm import SamplingParams

    def kv():
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"h2o_staging_mib": 1}}
    budget = BUDGETS[1]
    remote = {"do_remote_decode": True, "do_remote_prefill": False}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        common = dict(in_process=True, tensor_parallel_size=2, block_size=BLOCK, additional_config={"h2o": {}})
        with vllm_engine(tiny_llama_dir, kv_transfer_config=kv(), **common) as producer:
            first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                   extra_args={**extra_args(budget), "kv_transfer_params": remote})
            params = [o.kv_transfer_params for o in producer.generate(prompts, first, use_tqdm=False)]
            assert all(len(p["h2o_nixl"]["peers"]) == 2 for p in params)
            with vllm_engine(tiny_llama_dir, kv_transfer_config=kv(), **common) as consumer:
                decode = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                         extra_args={**extra_args(budget), "kv_transfer_params": p}) for p in params]
                got = [list(o.outputs[0].token_ids) for o in consumer.generate(prompts, decode, use_tqdm=False)]
                assert scheduler_of(consumer).connector.transfer.num_loaded == len(PROMPTS)
    assert got == oracle(hf_model_tp, budget, BLOCK).generate(PROMPTS, MAX_TOKENS)
