"""h2o_vllm.kv_transfer.save_load: a prompt's live KV positions out of one paged cache and into
another, in both devices' layouts (CPU vec pages, Triton's; fp8 bytes), with their scores."""
import pytest
import torch

from h2o_vllm.kv_transfer.store import KVStore
from h2o_vllm.kv_transfer.orders import KVMove, TransferOrders
from h2o_vllm.kv_transfer import save_load
from h2o_vllm.worker.cpu.layout import cache_views
from h2o_vllm.worker.cuda.ops import TritonOps

NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE = 8, 4, 2, 8


class Layer:
    """An H2O layer as transfer sees it: the device's views and a score buffer."""

    def __init__(self, views_of, dtype=torch.float32):
        self.views_of = views_of
        self.kv_cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=dtype)
        self.scores = torch.zeros(NUM_BLOCKS, HEADS, BLOCK)

    def cache_state(self, kv_cache):
        return self.views_of(kv_cache), self.scores


LAYOUTS = {
    "cpu": (cache_views, torch.float32),
    "triton": (TritonOps(HEAD_SIZE).cache_views, torch.float32),
    "triton-fp8": (TritonOps(HEAD_SIZE, torch.float8_e4m3fn).cache_views, torch.uint8),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saved_positions_load_into_other_blocks_unchanged(tmp_path, layout):
    views_of, dtype = LAYOUTS[layout]
    producer, consumer = Layer(views_of, dtype), Layer(views_of, dtype)
    views = views_of(producer.kv_cache)
    if dtype == torch.uint8:
        producer.kv_cache.copy_(torch.randint(0, 120, producer.kv_cache.shape, dtype=torch.uint8))
    else:
        producer.kv_cache.normal_()
    producer.scores.uniform_()
    store = KVStore(tmp_path)
    kv_len = 10  # three blocks, the last one part full
    save = KVMove("r", "key", ((5, 2, 7),), kv_len)
    written = save_load.save(TransferOrders(saves=[save]), [("l0", producer, producer.kv_cache, 0)],
                             lambda move, tensors: store.write_rank(move.key, 0, tensors))
    assert written == store.rank_path("key", 0).stat().st_size
    stored = store.read_rank("key", 0)
    assert stored["l0.k"].shape == (kv_len, HEADS, HEAD_SIZE) and stored["l0.scores"].shape == (kv_len, HEADS)
    load = KVMove("r", "key", ((1, 6, 3),), kv_len)
    save_load.load(TransferOrders(loads=[load]), [("l0", consumer, consumer.kv_cache, 0)],
                   lambda move: store.read_rank(move.key, 0))
    got = views_of(consumer.kv_cache)
    for pos in range(kv_len):
        src, dst = (save.block_ids[0][pos // BLOCK], pos % BLOCK), (load.block_ids[0][pos // BLOCK], pos % BLOCK)
        for part in ("keys", "values"):
            assert torch.equal(_bits(getattr(got, part)[dst]), _bits(getattr(views, part)[src]))
        assert torch.equal(consumer.scores[dst[0], :, dst[1]], producer.scores[src[0], :, src[1]])
    # Nothing past the live positions was written: block 3's last two slots, other blocks.
    untouched = torch.ones(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    for pos in range(kv_len):
        untouched[load.block_ids[0][pos // BLOCK], pos % BLOCK] = False
    assert not consumer.scores.transpose(1, 2)[untouched].any()
    assert not _bits(got.keys[untouched]).any()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 compared as its bytes (torch has no fp8 equality)."""
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_drafters_whole_layer_travels_as_the_blocks_that_hold_the_prompt(tmp_path, dtype):
    """A speculative drafter's layer (vLLM's attention, its cache whole): the prompt's blocks
    by id in vLLM's block-major view, beside the H2O layer's live positions, in one file."""
    producer, consumer = Layer(cache_views), Layer(cache_views)
    producer.kv_cache.normal_()
    drafter = torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE).to(dtype)
    loaded = torch.zeros_like(drafter)
    store = KVStore(tmp_path)
    save = KVMove("r", "key", ((5, 2),), 6, whole=((4, 0, 6),))
    save_load.save(TransferOrders(saves=[save]), [("l0", producer, producer.kv_cache, 0)],
                  lambda move, tensors: store.write_rank(move.key, 0, tensors), [("d0", 0, drafter)])
    assert store.read_rank("key", 0)["d0.blocks"].shape == (3, HEADS, BLOCK, 2 * HEAD_SIZE)
    load = KVMove("r", "key", ((1, 3),), 6, whole=((7, 2, 1),))
    save_load.load(TransferOrders(loads=[load]), [("l0", consumer, consumer.kv_cache, 0)],
                  lambda move: store.read_rank(move.key, 0), [("d0", 0, loaded)])
    for src, dst in zip(save.whole[0], load.whole[0]):
        assert torch.equal(_bits(loaded[dst]), _bits(drafter[src]))
    others = [b for b in range(NUM_BLOCKS) if b not in load.whole[0]]
    assert not _bits(loaded[others]).any()


def test_each_h2o_group_moves_by_its_own_blocks():
    """vLLM splits a target into several H2O groups beside a drafter with fewer layers: one
    plan, so one ``kv_len``, but each group's layers live in that group's blocks."""
    layers = [Layer(cache_views), Layer(cache_views)]
    loaded = [Layer(cache_views), Layer(cache_views)]
    for layer in layers:
        layer.kv_cache.normal_()
        layer.scores.uniform_()
    save = KVMove("r", "key", ((5, 2), (0, 7)), 6)
    files = {}
    save_load.save(TransferOrders(saves=[save]), [(f"l{g}", layer, layer.kv_cache, g) for g, layer in enumerate(layers)],
                  lambda move, tensors: files.update(tensors) or 0)
    load = KVMove("r", "key", ((1, 3), (4, 6)), 6)
    save_load.load(TransferOrders(loads=[load]), [(f"l{g}", layer, layer.kv_cache, g) for g, layer in enumerate(loaded)],
                  lambda move: files)
    for g in range(2):
        for pos in range(6):
            src = (save.block_ids[g][pos // BLOCK], pos % BLOCK)
            dst = (load.block_ids[g][pos // BLOCK], pos % BLOCK)
            assert torch.equal(cache_views(loaded[g].kv_cache).keys[dst], cache_views(layers[g].kv_cache).keys[src])
            assert torch.equal(loaded[g].scores[dst[0], :, dst[1]], layers[g].scores[src[0], :, src[1]])
