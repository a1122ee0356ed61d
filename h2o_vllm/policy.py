"""The H2O rules both sides of vLLM share: the live KV length of a Budget, the keep-set.

Pure: torch and ``config`` only. The scheduler (engine-core process) and the workers evaluate
``kv_len_after`` on the same inputs, so they agree on every block count without exchanging a
message; see docs/semantics.md, "Shared deterministic rule". Every cadence rule (prefill
chunks, when compaction fires) is here, once, for ints (the scheduler) and for tensors of rows
(the worker) alike; how a score mode weighs queries or ranks tokens is its class's
(``h2o_vllm.score_modes``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeVar

import torch

from h2o_vllm.config import Budget, H2OConfig
from h2o_vllm.score_modes import ScoreMode

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def _cdiv(a: IntOrTensor, b: IntOrTensor) -> IntOrTensor:
    return -(-a // b)  # floor division rounds down on ints and on integer tensors alike


def _where(cond, a, b):
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, a, b)
    return a if cond else b


def _maximum(a, b):
    if any(isinstance(x, torch.Tensor) for x in (a, b)):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def prompt_chunk(prompt_len: IntOrTensor, chunk) -> IntOrTensor:
    """The prefill chunk every rule runs with: ``prefill_chunk``, or where unset (None; 0 in a
    tensor of rows) the whole prompt, one chunk. The one place that says so."""
    whole = prompt_len.clamp(min=1) if isinstance(prompt_len, torch.Tensor) else max(prompt_len, 1)
    if chunk is None:
        return whole
    if isinstance(chunk, torch.Tensor):
        return torch.where(chunk > 0, chunk, whole)
    return chunk


def chunk_end(position: IntOrTensor, prompt_len: IntOrTensor, chunk) -> IntOrTensor:
    """Where the prefill chunk holding prompt ``position`` ends (exclusive): the next multiple
    of the chunk, or the prompt's end (docs/semantics.md, "Prefill chunks")."""
    chunk = prompt_chunk(prompt_len, chunk)
    end = (position // chunk + 1) * chunk
    return torch.minimum(end, prompt_len) if isinstance(end, torch.Tensor) else min(end, prompt_len)


def _boundary_live(k: IntOrTensor, budget_tokens: IntOrTensor, interval: IntOrTensor,
                   chunk: IntOrTensor) -> IntOrTensor:
    """Live length right after the check at the ``k``-th chunk boundary inside the prompt
    (``k * chunk < prompt_len``): nothing is evicted until a boundary finds budget + interval
    tokens or more (boundary ``k1``), and from there one compaction every ``m`` chunks, each
    back to the budget (docs/semantics.md, "Prefill chunks")."""
    k1, m = _compacting_boundaries(budget_tokens, interval, chunk)
    return _where(k < k1, k * chunk, budget_tokens + ((k - k1) % m) * chunk)


def _compacting_boundaries(budget_tokens, interval, chunk):
    """(the first chunk boundary that compacts, chunks between later compactions)."""
    return _cdiv(budget_tokens + interval, chunk), _cdiv(interval, chunk)


def _prompt_end(prompt_len, budget_tokens, interval, chunk):
    """(live length before the check at the prompt's end, live length after it)."""
    last = _cdiv(prompt_len, chunk) - 1  # the last chunk boundary strictly inside the prompt
    before = _boundary_live(last, budget_tokens, interval, chunk) + prompt_len - last * chunk
    return before, _where(before >= budget_tokens + interval, budget_tokens + 0 * before, before)


def first_compaction(prompt_len: IntOrTensor, budget_tokens: IntOrTensor, interval: IntOrTensor,
                     chunk=None) -> IntOrTensor:
    """Tokens processed at a sequence's first compaction: the first prefill-chunk boundary
    that holds budget + interval tokens, else the prompt's end if it does, else the decode
    step that reaches budget + interval (docs/semantics.md, "Cadence"). Without ``chunk`` the
    prompt is never evicted: ``max(prompt_len, budget_tokens + interval)``."""
    chunk = prompt_chunk(prompt_len, chunk)
    inside = _cdiv(budget_tokens + interval, chunk) * chunk
    return _where(inside < prompt_len, inside, _maximum(prompt_len, budget_tokens + interval))


def live_kv_len(tokens_processed: IntOrTensor, prompt_len: IntOrTensor,
                budget_tokens: IntOrTensor, interval: IntOrTensor, chunk=None) -> IntOrTensor:
    """Live KV length after ``tokens_processed`` logical tokens have been written.

    Checks come at the end of each prefill chunk (multiples of ``chunk`` inside the prompt,
    the prompt's end; unset: the prompt is one chunk) and after every token past the prompt;
    a check that finds budget + interval tokens or more compacts back to the budget. Hence
    the closed form. A request recomputed after preemption lands on the same length an
    uninterrupted request would have: both sides only ever see this function. Elementwise on
    tensors (the worker's rows; ``chunk`` then a tensor too) and on ints (the scheduler's).
    """
    t, chunk = tokens_processed, prompt_chunk(prompt_len, chunk)
    k = t // chunk
    in_prompt = _boundary_live(k, budget_tokens, interval, chunk) + t - k * chunk
    _, at_end = _prompt_end(prompt_len, budget_tokens, interval, chunk)
    # Past the prompt the cache grows one token a step and compacts on reaching budget + interval.
    first_decode_compaction = prompt_len + budget_tokens + interval - at_end
    growing = at_end + t - prompt_len
    cycling = budget_tokens + (t - first_decode_compaction) % interval
    after = _where(t < first_decode_compaction, growing, cycling)
    return _where(t < prompt_len, in_prompt, after)


def prefill_step_limit(num_computed: int, prompt_len: int, chunk: int | None) -> int | None:
    """The most tokens a step starting at ``num_computed`` may process without crossing the
    end of a prefill chunk (a multiple of ``chunk`` inside the prompt, or the prompt's end);
    None when nothing limits it (no ``chunk``, or past the prompt). A step that stops short of
    a chunk's end checks nothing, so how the scheduler splits a chunk changes no result."""
    if chunk is None or num_computed >= prompt_len:
        return None
    return chunk_end(num_computed, prompt_len, chunk) - num_computed


def window_step_limit(num_computed: int, num_new_tokens: int, prompt_len: int, chunk: int | None,
                      window: int) -> int:
    """The tokens a prefill step may process so that the step that ends a prefill chunk holds
    the chunk's last ``window`` queries (all of a shorter chunk): a key scorer that reads the
    compacting step's queries (``Scorer.query_window``: Expected Attention) then reads the same
    queries however vLLM splits the chunk. Either the step ends the chunk or it leaves at least
    that many queries to the step that will (0: not this step; vLLM's own prefill lookahead
    for MTP drafters does the same). A step already inside the window is left as it is."""
    if not window or num_computed >= prompt_len:
        return num_new_tokens
    size = prompt_chunk(prompt_len, chunk)
    end = chunk_end(num_computed, prompt_len, chunk)
    start = max(num_computed // size * size, end - window)  # the window's first query
    stops_inside = start < num_computed + num_new_tokens < end
    return start - num_computed if num_computed <= start and stops_inside else num_new_tokens


def draft_step_limit(num_computed: int, prompt_len: int, budget: Budget) -> int:
    """The most tokens a speculative verification step starting at ``num_computed`` may
    process (docs/semantics.md, "Speculative decoding"): it must end before the token whose
    check compacts, and that token runs alone. A compaction is irrevocable and comes at the
    end of a step, while which drafts are accepted is known only after it: a step that held
    the compacting token and drafts after it would show them the uncompacted cache, and one
    that ended on it would compact even when a draft before it was rejected. So one step per
    interval runs without drafts, and ``interval`` 1 (the paper's per-step eviction) leaves
    none. Past the prompt only (drafts exist only there)."""
    kv_len = kv_len_after(num_computed, prompt_len, budget)
    return max(1, budget.tokens + budget.interval - 1 - kv_len)


def replay_step_limit(num_computed: int, prompt_len: int, budget: Budget) -> int:
    """The most tokens a step starting at ``num_computed`` may process so that it stops where
    the uninterrupted request's steps stopped at each compaction: inside the prompt, at the
    prompt's end (its chunks' ends are ``prefill_step_limit``'s); past it, before the next
    token whose check compacts, which then runs alone (``draft_step_limit``'s rule). A running
    request decodes one token a step and never meets it; a recompute after a preemption holds
    its prompt and outputs, and one step over them would compact once, at its end, from its
    own queries. Cut so, its compactions come where they came and each reads the queries the
    uninterrupted step read: a decode compaction's one query (docs/semantics.md,
    "Expected Attention")."""
    if num_computed < prompt_len:
        return prompt_len - num_computed
    return draft_step_limit(num_computed, prompt_len, budget)


def step_compacts(num_computed: int, num_tokens: int, prompt_len: int, budget: Budget) -> bool:
    """Whether a step of ``num_tokens`` tokens starting at ``num_computed`` ends in a
    compaction: the cache it leaves is shorter than the one it started with plus its tokens."""
    return (kv_len_after(num_computed + num_tokens, prompt_len, budget)
            < kv_len_after(num_computed, prompt_len, budget) + num_tokens)


def kv_len_after(tokens_processed: int, prompt_len: int, budget: Budget) -> int:
    """Live KV length of a sequence after ``tokens_processed`` tokens."""
    return live_kv_len(tokens_processed, prompt_len, budget.tokens, budget.interval,
                       budget.prefill_chunk)


def prompt_peak_kv_len(prompt_len: int, budget: Budget) -> int:
    """Most KV-space slots a sequence holds while its prompt is written: the live length
    before the check at the end of its fullest prefill chunk. The prompt itself without
    ``prefill_chunk``; at most budget + interval + chunk - 1 with it."""
    chunk = prompt_chunk(prompt_len, budget.prefill_chunk)
    b, i = budget.tokens, budget.interval
    last = _cdiv(prompt_len, chunk) - 1
    k1, m = _compacting_boundaries(b, i, chunk)
    peak = min(k1, last) * chunk  # boundaries before the first compaction grow by a chunk each
    if last > k1:
        peak = max(peak, b + min(m, last - k1) * chunk)
    before_end, _ = _prompt_end(prompt_len, b, i, chunk)
    return max(peak, before_end)


def peak_kv_len(prompt_len: int, max_len: int, budget: Budget) -> int:
    """Most KV-space slots a sequence of at most ``max_len`` logical tokens needs in one step
    after its prompt: the live length before a decode step plus the token it writes (its
    prompt's peak, ``prompt_peak_kv_len``, when it never decodes).

    Bounded by budget + interval whatever ``max_len`` is: what makes H2O's memory per
    sequence predictable, and the bound of what admission keeps free for a running sequence
    (``H2OManager.admission_headroom``).
    """
    last = max_len - 1  # the last decode step starts from max_len - 1 processed tokens
    if last < prompt_len:
        return prompt_peak_kv_len(prompt_len, budget)
    b, i = budget.tokens, budget.interval
    _, at_end = _prompt_end(prompt_len, b, i, prompt_chunk(prompt_len, budget.prefill_chunk))
    first_decode_compaction = prompt_len + b + i - at_end
    peak = at_end + min(first_decode_compaction - 1, last) - prompt_len
    if last >= first_decode_compaction:
        peak = max(peak, b + min(i - 1, last - first_decode_compaction))
    return max(peak + 1, 1)


def prefill_peak_kv_len(num_tokens: int, prompt_len: int, budget: Budget) -> int:
    """Most KV-space slots a sequence holds while ``num_tokens`` tokens are prefilled (its
    prompt; after a preemption, its prompt and outputs): the whole of them without
    ``prefill_chunk``; with it, the prompt's peak, or what its prompt kept plus the outputs
    recomputed in one step."""
    if budget.prefill_chunk is None:
        return num_tokens
    kept = kv_len_after(prompt_len, prompt_len, budget)
    return max(prompt_peak_kv_len(prompt_len, budget), kept + max(0, num_tokens - prompt_len))


def request_peak_blocks(prompt_len: int, max_len: int, budget: Budget, block_size: int,
                        prefix_caching: bool) -> int:
    """Most KV blocks one request of at most ``max_len`` tokens holds at once: its prompt's
    peak or its decode peak, and with prefix caching the fresh blocks its first compaction
    writes into while it still holds the old ones. What a request must find in the pool."""
    slots = max(prompt_peak_kv_len(prompt_len, budget), peak_kv_len(prompt_len, max_len, budget))
    blocks = _cdiv(slots, block_size)
    if prefix_caching and kv_len_after(max_len, prompt_len, budget) < max_len:
        blocks += _cdiv(budget.tokens, block_size)
    return blocks


@functools.lru_cache(maxsize=16)  # vLLM asks several times at start-up; a long max_model_len costs
def engine_peak_blocks(config: H2OConfig, max_model_len: int, block_size: int,
                       prefix_caching: bool) -> int:
    """Most KV blocks any request of at most ``max_model_len`` tokens holds at once under the
    engine's budget (``request_peak_blocks``, the worst prompt length): what the KV pool must
    hold for an engine to start. Per-request overrides are checked per request."""
    return max(request_peak_blocks(p, max_model_len, config.budget(p, block_size), block_size,
                                   prefix_caching) for p in range(1, max_model_len + 1))


def select_keep(scores: torch.Tensor, heavy: int, recent: int, sink_tokens: int = 0,
                rank: Sequence[ScoreMode] = ()) -> torch.Tensor:
    """Indices of the tokens to keep, per head: the ``sink_tokens`` first ones, the ``recent`` last
    ones, and the ``heavy`` highest-ranked among the rest; ties keep the more recent token;
    ascending order.

    scores: [..., n] accumulated attention of the n live tokens (oldest first). The first
    ``sink_tokens`` live tokens are the first logical ones: they are never evicted, and compaction
    keeps order. ``rank``: the score modes that rank this compaction's candidates (each
    ``ScoreMode.rank`` in turn), none: by their own scores.
    Returns int64 [..., min(n, sink_tokens + heavy + recent)]; the same count per head.
    """
    n = scores.shape[-1]
    num_sinks = min(sink_tokens, n)
    num_recent = min(recent, n - num_sinks)
    num_older = n - num_recent
    num_heavy = min(heavy, num_older - num_sinks)
    lead = scores.shape[:-1]
    device = scores.device
    sink_idx = torch.arange(num_sinks, device=device).expand(*lead, num_sinks)
    recent_idx = torch.arange(num_older, n, device=device).expand(*lead, num_recent)
    if num_heavy == 0:
        return torch.cat([sink_idx, recent_idx], dim=-1).contiguous()
    candidates = scores[..., num_sinks:num_older]
    for mode in rank:
        candidates = mode.rank(candidates)
    # Flip so that, among equal scores, the stable sort meets the more recent token first.
    order = torch.sort(candidates.flip(-1), dim=-1, descending=True, stable=True).indices[..., :num_heavy]
    heavy_idx = torch.sort(num_older - 1 - order, dim=-1).values
    return torch.cat([sink_idx, heavy_idx, recent_idx], dim=-1)
