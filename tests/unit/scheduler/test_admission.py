"""scheduler.admission: the room an H2O manager keeps free when vLLM admits a request, on a
real vLLM BlockPool with vLLM's real ``Request`` (the watermark that sums the claims, with a
drafter's whole group: test_scheduling.py; with real engines: tests/engine/test_blocks.py)."""
import pytest
from vllm.utils.math_utils import cdiv

from h2o_vllm.config import Budget, H2OConfig
from h2o_vllm.policy import kv_len_after, peak_kv_len
from test_manager import BLOCK, BUDGET, CHUNKED, MAX_LEN, _manager, _prefill, _request


@pytest.mark.parametrize("prompt_len, max_tokens", [(100, 50), (10, 40)])
def test_manager_admission_headroom_alone_is_what_peak_exceeds_prefill(prompt_len, max_tokens):
    # Nothing runs: the newcomer needs room only for what its peak exceeds its prefill.
    # (100, 50): peak 32 tokens = 2 blocks < 7 allocated; (10, 40): peak 32 = 2 blocks > 1.
    peak = cdiv(peak_kv_len(prompt_len, prompt_len + max_tokens, BUDGET), BLOCK)
    expected = max(0, peak - cdiv(prompt_len, BLOCK))
    assert expected == (0 if prompt_len == 100 else 1)
    newcomer = _request("c", prompt_len, max_tokens)
    assert _manager().admission_headroom(newcomer, prompt_len, MAX_LEN) == expected


def test_manager_admission_headroom_keeps_running_claims():
    m = _manager()
    a = _request("a", 40)  # engine budget: compacted to 16 tokens, holds 1 block, peaks at 32
    wide = {"h2o_heavy_tokens": 16, "h2o_recent_tokens": 16, "h2o_interval": 48}
    b = _request("b", 40, extra_args=wide)  # not compacted before 80 tokens: holds 3, peaks at 5
    _prefill(m, a)
    _prefill(m, b)
    claims = {}
    for r, budget in ((a, BUDGET), (b, Budget(16, 16, 48))):
        held = len(m.req_to_blocks[r.request_id])
        peak = cdiv(peak_kv_len(40, 140, budget), BLOCK)
        assert peak <= cdiv(kv_len_after(40, 40, budget) + budget.interval, BLOCK)  # within an interval
        claims[r.request_id] = peak - held
    assert claims == {"a": 1, "b": 2}
    reserve = sum(claims.values())
    # A newcomer whose whole life fits in the block it allocates now: exactly the reserve.
    assert cdiv(peak_kv_len(10, 16, BUDGET), BLOCK) == 1
    assert m.admission_headroom(_request("c", 10, max_tokens=6), 10, MAX_LEN) == reserve
    # A long prompt: allocating + headroom covers the running claims and its own peak.
    big = _request("d", 100, max_tokens=50)
    allocating, own_peak = cdiv(100, BLOCK), cdiv(peak_kv_len(100, 150, BUDGET), BLOCK)
    assert allocating + m.admission_headroom(big, 100, MAX_LEN) >= reserve + own_peak
    # A chunk of it (32 of 100 tokens): the rest of the prompt plus the running claims.
    assert m.admission_headroom(_request("e", 100, 50), 32, MAX_LEN) == (cdiv(100, BLOCK) - 2) + reserve


def test_admission_headroom_claims_a_chunked_prompts_peak_not_its_length():
    unchunked, chunked = _manager(), _manager(CHUNKED)
    for m, extra in ((unchunked, None), (chunked, {"h2o_prefill_chunk": 32})):
        request = _request("new", 400, extra_args=extra)
        m.budgets.resolve("new", 400, request.sampling_params)
        m.prompt_lens["new"] = 400
        m._headroom = m.admission_headroom(request, 32, MAX_LEN)  # its first chunk now
    assert unchunked._headroom == 25 - 2  # the rest of the prompt, held whole
    # Chunked: its prompt's peak (16 + 32 tokens: 3 blocks) less the 2 allocated now.
    assert chunked._headroom == 1


def test_admission_headroom_claims_the_draft_slots_allocated_past_every_step():
    """Under speculative decoding vLLM allocates ``num_lookahead_tokens`` slots past each step:
    a sequence's peak and its next interval hold them too."""
    config = H2OConfig(heavy_tokens=8, recent_tokens=8, interval=32)  # peaks at 16 + 32 = 3 blocks
    plain, drafting = _manager(config), _manager(config)
    newcomer = _request("c", 16, max_tokens=100)
    for m, lookahead in ((plain, 0), (drafting, 3)):
        m.budgets.resolve("c", 16)
        m._headroom = m.admission_headroom(newcomer, 16, MAX_LEN, lookahead)
    # Allocating 16 (+ 3) tokens now: the rest of 48 tokens, or of 51 (a fourth block).
    assert (plain._headroom, drafting._headroom) == (3 - 1, 4 - 2)
    assert plain._admitted["c"].peak == 3 and drafting._admitted["c"].peak == 4


def test_a_whole_group_claims_in_blocks_of_its_own_size():
    """vLLM sizes each group's blocks to one page: a drafter with other head dimensions has
    blocks of another size, and its claim counts them."""
    import torch
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    h2o = _manager(H2OConfig(heavy_tokens=8, recent_tokens=8, interval=64))  # horizon: 64 tokens
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    drafter = FullAttentionManager(spec, block_pool=h2o.block_pool, enable_caching=False,
                                   kv_cache_group_id=1, scheduler_block_size=BLOCK)
    running = _request("a", 40, max_tokens=200)
    _prefill(h2o, running)
    drafter.allocate_new_blocks("a", 40, 40)  # 2 blocks of 32
    newcomer = _request("c", 32, max_tokens=8)  # 40 tokens at most: 2 blocks of 32
    h2o.admission_headroom(newcomer, 32, MAX_LEN)
    # "a": 2 more blocks of 32 over its next 64 tokens; "c": one past its 32-token step.
    assert h2o.whole_group_headroom(drafter, newcomer, 32) == 2 + 1
