"""kv_transfer.nixl_scheduler.NixlTransferScheduler: the producer reserves staging for requests
sent for remote decode and names it in their params; the decoder orders a read, waits for
every rank's, then loads, or computes the prompt when a read failed. A real H2OManager and
vLLM's real Request."""
from types import SimpleNamespace

from test_transfer_scheduler import BLOCK, CONFIG, PROMPT, _core_request, _manager, _request
from vllm.v1.request import Request

from h2o_vllm.scheduler import scheduling
from h2o_vllm.kv_transfer.nixl_scheduler import NixlTransferScheduler, StateShape
from h2o_vllm.kv_transfer.staging import Staging
from h2o_vllm.kv_transfer.orders import NixlPeer, TransferReport

SHAPE = StateShape(num_layers=2, kv_heads=2, head_size=64, itemsize=4)
PEERS = (NixlPeer("p0", "bWV0YWRhdGE=", 4096),)
REMOTE_DECODE = {"do_remote_decode": True}


def _nixl(capacity=1 << 20, world_size=1, produces=True, consumes=True) -> NixlTransferScheduler:
    transfer = NixlTransferScheduler(Staging(capacity, world_size, ttl_s=60), SHAPE, CONFIG, BLOCK, world_size,
                                     produces, consumes)
    transfer.peers = PEERS * world_size
    return transfer


def _produce(transfer, manager, rid="p", kv=REMOTE_DECODE):
    """A producer request through its prompt's last step; returns the step's orders."""
    from vllm import SamplingParams
    request = Request(rid, list(PROMPT), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv}), None)
    scheduling.add_request([manager], request, transfer.prompt_len(request))
    manager.allocate_new_blocks(rid, 40, 40)
    return request, transfer.orders(SimpleNamespace(num_scheduled_tokens={rid: 40}, scheduled_spec_decode_tokens={}), {rid: request}, [manager])


def test_the_producer_stages_requests_sent_for_remote_decode_and_names_the_space():
    transfer, manager = _nixl(), _manager()
    request, orders = _produce(transfer, manager)
    (save,) = orders.saves
    assert (save.kv_len, save.offset, save.nbytes) == (16, 0, SHAPE.nbytes(16)) and save.ticket > 0
    request.append_output_token_ids(9)
    params = transfer.finished(request)
    assert params["h2o_first_token"] == 9 and params["h2o_kv_tokens"] == 16
    assert params["h2o_nixl"] == {"ticket": save.ticket, "offset": 0, "nbytes": save.nbytes,
                                  "peers": [["p0", "bWV0YWRhdGE=", 4096]]}
    assert transfer.staging.held[save.ticket].expires is not None  # its lease runs from here
    # The decoder read it: the space comes back.
    transfer.update(TransferReport(read=[(save.ticket, 0)]))
    assert transfer.staging.used == 0


def test_a_plain_request_an_aborted_one_or_a_full_staging_holds_nothing():
    transfer, manager = _nixl(), _manager()
    assert not _produce(transfer, manager, "plain", kv={})[1].saves
    request, orders = _produce(transfer, manager, "aborted")
    assert orders.saves and transfer.finished(request) is None and transfer.staging.used == 0
    small = _nixl(capacity=SHAPE.nbytes(16) - 1)
    request, orders = _produce(small, _manager(), "big")
    assert not orders.saves and small.num_unstaged == 1
    request.append_output_token_ids(9)
    assert small.finished(request) is None  # nothing named: the decoder computes the prompt


def _params(ticket=5, peers=PEERS):
    return {"h2o_kv_key": None, "h2o_first_token": 7, "h2o_prompt_tokens": 40, "h2o_kv_tokens": 16,
            "h2o_nixl": {"ticket": ticket, "offset": 128, "nbytes": SHAPE.nbytes(16),
                         "peers": [[p.agent, p.metadata, p.base] for p in peers]}}


def _decoder(transfer, manager, rid="c", peers=PEERS):
    kv = _params(peers=peers)
    kv["h2o_kv_key"] = transfer._key(_request(rid, PROMPT), 40)
    request = Request.from_engine_core_request(transfer.continue_from_params(_core_request(rid, list(PROMPT), kv)),
                                               None)
    scheduling.add_request([manager], request, transfer.prompt_len(request))
    return request


def test_the_decoder_reads_first_then_loads_once_every_rank_has_read():
    transfer, manager = _nixl(world_size=2), _manager()
    request = _decoder(transfer, manager, peers=PEERS * 2)
    assert request.prompt_token_ids == PROMPT + [7] and manager.prompt_len_of(request) == 40
    assert transfer.matched(request, 0, [manager]) is None
    assert transfer.matched(request, 0, [manager]) is None  # asked again: one read only
    orders = transfer.orders(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}), {}, [manager])
    (fetch,) = orders.fetches
    assert (fetch.req_id, fetch.ticket, fetch.offset, len(fetch.peers)) == ("c", 5, 128, 2)
    transfer.update(TransferReport(fetched={"c": {0: None}}))
    assert transfer.matched(request, 0, [manager]) is None  # rank 1 still reading
    transfer.update(TransferReport(fetched={"c": {1: None}}))
    assert transfer.matched(request, 0, [manager]) == 40
    transfer.allocated(request, [[3, 4]], 40)
    (load,) = transfer.orders(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}), {}, [manager]).loads
    assert load.block_ids == ((3,),) and load.kv_len == 16 and not transfer.fetching
    transfer.finished(request)
    assert not transfer.named and not transfer.forgets


def test_a_failed_read_or_another_world_size_computes_the_prompt_here():
    transfer, manager = _nixl(), _manager()
    request = _decoder(transfer, manager)
    assert transfer.matched(request, 0, [manager]) is None
    transfer.update(TransferReport(fetched={"c": {0: "NIXL reported an error reading from p0"}}))
    assert transfer.matched(request, 0, [manager]) == 0 and transfer.num_recomputed == 1
    assert transfer.orders(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}), {}, [manager]).forgets == ["c"]
    assert manager.prompt_len_of(request) == 40  # still the producer's request continued
    two = _decoder(transfer, _manager(), "d", peers=PEERS * 2)
    assert transfer.matched(two, 0, [manager]) == 0 and not transfer.fetching


def test_a_decoder_request_that_ends_while_reading_drops_its_read():
    transfer, manager = _nixl(), _manager()
    request = _decoder(transfer, manager)
    assert transfer.matched(request, 0, [manager]) is None
    transfer.finished(request)
    assert transfer.orders(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}), {}, [manager]).forgets == ["c"]


def test_a_request_that_gave_up_its_read_for_a_local_hit_computes_its_prompt_after():
    """A local prefix hit first drops the read; if vLLM later finds no hit after all, the
    request computes its prompt (it cannot read any more), never a KeyError."""
    transfer, manager = _nixl(), _manager()
    request = _decoder(transfer, manager)
    assert transfer.matched(request, 16, [manager]) == 0  # a local hit: no read
    assert transfer.matched(request, 0, [manager]) == 0 and transfer.num_recomputed == 1
    assert not transfer.fetching


def test_malformed_params_are_no_state_and_crash_nothing():
    transfer = _nixl()
    key = transfer._key(_request("m", PROMPT), 40)
    for broken in ({"h2o_nixl": "x"}, {"h2o_nixl": {"ticket": 1}}, {"h2o_nixl": {**_params()["h2o_nixl"], "peers": [[1]]}},
                   {"h2o_prompt_tokens": "forty"}):
        kv = {**_params(), "h2o_kv_key": key, **broken}
        request = _core_request("m", list(PROMPT), kv)
        assert transfer.continue_from_params(request) is request
