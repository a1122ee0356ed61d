"""benchmarks/drafter_eviction.py's replay of greedy speculation on the oracle: a drafter that
is the target (same model, same budget) is accepted on every draft; a scripted drafter's
drafts are counted against the target's tokens, verification by verification; the
layer-skipping drafter keeps the layers it names."""
import pytest
import torch

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import H2OOracle

BUDGET = H2OConfig.from_dict({"heavy_tokens": 4, "recent_tokens": 4, "interval": 4})


@pytest.fixture(scope="module")
def replay(load_benchmark):
    return load_benchmark("drafter_eviction").replay


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


PROMPT = list(range(20, 60))


def test_the_target_drafting_for_itself_is_always_accepted(replay, model):
    target = H2OOracle(model, BUDGET).generate([PROMPT], 20)[0]
    drafts, accepted = replay(H2OOracle(model, BUDGET), PROMPT, target, 3)
    assert drafts == accepted and 0 < drafts <= 3 * 19


class _Counting:
    """A drafter whose next token is always the last token + 1 (one-hot logits)."""

    def new_state(self, prompt_len):
        return []

    def prefill(self, state, prompt):
        return self.step(state, prompt)

    def step(self, state, token_ids):
        state.extend(token_ids)
        return torch.nn.functional.one_hot(torch.tensor(state[-1] + 1), 64).float()


def test_each_verification_accepts_the_matching_prefix_then_the_targets_token(replay):
    # 5 from the prompt; drafts [6, 7, 8] meet [6, 7, 9]: 2 accepted, 9 the target's; drafts
    # [10, 11, 12] all accepted, 20 the target's.
    assert replay(_Counting(), [1, 2, 3, 4], [5, 6, 7, 9, 10, 11, 12, 20], 3) == (6, 5)
    # The last verification drafts only as many tokens as remain.
    assert replay(_Counting(), [1], [2, 3, 4, 5, 6, 7], 3) == (4, 4)


def test_a_layer_skipping_drafter_keeps_the_layers_named_renumbered(load_benchmark, model):
    bench = load_benchmark("drafter_eviction")
    assert bench.parse_layers("0-1,3") == [0, 1, 3]
    subset = bench.layer_subset(model, [0, 3])
    assert subset.config.num_hidden_layers == 2 and model.config.num_hidden_layers == 4
    assert [layer.self_attn.layer_idx for layer in subset.model.layers] == [0, 1]
    assert subset.model.layers[1].mlp.up_proj.weight.data_ptr() != model.model.layers[3].mlp.up_proj.weight.data_ptr()
    torch.testing.assert_close(subset.model.layers[1].mlp.up_proj.weight, model.model.layers[3].mlp.up_proj.weight)
    H2OOracle(subset, BUDGET).generate([PROMPT], 4)  # runs, its own two-layer cache
