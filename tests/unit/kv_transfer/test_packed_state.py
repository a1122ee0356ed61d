"""packed_state: one rank's state as one run of bytes between two seals, and back."""
import pytest
import torch

from h2o_vllm.kv_transfer.packed_state import SEAL, pack, packed_nbytes, unpack

KV_LEN, HEADS, HEAD_SIZE = 5, 2, 4
NAMES = ("layers.0.attn", "layers.1.attn")


def _layers(dtype):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in NAMES:
        k = torch.randn(KV_LEN, HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(KV_LEN, HEADS, HEAD_SIZE, generator=gen)
        k, v = k.to(dtype), v.to(dtype)
        out.append({"k": k, "v": v, "scores": torch.rand(KV_LEN, HEADS, generator=gen)})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_is_bit_exact_and_sized_as_the_scheduler_reserves(dtype):
    layers = _layers(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = packed_nbytes(len(NAMES), KV_LEN, HEADS, HEAD_SIZE, itemsize)
    buf = torch.zeros(n + 100, dtype=torch.uint8)
    assert pack(buf[10:10 + n], "key", 3, layers) == n
    state = unpack(buf[10:10 + n], "key", 3, NAMES, KV_LEN, HEADS, HEAD_SIZE, dtype)
    for name, layer in zip(NAMES, layers):
        for part, t in layer.items():
            got = state[name][part]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_another_ticket_or_key_or_a_cut_run_is_refused():
    layers = _layers(torch.float32)
    n = packed_nbytes(len(NAMES), KV_LEN, HEADS, HEAD_SIZE, 4)
    buf = torch.zeros(n, dtype=torch.uint8)
    pack(buf, "key", 3, layers)
    for key, ticket, run in (("key", 4, buf), ("other", 3, buf), ("key", 3, buf[:-1])):
        with pytest.raises(ValueError, match="not state"):
            unpack(run, key, ticket, NAMES, KV_LEN, HEADS, HEAD_SIZE, torch.float32)
    # Written over at its end only (a later state's run starting inside it): refused too.
    buf[-SEAL:] = 0
    with pytest.raises(ValueError):
        unpack(buf, "key", 3, NAMES, KV_LEN, HEADS, HEAD_SIZE, torch.float32)
