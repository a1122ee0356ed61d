"""Per-request H2O budgets (``extra_args`` / OpenAI ``vllm_xargs``) checked before queueing.

Runs in process 0, called from the request-validation hooks (``vllm_hooks.request_validation``): a bad
override is a ``ValueError`` that the server answers with HTTP 400 and ``LLM.generate`` raises.
"""
from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from h2o_vllm.config import (REQUEST_PREFIX, config_from_additional, request_config, request_keys,
                             request_overrides)
from h2o_vllm.frontend.conflicts import FULL_LAYERS, SLIDING_LAYERS, check_score
from h2o_vllm.policy import prompt_chunk, request_peak_blocks

def _request_error(message: str, value) -> ValueError:
    """A ``ValueError`` that vLLM's async front end also maps to HTTP 400.

    ``AsyncLLM.generate`` turns any other exception, ``ValueError`` included, into a 500
    ``EngineGenerateError``; only ``VLLMClientError`` passes through as a client error."""
    class H2ORequestError(VLLMValidationError, ValueError):
        pass
    return H2ORequestError(message, parameter="vllm_xargs", value=value)


def check_request_overrides(additional_config, extra_args) -> None:
    """Raise ``ValueError`` naming the bad ``extra_args`` key (OpenAI: ``vllm_xargs``). The
    ``h2o_`` prefix is H2O's: an unknown key with it (a typo such as ``h2o_heavy_tokns``) is
    refused rather than dropped, which would run the engine's budget unannounced; other
    plugins' keys are left alone."""
    known = request_keys()
    unknown = sorted(k for k in extra_args or () if isinstance(k, str) and k.startswith(REQUEST_PREFIX)
                     and k not in known)
    if unknown:
        raise _request_error(f"unknown H2O key {', '.join(unknown)} in extra_args / vllm_xargs (the "
                             f"{REQUEST_PREFIX} prefix is H2O's); valid keys: {', '.join(sorted(known))}",
                             {k: extra_args[k] for k in unknown})
    overrides = request_overrides(extra_args)
    if not overrides:
        return
    config = config_from_additional(additional_config)
    given = {k: v for k, v in extra_args.items() if k in known}
    keys = ", ".join(given)
    if config is None:
        raise _request_error(f"{keys}: H2O KV eviction is off in this engine; start it with --kv-eviction "
                             "h2o (or additional_config={'h2o': {...}}) to use per-request budgets", given)
    try:
        config.with_overrides(overrides)
    except ValueError as exc:
        raise _request_error(f"invalid per-request H2O budget ({keys} in extra_args / vllm_xargs): {exc}",
                             given) from None


def check_request_fits(vllm_config, prompt_len: int, max_tokens: int | None, extra_args) -> None:
    """Raise ``ValueError`` when one request could never fit the KV pool, even alone: with
    ``max_model_len`` above the pool (an engine with ``prefill_chunk`` starts there) a prompt
    held whole, or a budget too large, would otherwise wait or be preempted forever. Checked
    once the engine has reported its pool (``cache_config.num_gpu_blocks``). A hybrid model's
    request holds blocks in every KV-cache group of the shared pool: H2O's peak in each
    full-attention group, vLLM's window in each sliding-window one. First, a per-request
    ``h2o_score`` this engine's model or step size cannot run (``conflicts.check_score``)."""
    config = config_from_additional(vllm_config.additional_config)
    if config is None:
        return
    request = request_config(config, extra_args)
    if request.score != config.score:  # the engine's own was checked before it loaded
        try:
            check_score(vllm_config, request.score, key="h2o_score")
        except ValueError as exc:
            raise _request_error(f"invalid per-request H2O score: {exc}", {"h2o_score": request.score}) from None
    cache = vllm_config.cache_config
    if not cache.num_gpu_blocks:
        return
    # Process 0 sums the pools of data-parallel engines; one request runs in one of them.
    pool = cache.num_gpu_blocks // max(1, vllm_config.parallel_config.data_parallel_size) - 1
    max_len = min(prompt_len + (max_tokens or 0), vllm_config.model_config.max_model_len)
    budget = request.budget(prompt_len, cache.block_size)
    h2o_blocks = request_peak_blocks(prompt_len, max_len, budget, cache.block_size,
                                     bool(cache.enable_prefix_caching))
    full_groups, sliding_groups = kv_cache_group_counts(vllm_config)
    window_blocks = 0
    if sliding_groups:
        step = min(prompt_len, prompt_chunk(prompt_len, budget.prefill_chunk),
                   vllm_config.scheduler_config.max_num_batched_tokens)
        window_blocks = sliding_peak_blocks(max_len, vllm_config.model_config.get_sliding_window(), step,
                                            cache.block_size)
    need = full_groups * h2o_blocks + sliding_groups * window_blocks
    if need <= pool:
        return
    chunked = budget.prefill_chunk is not None and budget.prefill_chunk < prompt_len
    how = ("a chunked prompt's peak is about budget + interval + chunk tokens (with prefix caching "
           "plus the budget again, the fresh blocks of its first compaction): lower h2o_prefill_chunk "
           "or the budget" if chunked else
           "the prompt is held whole until its end: set h2o_prefill_chunk (--h2o-prefill-chunk) so "
           "that H2O evicts between prompt chunks, or lower the budget")
    groups = (f"; {h2o_blocks} in each of {full_groups} full-attention KV-cache groups and "
              f"{window_blocks} in each of {sliding_groups} sliding-window ones" if sliding_groups else "")
    raise _request_error(
        f"this request needs up to {need} KV blocks at once (prompt of {prompt_len} tokens, at most "
        f"{max_len} in all, H2O budget {budget.tokens} tokens{groups}), more than the KV pool's {pool}: {how}",
        {"prompt_tokens": prompt_len, "max_tokens": max_tokens})


def kv_cache_group_counts(vllm_config) -> tuple[int, int]:
    """(full-attention groups, sliding-window groups) among the KV-cache groups vLLM forms for
    the model, by vLLM's rule for a uniform page size: layers of one kind are split into groups
    of the smaller kind's count, or of the larger's when it is less than 1.5 times the smaller
    (``_get_kv_cache_groups_uniform_page_size``; the contract test holds it to vLLM's). A model
    without sliding-window layers, or one whose windows vLLM does not keep apart, is one group."""
    layer_types = getattr(vllm_config.model_config.hf_text_config, "layer_types", None) or ()
    full = sum(t in FULL_LAYERS for t in layer_types)
    sliding = sum(t in SLIDING_LAYERS for t in layer_types)
    if (not full or not sliding or not vllm_config.model_config.get_sliding_window()
            or vllm_config.scheduler_config.disable_hybrid_kv_cache_manager):
        return 1, 0
    size = min(full, sliding)
    if max(full, sliding) < 1.5 * size:
        size = max(full, sliding)
    return -(-full // size), -(-sliding // size)


def sliding_peak_blocks(max_len: int, window: int, step_tokens: int, block_size: int) -> int:
    """Most blocks one request holds in a sliding-window group: before a step vLLM drops the
    blocks wholly outside the window of the tokens computed so far, then allocates the step's
    ``step_tokens`` (its prompt chunk; a decode step's one token is fewer)."""
    return min(-(-max_len // block_size), -(-(window - 1 + step_tokens) // block_size) + 1)
