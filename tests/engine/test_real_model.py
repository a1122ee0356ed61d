"""H2O inside vLLM equals the dense oracle on real trained models, token for token: SmolLM2-135M-Instruct
(fp32, GQA 9/3 heads, 30 layers) and Gemma 3 270M (a hybrid of sliding-window and global layers) on
real English text (the GPL-3)."""
import pytest
import torch

from budgets import extra_args, oracle_matrix
from engines import generate_ids, greedy, vllm_engine

BLOCK = 32
MAX_TOKENS = 32
BUDGETS = {
    "ratio-0.1+0.1-interval1": {"heavy_ratio": 0.1, "recent_ratio": 0.1, "interval": 1, "min_tokens": 0},
    "ratio-0.1+0.1-block": {"heavy_ratio": 0.1, "recent_ratio": 0.1},  # with the default floor
}


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer
    with open("/usr/share/common-licenses/GPL-3") as f:
        ids = AutoTokenizer.from_pretrained(smollm2_dir)(" ".join(f.read().split())).input_ids
    return [ids[i * 500:i * 500 + n] for i, n in enumerate((40, 120, 250, 400))]


@pytest.fixture(scope="module")
def oracle_outputs(smollm2_dir, prompts):
    """{budget name or "full": outputs}, computed before any engine runs in this process
    (the oracle is several times slower once an engine has shared the process)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return oracle_matrix(model, BUDGETS, BLOCK, prompts, MAX_TOKENS, full=prompts)


@pytest.fixture(scope="module")
def vllm_outputs(smollm2_dir, prompts, oracle_outputs):
    params = [greedy(MAX_TOKENS, extra_args=extra_args(b)) for b in BUDGETS.values() for _ in prompts]
    with vllm_engine(smollm2_dir, block_size=BLOCK, additional_config={"h2o": {}}) as llm:
        outputs = generate_ids(llm, prompts * len(BUDGETS), params)
    return {name: outputs[i * len(prompts):(i + 1) * len(prompts)] for i, name in enumerate(BUDGETS)}


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_smollm2_h2o_matches_dense_oracle(oracle_outputs, vllm_outputs, budget):
    assert vllm_outputs[budget] == oracle_outputs[budget]
    assert oracle_outputs[budget] != oracle_outputs["full"], "eviction changed nothing: the comparison proves little"


# --- Gemma 3 270M: a hybrid real model (15 sliding-window layers, window 512, and 3 global ones,
# which H2O evicts from). Prompts of ~2x the window, so the global layers hold what the sliding
# ones have dropped; the second run repeats them with the other score mode, so each is admitted
# on a prefix hit that vLLM's sliding-window group and H2O's global group must both resume from.
GEMMA3_BLOCK = 32  # vLLM's CPU backend gives the sliding layers 32-token blocks, and every group the same
GEMMA3_MAX_TOKENS = 24
GEMMA3_RUNS = {
    "paper": {"heavy_ratio": 0.1, "recent_ratio": 0.1},
    "recommended": {"heavy_ratio": 0.1, "recent_ratio": 0.1, "obs_window": 32, "pool_kernel": 15},
}


@pytest.fixture(scope="module")
def gemma3_prompts(gemma3_dir):
    """<bos> + GPL-3 text: a prompt past twice the window, one inside it, and one that shares
    the first's 1,024 first tokens."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    with open("/usr/share/common-licenses/GPL-3") as f:
        ids = tokenizer(" ".join(f.read().split())).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    body = ids[1:]
    long, short = body[:1150], body[2000:2400]
    return [[ids[0]] + p for p in (long, short, long[:1024] + body[5000:5100])]


@pytest.fixture(scope="module")
def gemma3_oracle(gemma3_dir, gemma3_prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    # The control, on the longest prompt only (the oracle's time is most of this module's).
    return oracle_matrix(model, GEMMA3_RUNS, GEMMA3_BLOCK, gemma3_prompts, GEMMA3_MAX_TOKENS,
                         full=gemma3_prompts[:1])


@pytest.fixture(scope="module")
def gemma3_engine_run(gemma3_dir, gemma3_prompts, gemma3_oracle):
    """{run: outputs}, {run: prefix-hit tokens per prompt}, and the pool's free blocks before
    and after; the block lists are checked after every step."""
    from engines import check_block_lists, run_steps, scheduler_of
    outputs, hits, evicted = {}, {}, []
    with vllm_engine(gemma3_dir, in_process=True, block_size=GEMMA3_BLOCK, max_model_len=2048,
                     additional_config={"h2o": {}}) as llm:
        pool = scheduler_of(llm).kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        for name, budget in GEMMA3_RUNS.items():
            cached = {}
            by_id = run_steps(llm, gemma3_prompts, greedy(GEMMA3_MAX_TOKENS, extra_args=extra_args(budget)),
                              cached=cached,
                              on_step=lambda: evicted.extend(check_block_lists(llm, {}, GEMMA3_BLOCK)))
            outputs[name] = [by_id[str(i)] for i in range(len(gemma3_prompts))]
            hits[name] = [cached[str(i)] for i in range(len(gemma3_prompts))]
        free_after = pool.get_num_free_blocks()
    assert max(evicted) > 0, "no request ever evicted: the block check proved nothing"
    return outputs, hits, (free_before, free_after)


@pytest.mark.parametrize("run", list(GEMMA3_RUNS))
def test_gemma3_h2o_matches_dense_oracle(gemma3_oracle, gemma3_engine_run, run):
    outputs, _, _ = gemma3_engine_run
    assert outputs[run] == gemma3_oracle[run]
    assert gemma3_oracle[run][0] != gemma3_oracle["full"][0], "eviction changed nothing: the comparison proves little"


def test_gemma3_prefix_hits_resume_both_groups_and_the_pool_drains(gemma3_prompts, gemma3_engine_run):
    _, hits, (free_before, free_after) = gemma3_engine_run
    # The second run's prompts were all computed by the first: with an observation window H2O
    # resumes up to the window's first query (blocks before prompt_len - 32); the hybrid search
    # is redone at that cut, so the sliding-window groups resume there too. (They can only where
    # vLLM kept the 16 blocks before the cut: it keeps a prompt's last window, so a cut a block
    # further back can lose the hit; docs/limits.md, "Not done yet".)
    window = GEMMA3_RUNS["recommended"]["obs_window"]
    want = [(len(p) - window) // GEMMA3_BLOCK * GEMMA3_BLOCK for p in gemma3_prompts]
    assert hits["recommended"] == want
    assert free_after == free_before, "blocks leaked"
