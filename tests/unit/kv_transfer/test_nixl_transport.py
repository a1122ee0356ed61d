"""kv_transfer.nixl_transport.NixlTransport: two real NIXL agents (UCX) in this process, a producer
rank staging a state and a consumer rank reading it; seals, notifications, failures."""
import base64
import time

import pytest
import torch

from h2o_vllm.kv_transfer.transfer_config import nixl_missing
from h2o_vllm.kv_transfer.packed_state import packed_nbytes
from h2o_vllm.kv_transfer.orders import KVFetch, KVMove, NixlPeer

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=f"nixl does not import here ({nixl_missing()})")

NAMES, KV_LEN, HEADS, HEAD_SIZE = ("a", "b"), 7, 2, 8


@pytest.fixture(scope="module")
def pair():
    from h2o_vllm.kv_transfer.nixl_transport import NixlTransport
    producer, consumer = NixlTransport("unit-p", 1 << 16, rank=0), NixlTransport("unit-c", 1 << 16, rank=0, timeout_s=5)
    yield producer, consumer
    producer.close()
    consumer.close()


#: A drafter's whole layer: (name, group, a block's shape, dtype), and its blocks' ids.
WHOLE, WHOLE_IDS = ("d", 0, (HEADS, 4, 2 * HEAD_SIZE), torch.float16), ((3, 1),)


def _layout():
    from h2o_vllm.kv_transfer.nixl_transport import StateLayout
    return StateLayout(NAMES, HEADS, HEAD_SIZE, torch.float16, (WHOLE,))


def _state(seed):
    gen = torch.Generator().manual_seed(seed)
    return [{"k": torch.randn(KV_LEN, HEADS, HEAD_SIZE, generator=gen).half(),
             "v": torch.randn(KV_LEN, HEADS, HEAD_SIZE, generator=gen).half(),
             "scores": torch.rand(KV_LEN, HEADS, generator=gen)} for _ in NAMES]


def _until_fetched(consumer, producer, req_id):
    reads = []
    for _ in range(2000):
        report = consumer.poll()
        reads += producer.poll().read
        if req_id in report.fetched:
            for _ in range(200):
                reads += producer.poll().read
                if reads:
                    break
                time.sleep(0.005)
            return report.fetched[req_id][0], reads
        time.sleep(0.005)
    raise AssertionError("no news of the read")


def test_a_staged_state_is_read_whole_and_the_producer_hears_of_it(pair):
    """The H2O layers' state and a drafter's whole blocks, in one run."""
    producer, consumer = pair
    blocks = torch.randn(len(WHOLE_IDS[0]), *WHOLE[2]).half()
    nbytes = packed_nbytes(len(NAMES), KV_LEN, HEADS, HEAD_SIZE, 2) + blocks.numel() * 2
    state = _state(0)
    producer.stage(KVMove("p", "key", (), KV_LEN, WHOLE_IDS, ticket=4, offset=96, nbytes=nbytes), state, [blocks])
    consumer.fetch(KVFetch("c", "key", 4, 96, nbytes, (producer.peer,)))
    error, reads = _until_fetched(consumer, producer, "c")
    assert error is None and reads == [(4, 0)]
    got = consumer.take(KVMove("c", "key", (), KV_LEN, ((6, 0),)), _layout())
    for name, layer in zip(NAMES, state):
        for part, t in layer.items():
            assert torch.equal(got[f"{name}.{part}"], t)
    assert torch.equal(got["d.blocks"], blocks)
    assert not consumer.fetched and not consumer.reads


def test_bytes_of_another_ticket_or_an_unreachable_producer_fail_with_the_reason(pair):
    producer, consumer = pair
    nbytes = packed_nbytes(len(NAMES), KV_LEN, HEADS, HEAD_SIZE, 2)
    producer.stage(KVMove("p", "key", (), KV_LEN, ticket=5, offset=0, nbytes=nbytes), _state(1))
    consumer.fetch(KVFetch("c", "key", 6, 0, nbytes, (producer.peer,)))
    error, _ = _until_fetched(consumer, producer, "c")
    assert "not the state named" in error and "c" not in consumer.fetched
    gone = NixlPeer("unit-gone", base64.b64encode(b"no agent").decode(), 4096)
    consumer.fetch(KVFetch("d", "key", 5, 0, nbytes, (gone,)))
    error = consumer.poll().fetched["d"][0]
    assert "could not read from unit-gone" in error


def test_a_forgotten_read_reports_nothing_and_keeps_nothing(pair):
    producer, consumer = pair
    nbytes = packed_nbytes(len(NAMES), KV_LEN, HEADS, HEAD_SIZE, 2)
    producer.stage(KVMove("p", "key", (), KV_LEN, ticket=7, offset=0, nbytes=nbytes), _state(2))
    consumer.fetch(KVFetch("e", "key", 7, 0, nbytes, (producer.peer,)))
    consumer.forget("e")
    for _ in range(400):
        assert "e" not in consumer.poll().fetched
        if not consumer.reads:
            break
        time.sleep(0.005)
    assert not consumer.reads and "e" not in consumer.fetched
