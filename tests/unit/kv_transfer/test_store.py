"""h2o_vllm.kv_transfer.store: a prompt's state on shared storage (pure)."""
import torch

from h2o_vllm.config import Budget
from h2o_vllm.kv_transfer.store import KVStore, StoredPrompt, state_key
from h2o_vllm.score_modes import Decay

BUDGET = Budget(heavy=8, recent=8, interval=16)


def test_the_key_names_tokens_budget_and_block_size():
    key = state_key([1, 2, 3], BUDGET, 16)
    assert key == state_key([1, 2, 3], BUDGET, 16)
    others = {state_key([1, 2, 4], BUDGET, 16), state_key([1, 2, 3], BUDGET, 32),
              state_key([1, 2, 3], Budget(heavy=8, recent=8, interval=1), 16),
              state_key([1, 2, 3], Budget(heavy=8, recent=8, interval=16, scoring=(Decay(0.9),)), 16)}
    assert key not in others and len(others) == 4


def test_a_state_is_loadable_only_once_committed_and_whole(tmp_path):
    store = KVStore(tmp_path)
    key = state_key([5] * 40, BUDGET, 16)
    prompt = StoredPrompt(prompt_len=40, first_token=7, kv_len=16, world_size=2)
    tensors = {"layer.k": torch.randn(16, 2, 8), "layer.scores": torch.rand(16, 2)}
    written = store.write_rank(key, 0, tensors)
    assert written == store.rank_path(key, 0).stat().st_size
    assert store.committed(key) is None  # written, not committed
    store.commit(key, prompt)
    assert store.committed(key) == prompt
    assert "rank1.safetensors is missing" in store.flaw(key, prompt)
    store.write_rank(key, 1, tensors)
    assert store.flaw(key, prompt) is None
    assert all(torch.equal(store.read_rank(key, 1)[n], t) for n, t in tensors.items())
    assert store.nbytes(key) == sum(p.stat().st_size for p in store.folder(key).iterdir())
    path = store.rank_path(key, 1)
    path.write_bytes(path.read_bytes()[:-1])
    assert "where its header promises" in store.flaw(key, prompt)
    path.write_bytes(b"\x00" * 4)
    assert store.flaw(key, prompt) is not None
    assert not list(store.folder(key).glob("*.partial"))
