"""scheduler.scheduling, the functions vLLM's scheduler hooks call: budgets in and out, compacted
tails cut when their step is scheduled, admission watermark, metrics.

Managers are real H2OManagers on a real BlockPool (or inside vLLM's real KVCacheManager) and
requests are vLLM's real ``vllm.v1.request.Request``.
"""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from h2o_vllm import metrics, vllm_hooks
from h2o_vllm.config import Budget, H2OConfig
from h2o_vllm.policy import kv_len_after, step_compacts
from h2o_vllm.scheduler import scheduling
from h2o_vllm.scheduler.manager import H2OManager
from h2o_vllm.spec import H2OAttentionSpec

BLOCK = 16
MAX_LEN = 4096
SMALL = {"h2o_heavy_tokens": 2, "h2o_recent_tokens": 2, "h2o_interval": 1}


def _full():
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)


def _managers(*configs):
    """One manager per KV-cache group, all on one pool, as vLLM's coordinator builds them."""
    pool = BlockPool(num_gpu_blocks=64, enable_caching=False, hash_block_size=BLOCK)
    return [H2OManager(H2OAttentionSpec.from_full(_full(), c), block_pool=pool, enable_caching=False,
                       kv_cache_group_id=g, scheduler_block_size=BLOCK) for g, c in enumerate(configs)]


def _request(rid, prompt_len, max_tokens=100, extra_args=None, computed=0, in_flight=0):
    request = Request(rid, list(range(prompt_len)),
                      SamplingParams(max_tokens=max_tokens, extra_args=extra_args), None)
    request.num_computed_tokens, request.num_in_flight_tokens = computed, in_flight
    return request


def _run(manager, request):
    """Admit and prefill ``request`` in ``manager``, compacted at its prompt's end."""
    n = request.num_prompt_tokens
    manager.admission_headroom(request, n, MAX_LEN)
    manager.allocate_new_blocks(request.request_id, n, n)
    manager.cut_scheduled(request.request_id, n, n)
    request.num_computed_tokens, request.status = n, RequestStatus.RUNNING


def test_scheduler_step_add_request_resolves_budget_in_every_manager():
    managers = _managers(H2OConfig(min_tokens=0), H2OConfig(heavy_tokens=8, recent_tokens=8, interval=4))
    scheduling.add_request(managers, _request("plain", 100))
    scheduling.add_request(managers, _request("small", 100, extra_args={**SMALL, "other": 1}))
    assert all("plain" in m.budgets and "small" in m.budgets for m in managers)
    # Read back later without extra_args (what the managers do): the first resolution stays.
    assert [m.budgets.resolve("plain", 100) for m in managers] == [Budget(10, 10, BLOCK), Budget(8, 8, 4)]
    assert [m.budgets.resolve("small", 100) for m in managers] == [Budget(2, 2, 1)] * 2


def test_scheduler_step_add_request_without_sampling_params():
    managers = _managers(H2OConfig(min_tokens=0))
    pooling = _request("p", 50)
    pooling.sampling_params = None  # a pooling request carries no SamplingParams
    scheduling.add_request(managers, pooling)
    assert managers[0].budgets.resolve("p", 50) == Budget(5, 5, BLOCK)


def test_scheduler_step_finish_request_forgets_budget():
    managers = _managers(H2OConfig(), H2OConfig())
    for rid in ("done", "kept"):
        scheduling.add_request(managers, _request(rid, 100, extra_args=SMALL))
    scheduling.finish_request(managers, "done")
    scheduling.finish_request(managers, "never-added")  # an abort before add: no error
    assert all("done" not in m.budgets and "kept" in m.budgets for m in managers)
    assert all(len(m.budgets) == 1 for m in managers)


def test_scheduler_step_cut_scheduled_frees_as_soon_as_the_step_is_scheduled():
    """The prefill step is scheduled (vLLM has counted its tokens; its output is not processed,
    as under async scheduling): its compaction's tail is back in the pool before the next
    schedule, and vLLM's own processed-basis call in allocate_slots changes nothing."""
    vllm_hooks.register_kv_cache_spec()
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    spec = H2OAttentionSpec.from_full(full, H2OConfig(heavy_tokens=8, recent_tokens=8))
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    kv_cache_manager = KVCacheManager(config, max_model_len=MAX_LEN, scheduler_block_size=BLOCK,
                                      hash_block_size=BLOCK, enable_caching=False)
    (manager,) = kv_cache_manager.coordinator.single_type_managers
    request = _request("a", 100)
    assert kv_cache_manager.allocate_slots(request, 100) is not None
    # schedule() counts the step (compacted to 16 tokens), its output still in flight
    request.num_computed_tokens, request.num_in_flight_tokens = 100, 100
    free = kv_cache_manager.block_pool.get_num_free_blocks()
    output = SimpleNamespace(num_scheduled_tokens={"a": 100})
    scheduling.cut_scheduled([manager], output, {"a": request})
    assert len(manager.req_to_blocks["a"]) == 1 and manager.num_freed_blocks == 6
    assert kv_cache_manager.block_pool.get_num_free_blocks() == free + 6
    scheduling.cut_scheduled([manager], output, {"a": request})  # idempotent
    # The next decode step: vLLM's remove_skipped_blocks (processed basis: 0) leaves it be.
    assert kv_cache_manager.allocate_slots(request, 1) is not None
    assert len(manager.req_to_blocks["a"]) == 2 and manager.num_evicted["a"] == 84


@pytest.mark.parametrize("status", [RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED])
def test_scheduler_step_admission_watermark(status):
    config = H2OConfig(heavy_tokens=8, recent_tokens=8)  # each running request claims one block
    first, second = _managers(config, config)
    for rid in ("a", "b"):
        _run(first, _request(rid, 40))
    _run(second, _request("x", 40))
    newcomer = _request("c", 10, max_tokens=6)  # fits in the one block it allocates now
    newcomer.status = status
    expected = 5 if status == RequestStatus.RUNNING else 5 + 2 + 1
    assert scheduling.admission_watermark([first, second], [], 5, newcomer, 10, 10, MAX_LEN) == expected
    assert scheduling.admission_watermark([], [], 5, newcomer, 10, 10, MAX_LEN) == 5


def test_admission_watermark_adds_what_the_groups_h2o_leaves_whole_claim():
    """A drafter's full-attention group shares the pool: its running sequences' next interval
    and the newcomer's are claimed too (``H2OManager.whole_group_headroom``)."""
    config = H2OConfig(heavy_tokens=8, recent_tokens=8, interval=32)  # horizon: two blocks
    (h2o,) = _managers(config)
    drafter = FullAttentionManager(_full(), block_pool=h2o.block_pool, enable_caching=False,
                                   kv_cache_group_id=1, scheduler_block_size=BLOCK)
    running = _request("a", 40, max_tokens=100)
    _run(h2o, running)
    drafter.allocate_new_blocks("a", 40, 40)  # 3 blocks, whole
    newcomer = _request("c", 16, max_tokens=8)
    newcomer.status = RequestStatus.WAITING
    alone = scheduling.admission_watermark([h2o], [], 0, newcomer, 16, 16, MAX_LEN)
    # "a" grows two blocks over its next interval; "c" (24 tokens at most: 2 blocks) one more
    # than its 16-token prompt's step allocates.
    assert scheduling.admission_watermark([h2o], [drafter], 0, newcomer, 16, 16, MAX_LEN) == alone + 2 + 1
    # A sequence near its end claims only what is left of it.
    drafter.allocate_new_blocks("a", 130, 130)  # 9 of its 9 blocks (140 tokens at most)
    assert h2o.whole_group_headroom(drafter, newcomer, 16) == 1


def test_scheduler_step_record_metrics_sets_recorder(monkeypatch):
    monkeypatch.setattr(metrics, "_recorder", metrics.Recorder(None))  # writes nowhere
    config = H2OConfig(heavy_tokens=8, recent_tokens=8)  # one engine config: every group alike
    first, second = _managers(config, config)
    running = [_request("a", 100), _request("b", 40)]
    for request in running:
        for manager in (first, second):
            _run(manager, request)
    running.append(_request("new", 20, computed=0))  # scheduled, nothing computed yet
    scheduling.record_metrics([first, second], running)
    # In each group a keeps 16 of 100 tokens (6 blocks freed), b 16 of 40 (2 freed).
    assert (first.num_freed_blocks, second.num_freed_blocks) == (8, 8)
    assert metrics.recorder().values == {"freed_blocks": 16, "live_kv_tokens": 16 + 16,
                                         "score_record_tokens": 0}
    before = dict(metrics.recorder().values)
    scheduling.record_metrics([], running)  # no H2O group: nothing recorded
    assert metrics.recorder().values == before


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 80), heavy=st.integers(1, 10), recent=st.integers(1, 10),
       interval=st.integers(1, 12), drafts=st.integers(1, 4), data=st.data())
def test_limit_step_under_async_scheduling_never_places_a_compaction_on_unverified_drafts(
        prompt_len, heavy, recent, interval, drafts, data):
    """Async scheduling with a worker drafter: each step is scheduled while the one before it
    (its drafts unverified) is in flight, on vLLM's count of every draft accepted. Whatever
    the drafts' fate, the step compacts or not as the scheduler counts it, a step with
    drafts never compacts, compactions come where plain decoding has them, and a request
    waits at most one step for its in-flight drafts."""
    config = {"h2o_heavy_tokens": heavy, "h2o_recent_tokens": recent, "h2o_interval": interval}
    (m,) = _managers(H2OConfig())
    request = SimpleNamespace(request_id="r", num_prompt_tokens=prompt_len, sampling_params=None,
                              num_tokens=0, num_output_placeholders=0, status=RequestStatus.RUNNING)
    budget = m.budgets.resolve("r", prompt_len, SimpleNamespace(extra_args=config))
    computed, in_flight, end, compactions, waited = prompt_len, 0, prompt_len + 60, [], False
    while computed < end:
        # vLLM's view: the step in flight (in_flight tokens: its sampled token and its drafts)
        # counted in full; one token (the last sampled) known past it.
        request.num_tokens, request.num_output_placeholders = computed + 1, in_flight
        optimistic = computed + in_flight
        tokens = scheduling.limit_step([m], request, optimistic, 1 + drafts)
        starts = range(computed + 1, optimistic + 1) if in_flight else [computed]
        if tokens:
            outcomes = {step_compacts(s, tokens, prompt_len, budget) for s in starts}
            assert outcomes == {step_compacts(optimistic, tokens, prompt_len, budget)}
            assert tokens == 1 or outcomes == {False}
        else:
            assert in_flight > 1 and not waited  # drafts in flight, and only one step's wait
        waited = not tokens
        if in_flight:  # the step in flight is verified: its sampled token and some drafts
            computed += 1 + data.draw(st.integers(0, in_flight - 1))
        if tokens and step_compacts(computed, tokens, prompt_len, budget):
            compactions.append(computed + tokens)
        in_flight = tokens
    assert compactions == [n for n in range(prompt_len + 1, computed + in_flight + 1)  # plain decoding's
                           if kv_len_after(n, prompt_len, budget) < kv_len_after(n - 1, prompt_len, budget) + 1]


def _output(num_scheduled_tokens: dict, spec_tokens: dict, admitted=(), resumed=()):
    """A step's ``SchedulerOutput``, the fields ``drop_padding`` reads: ``admitted`` rows are
    new requests, ``resumed`` ones preempted requests admitted again."""
    return SimpleNamespace(num_scheduled_tokens=num_scheduled_tokens, scheduled_spec_decode_tokens=spec_tokens,
                           total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
                           scheduled_new_reqs=[SimpleNamespace(req_id=rid) for rid in admitted],
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 80), heavy=st.integers(1, 10), recent=st.integers(1, 10),
       interval=st.integers(1, 12), drafts=st.integers(1, 4), past=st.integers(0, 40), resumed=st.booleans())
def test_a_padded_row_keeps_its_dummy_drafts_only_where_no_compaction_falls_among_them(
        prompt_len, heavy, recent, interval, drafts, past, resumed):
    """vLLM pads a request admitted with one token left (a prefix-cache hit or a KV-connector
    load up to its last token) to ``1 + k`` rows, ``k`` dummy drafts it always rejects, and
    asserts the row whole: ``limit_step`` leaves it so. ``drop_padding`` then takes the dummies
    off wherever the step would compact before its end (as plain decoding would: the row runs
    its one token alone) and leaves it padded where it would not, so a step with drafts
    never compacts."""
    config = {"h2o_heavy_tokens": heavy, "h2o_recent_tokens": recent, "h2o_interval": interval}
    (m,) = _managers(H2OConfig())
    request = _request("r", prompt_len, extra_args=config)
    for token in range(past):
        request.append_output_token_ids(token)
    scheduling.add_request([m], request)
    budget = m.budgets.resolve("r", prompt_len)
    computed = request.num_tokens - 1  # all but the last token: a hit or a load
    request.num_computed_tokens = computed
    if resumed:  # preempted, then admitted again on a prefix-cache hit
        request.status = RequestStatus.PREEMPTED
    assert scheduling.limit_step([m], request, computed, 1 + drafts) == 1 + drafts
    request.status = RequestStatus.RUNNING  # as vLLM sets it before the output is built
    admitted = {"resumed" if resumed else "admitted": ["r"]}
    output = _output({"r": 1 + drafts, "other": 5}, {"r": [-1] * drafts}, **admitted)
    scheduling.drop_padding([m], output, {"r": request})
    padded = "r" in output.scheduled_spec_decode_tokens
    tokens = output.num_scheduled_tokens["r"]
    assert tokens == (1 + drafts if padded else 1) and output.total_num_scheduled_tokens == 5 + tokens
    assert padded == (not any(step_compacts(computed, n, prompt_len, budget) for n in range(1, 2 + drafts)))
    assert output.num_scheduled_tokens["other"] == 5


def test_drop_padding_leaves_a_running_requests_own_drafts_alone():
    """A running request's drafts are its own (``spec_token_ids``): ``limit_step`` has cut them
    where they would reach a compaction, and ``drop_padding`` does not touch them."""
    (m,) = _managers(H2OConfig(heavy_tokens=4, recent_tokens=4, interval=4))
    request = _request("r", 20)
    scheduling.add_request([m], request)
    request.append_output_token_ids(7)
    request.num_computed_tokens, request.spec_token_ids = 20, [1, 2, 3]
    request.status = RequestStatus.RUNNING
    tokens = scheduling.limit_step([m], request, 20, 4)
    assert tokens < 4  # the compaction at 24 is the fourth token's: cut before it
    request.spec_token_ids = []  # vLLM clears them once it has scheduled them
    output = _output({"r": tokens}, {"r": [1, 2, 3][:tokens - 1]})
    scheduling.drop_padding([m], output, {"r": request})
    assert output.num_scheduled_tokens == {"r": tokens} and output.scheduled_spec_decode_tokens["r"] == [1, 2, 3][:tokens - 1]
