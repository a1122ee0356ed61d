"""``KeyDiff`` (``score: keydiff``): the rule against a hand computation, zero keys, and the
worker's batched statement against the oracle's token-by-token one: scores and keep-sets."""
import math

import pytest
import torch

from h2o_vllm.oracle.cache import LayerCache
from h2o_vllm.policy import select_keep
from h2o_vllm.score_modes import KeyDiff, Pooling


def by_hand(keys: list[list[float]]) -> list[float]:
    """-cos(key, mean of the unit keys), in fp64 with the math module; a zero key scores 0."""
    units = []
    for k in keys:
        norm = math.sqrt(sum(x * x for x in k))
        units.append([x / norm for x in k] if norm else [0.0] * len(k))
    anchor = [sum(u[i] for u in units) / len(units) for i in range(len(keys[0]))]
    norm = math.sqrt(sum(a * a for a in anchor))
    return [-sum(x * a for x, a in zip(u, anchor)) / norm for u in units]


CASES = {
    "axes": [[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]],           # anchor (0, 1/3): scores 0, -1, 0
    "a-zero-key": [[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, 0.0]],
    "repeats": [[3.0, 4.0], [3.0, 4.0], [0.0, 1.0], [-1.0, 0.5]],
    "wide": [[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0], [-2.0, 0.1, 0.0, 3.0]],
}


@pytest.mark.parametrize("name", CASES)
def test_the_score_is_minus_the_cosine_to_the_mean_unit_key(name):
    keys = torch.tensor(CASES[name])
    want = torch.tensor(by_hand(CASES[name]), dtype=torch.float64)
    for got in (KeyDiff().scores(keys), KeyDiff().oracle_scores(keys[None])[0]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    if name == "axes":
        assert KeyDiff().scores(keys).tolist() == [0.0, -1.0, 0.0]


def test_a_zero_key_scores_zero_and_all_zero_keys_tie():
    keys = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    assert KeyDiff().scores(keys).tolist() == [-1.0, 0.0, -1.0]  # the distinct (no) direction is kept
    zeros = torch.zeros(2, 5, 4)
    assert KeyDiff().scores(zeros).eq(0).all() and KeyDiff().oracle_scores(zeros).eq(0).all()


def test_the_score_ignores_each_keys_length():
    keys = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(0))
    scaled = keys * torch.tensor([0.5, 2.0, 8.0, 1.0, 4.0, 0.25, 1.0, 2.0, 16.0, 1.0])[None, :, None]
    torch.testing.assert_close(KeyDiff().scores(scaled), KeyDiff().scores(keys), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n, sinks, heavy, recent, pool", [(40, 0, 6, 6, 1), (23, 2, 5, 4, 5), (9, 1, 3, 3, 1)])
def test_the_workers_scores_and_keep_sets_are_the_oracles(seed, n, sinks, heavy, recent, pool):
    """Batched (the worker's, ``worker.key_scores``: rows padded past their live keys) and
    token by token (the oracle's): scores within 1e-6 (fp32, two summation orders), and the
    same kept tokens per head."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size, width = 2, 16, 48
    keys = torch.randn(num_kv_heads, n, head_size, generator=gen) * torch.rand(num_kv_heads, n, 1, generator=gen) * 4
    padded = torch.cat([keys, torch.randn(num_kv_heads, width - n, head_size, generator=gen)], dim=1)
    live = (torch.arange(width) < n)[None, None]  # [R, 1, width], as the due pass gives it
    worker = KeyDiff().scores(padded[None], live=live)[0, :, :n]  # [R, Hkv, width] -> the live slots
    torch.testing.assert_close(worker, KeyDiff().scores(keys[None])[0], rtol=0, atol=1e-6)
    oracle = KeyDiff().oracle_scores(keys)
    torch.testing.assert_close(worker, oracle, rtol=0, atol=1e-6)
    rank = (Pooling(pool),) if pool > 1 else ()
    keep = select_keep(worker, heavy, recent, sinks, rank)
    cache = LayerCache(num_kv_heads, head_size)
    cache.append(keys, torch.zeros_like(keys), torch.arange(n))
    cache.compact(heavy, recent, sinks, rank, KeyDiff())
    assert torch.equal(cache.positions, keep)
    assert torch.equal(cache.keys, keys.gather(1, keep[..., None].expand(-1, -1, head_size)))
