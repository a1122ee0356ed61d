"""kv_transfer.transfer_scheduler.TransferScheduler: which consumer requests continue a stored prompt, when
they load, what the producer saves and commits. A real H2OManager and vLLM's real Request."""
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from h2o_vllm.config import H2OConfig
from h2o_vllm.kv_transfer.store import KVStore, StoredPrompt, state_key
from h2o_vllm.policy import kv_len_after
from h2o_vllm.scheduler import scheduling
from h2o_vllm.scheduler.manager import H2OManager
from h2o_vllm.spec import H2OAttentionSpec
from h2o_vllm.kv_transfer.transfer_scheduler import TransferScheduler, WholeGroup

BLOCK = 16
CONFIG = H2OConfig.from_dict({"heavy_tokens": 8, "recent_tokens": 8})
PROMPT = list(range(100, 140))  # 40 tokens: compacted to 16 at its end
BUDGET = CONFIG.budget(len(PROMPT), BLOCK)


def _manager(caching=False) -> H2OManager:
    pool = BlockPool(num_gpu_blocks=64, enable_caching=caching, hash_block_size=BLOCK)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return H2OManager(H2OAttentionSpec.from_full(full, CONFIG), block_pool=pool, enable_caching=caching,
                      kv_cache_group_id=0, scheduler_block_size=BLOCK)


def _request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=8), None)


def _transfer(tmp_path, produces=False, consumes=True, world_size=1) -> TransferScheduler:
    return TransferScheduler(KVStore(tmp_path), CONFIG, BLOCK, world_size, produces, consumes)


def _stored(tmp_path, first_token=7, world_size=1, whole=()) -> str:
    store, key = KVStore(tmp_path), state_key(PROMPT, BUDGET, BLOCK, [group.layers for group in whole])
    for rank in range(world_size):
        store.write_rank(key, rank, {"l.k": torch.zeros(16, 2, 4)})
    store.commit(key, StoredPrompt(len(PROMPT), first_token, kv_len_after(40, 40, BUDGET), world_size))
    return key


def test_a_committed_prompt_plus_its_first_token_continues_the_producers_request(tmp_path):
    _stored(tmp_path)
    transfer, manager = _transfer(tmp_path), _manager()
    consumer = _request("c", PROMPT + [7])
    assert transfer.prompt_len(consumer) == 40
    scheduling.add_request([manager], consumer, 40)
    assert manager.prompt_len_of(consumer) == 40
    # Another first token, another prompt, or a producer: vLLM's prompt length.
    assert transfer.prompt_len(_request("x", PROMPT + [8])) == 41
    assert transfer.prompt_len(_request("y", PROMPT[1:] + [7])) == 40
    assert _transfer(tmp_path, consumes=False).prompt_len(consumer) == 41
    # It loads its 16 live positions: KV space for those and the next token, not the prompt.
    assert transfer.matched(consumer, 0, [manager]) == 40
    assert manager.num_evicted["c"] == 24
    assert manager.get_num_blocks_to_allocate("c", 41, (), 40, 0, 41) == 2
    manager.allocate_external_computed_blocks("c", 0, 40)
    assert len(manager.req_to_blocks["c"]) == 1
    new = manager.allocate_new_blocks("c", 41, 41)
    blocks = [b.block_id for b in manager.req_to_blocks["c"]]
    assert len(new) == 1 and len(blocks) == 2
    transfer.allocated(consumer, [blocks], 40)
    orders = transfer.orders(SimpleNamespace(num_scheduled_tokens={"c": 1}, scheduled_spec_decode_tokens={}), {"c": consumer}, [manager])
    (load,) = orders.loads
    assert load.block_ids == (tuple(blocks[:1]),) and load.kv_len == 16
    assert orders.prompt_lens == {"c": 40} and not orders.saves
    assert transfer.num_loaded == 1


def test_a_flawed_state_or_a_computed_prefix_is_not_loaded(tmp_path):
    key = _stored(tmp_path, world_size=2)
    manager = _manager()
    transfer = _transfer(tmp_path)
    consumer = _request("c", PROMPT + [7])
    assert transfer.prompt_len(consumer) == 40
    assert transfer.matched(consumer, 16, [manager]) == 0  # a local prefix hit first
    KVStore(tmp_path).rank_path(key, 1).unlink()
    assert transfer.matched(consumer, 0, [manager]) == 0  # rank 1's file is gone
    assert transfer.num_recomputed == 1 and "c" not in manager.num_evicted
    # Prompt logprobs: vLLM reads no cached token for it, so nothing may be matched.
    logprobs = Request("e", PROMPT + [7], SamplingParams(max_tokens=8, prompt_logprobs=1), None)
    transfer.prompt_len(logprobs)
    assert logprobs.skip_reading_prefix_cache and transfer.matched(logprobs, 0, [manager]) == 0
    assert "e" not in manager.num_evicted
    # Another tensor-parallel size: the heads are split otherwise.
    _stored(tmp_path, world_size=1)
    other = _transfer(tmp_path, world_size=2)
    consumer2 = _request("d", PROMPT + [7])
    other.prompt_len(consumer2)
    assert other.matched(consumer2, 0, [manager]) == 0


def test_the_producer_saves_at_its_prompts_end_and_commits_once_it_has_a_token(tmp_path):
    transfer, manager = _transfer(tmp_path, produces=True, consumes=False), _manager()
    producer = _request("p", PROMPT)
    scheduling.add_request([manager], producer, transfer.prompt_len(producer))
    manager.allocate_new_blocks("p", 32, 32)
    step = SimpleNamespace(num_scheduled_tokens={"p": 32}, scheduled_spec_decode_tokens={})
    assert not transfer.orders(step, {"p": producer}, [manager]).saves  # mid-prompt
    producer.num_computed_tokens = 32
    manager.allocate_new_blocks("p", 40, 40)
    step = SimpleNamespace(num_scheduled_tokens={"p": 8}, scheduled_spec_decode_tokens={})
    (save,) = transfer.orders(step, {"p": producer}, [manager]).saves
    key = state_key(PROMPT, BUDGET, BLOCK)
    assert save.key == key and save.kv_len == 16 and len(save.block_ids[0]) == 1
    assert transfer.finished(producer) is None  # no first token (aborted): nothing committed
    assert KVStore(tmp_path).committed(key) is None
    transfer.orders(step, {"p": producer}, [manager])
    producer.append_output_token_ids(9)
    params = transfer.finished(producer)
    assert params == {"h2o_kv_key": key, "h2o_kv_tokens": 16, "h2o_prompt_tokens": 40, "h2o_first_token": 9}
    assert KVStore(tmp_path).committed(key) == StoredPrompt(40, 9, 16, 1)


def test_the_producer_saves_when_vllm_pads_its_prompts_last_step_with_dummy_drafts(tmp_path):
    """A prompt in the producer's prefix cache up to its last token: under speculative
    decoding vLLM pads that one-token step with dummy drafts, which are no prompt tokens."""
    transfer, manager = _transfer(tmp_path, produces=True, consumes=False), _manager()
    producer = _request("p", PROMPT)
    scheduling.add_request([manager], producer, transfer.prompt_len(producer))
    manager.allocate_new_blocks("p", 43, 43)
    producer.num_computed_tokens = 39
    step = SimpleNamespace(num_scheduled_tokens={"p": 4}, scheduled_spec_decode_tokens={"p": [-1] * 3})
    (save,) = transfer.orders(step, {"p": producer}, [manager]).saves
    assert save.key == state_key(PROMPT, BUDGET, BLOCK) and save.kv_len == 16


def test_a_padded_prompt_step_that_compacts_only_with_its_dummies_saves_the_blocks_it_runs_on(tmp_path):
    """31 tokens (16 kept, compacting at 32) hit in the prefix cache up to the last: vLLM pads
    the step to 4 rows, whose optimistic count compacts (fresh blocks for it, which H2O takes
    with prefix caching on), where the prompt alone does not.
    The connector takes the padding off before its orders (as ``build_connector_meta`` does),
    so the save names the two blocks that hold the 31 positions, not fresh ones."""
    transfer, manager = _transfer(tmp_path, produces=True, consumes=False), _manager(caching=True)
    prompt = PROMPT[:31]
    producer = _request("p", prompt)
    scheduling.add_request([manager], producer, transfer.prompt_len(producer))
    producer.num_computed_tokens = 30
    manager.allocate_new_blocks("p", 34, 34)
    assert "p" in manager.fresh  # for the padded step's compaction
    step = SimpleNamespace(num_scheduled_tokens={"p": 4}, scheduled_spec_decode_tokens={"p": [-1] * 3},
                           total_num_scheduled_tokens=4, scheduled_new_reqs=[SimpleNamespace(req_id="p")],
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))
    scheduling.drop_padding([manager], step, {"p": producer})
    (save,) = transfer.orders(step, {"p": producer}, [manager]).saves
    assert save.kv_len == 31 and save.block_ids == (tuple(b.block_id for b in manager.req_to_blocks["p"][:2]),)


def test_a_drafters_whole_groups_move_the_blocks_that_hold_the_prompt(tmp_path):
    """Beside the H2O group's live blocks, each whole group's (a speculative drafter's
    layers, by its own block size) first blocks up to the prompt's end: all 40 positions."""
    drafter = (WholeGroup(BLOCK, ("draft.layers.0.attn",)), WholeGroup(32, ("draft.layers.1.attn",)))
    _stored(tmp_path, whole=drafter)
    producing = TransferScheduler(KVStore(tmp_path), CONFIG, BLOCK, 1, True, False, drafter)
    manager = _manager()
    producer = _request("p", PROMPT)
    scheduling.add_request([manager], producer, producing.prompt_len(producer))
    manager.allocate_new_blocks("p", 40, 40)
    drafter_ids = [[11, 12, 13, 14], [21, 22, 23]]  # the prompt and room past it
    step = SimpleNamespace(num_scheduled_tokens={"p": 40}, scheduled_spec_decode_tokens={})
    (save,) = producing.orders(step, {"p": producer}, [manager], lambda rid: drafter_ids).saves
    assert save.whole == ((11, 12, 13), (21, 22))
    consuming = TransferScheduler(KVStore(tmp_path), CONFIG, BLOCK, 1, False, True, drafter)
    consumer = _request("c", PROMPT + [7])
    consuming.prompt_len(consumer)
    assert consuming.matched(consumer, 0, [manager]) == 40
    consuming.allocated(consumer, [[5, 6]], 40, [[31, 32, 33, 34], [41, 42]])
    (load,) = consuming.orders(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}),
                               {}, [manager]).loads
    assert load.whole == ((31, 32, 33), (41, 42)) and load.block_ids == ((5,),)


def test_a_decoder_with_another_drafter_or_none_computes_the_prompt_itself(tmp_path):
    """The drafter's layers name the state: a decoder whose whole layers differ from the
    producer's (another drafter, or none) finds no state, so never loads blocks it has no
    layers for, or leaves its own drafter's without."""
    _stored(tmp_path)  # saved by an engine without a drafter
    for layer in ("draft.layers.0.attn", "eagle.layers.0.attn"):
        decoder = TransferScheduler(KVStore(tmp_path), CONFIG, BLOCK, 1, False, True, (WholeGroup(BLOCK, (layer,)),))
        assert decoder.prompt_len(_request("c", PROMPT + [7])) == 41  # no state: vLLM's prompt
    assert state_key(PROMPT, BUDGET, BLOCK, [("a",)]) != state_key(PROMPT, BUDGET, BLOCK, [("b",)])
    assert state_key(PROMPT, BUDGET, BLOCK, ()) == state_key(PROMPT, BUDGET, BLOCK)


def test_a_consumer_computing_its_prompt_stops_a_step_at_h2os_prompt_end(tmp_path):
    """The check at the prompt's end (a compaction) must see the step end there, as on the
    producer; the first token is then a decode step."""
    _stored(tmp_path)
    transfer, manager = _transfer(tmp_path), _manager()
    consumer = _request("c", PROMPT + [7])
    scheduling.add_request([manager], consumer, transfer.prompt_len(consumer))
    assert scheduling.limit_step([manager], consumer, 0, 41) == 40
    assert scheduling.limit_step([manager], consumer, 16, 25) == 24
    assert scheduling.limit_step([manager], consumer, 40, 1) == 1
    plain = _request("q", PROMPT + [7])
    scheduling.add_request([manager], plain)
    assert scheduling.limit_step([manager], plain, 0, 41) == 41


def _core_request(rid: str, ids: list[int], kv: dict | None, **params):
    from vllm.v1.engine import EngineCoreRequest
    params.setdefault("max_tokens", 8)
    sampling = SamplingParams(extra_args={"kv_transfer_params": kv} if kv else None, **params)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=ids, mm_features=None, sampling_params=sampling,
                             pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                             data_parallel_rank=None)


def test_vllms_protocol_becomes_a_continuation_that_emits_the_first_token(tmp_path):
    """The original prompt with the producer's kv_transfer_params: the request vLLM builds is
    the prompt plus the first token, one token less to generate, and that token comes first."""
    key = _stored(tmp_path, first_token=7)
    transfer = _transfer(tmp_path)
    kv = {"h2o_kv_key": key, "h2o_first_token": 7, "h2o_prompt_tokens": 40, "h2o_kv_tokens": 16}
    original = _core_request("c", list(PROMPT), kv, min_tokens=3)
    continued = transfer.continue_from_params(original)
    assert continued.prompt_token_ids == PROMPT + [7] and original.prompt_token_ids == PROMPT
    assert (continued.sampling_params.max_tokens, continued.sampling_params.min_tokens) == (7, 2)
    assert original.sampling_params.max_tokens == 8  # the caller's params are not touched
    assert transfer.prompt_len(Request.from_engine_core_request(continued, None)) == 40
    step = {0: SimpleNamespace(outputs=[SimpleNamespace(request_id="c", new_token_ids=[]),
                                        SimpleNamespace(request_id="x", new_token_ids=[5])])}
    transfer.emit_first_tokens(step)  # no token yet (e.g. an empty step): nothing emitted
    step[0].outputs[0].new_token_ids = [11]
    transfer.emit_first_tokens(step)
    transfer.emit_first_tokens(step)  # once
    assert step[0].outputs[0].new_token_ids == [7, 11] and step[0].outputs[1].new_token_ids == [5]
    # Left as they are: another prompt or budget (the key), a state not committed here,
    # logprobs, one token to make, a consumer-less engine, no H2O params.
    elsewhere = {**kv, "h2o_kv_key": state_key(PROMPT[:-1], CONFIG.budget(39, BLOCK), BLOCK)}
    for request, t in [(_core_request("d", PROMPT[1:] + [1], kv), transfer),
                       (_core_request("d2", PROMPT[:-1], elsewhere), transfer),
                       (_core_request("e", list(PROMPT), kv, logprobs=1), transfer),
                       (_core_request("f", list(PROMPT), kv, max_tokens=1), transfer),
                       (_core_request("g", list(PROMPT), kv), _transfer(tmp_path, consumes=False)),
                       (_core_request("h", list(PROMPT), {"do_remote_decode": True}), transfer)]:
        assert t.continue_from_params(request) is request
