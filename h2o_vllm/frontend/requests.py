"""Per-request H2O budgets (``extra_args`` / OpenAI ``vllm_xargs``) checked before queueing.

Runs in process 0, called from the request-validation hooks (``vllm_hooks.requests``): a bad
override is a ``ValueError`` that the server answers with HTTP 400 and ``LLM.generate`` raises.
"""
from __future__ import annotations

from h2o_vllm.config import (REQUEST_KEYS, REQUEST_PREFIX, config_from_additional, request_config,
                             request_overrides)
from h2o_vllm.policy import request_peak_blocks

def _request_error(message: str, value) -> ValueError:
    """A ``ValueError`` that vLLM's async front end also maps to HTTP 400.

    ``AsyncLLM.generate`` turns any other exception, ``ValueError`` included, into a 500
    ``EngineGenerateError``; only ``VLLMClientError`` passes through as a client error."""
    from vllm.exceptions import VLLMValidationError

    class H2ORequestError(VLLMValidationError, ValueError):
        pass
    return H2ORequestError(message, parameter="vllm_xargs", value=value)


def check_request_overrides(additional_config, extra_args) -> None:
    """Raise ``ValueError`` naming the bad ``extra_args`` key (OpenAI: ``vllm_xargs``). The
    ``h2o_`` prefix is H2O's: an unknown key with it (a typo such as ``h2o_heavy_tokns``) is
    refused rather than dropped, which would run the engine's budget unannounced; other
    plugins' keys are left alone."""
    unknown = sorted(k for k in extra_args or () if isinstance(k, str) and k.startswith(REQUEST_PREFIX)
                     and k not in REQUEST_KEYS)
    if unknown:
        raise _request_error(f"unknown H2O key {', '.join(unknown)} in extra_args / vllm_xargs (the "
                             f"{REQUEST_PREFIX} prefix is H2O's); valid keys: {', '.join(sorted(REQUEST_KEYS))}",
                             {k: extra_args[k] for k in unknown})
    overrides = request_overrides(extra_args)
    if not overrides:
        return
    config = config_from_additional(additional_config)
    given = {k: v for k, v in extra_args.items() if k in REQUEST_KEYS}
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
    once the engine has reported its pool (``cache_config.num_gpu_blocks``)."""
    config = config_from_additional(vllm_config.additional_config)
    cache = vllm_config.cache_config
    if config is None or not cache.num_gpu_blocks:
        return
    # Process 0 sums the pools of data-parallel engines; one request runs in one of them.
    pool = cache.num_gpu_blocks // max(1, vllm_config.parallel_config.data_parallel_size) - 1
    max_len = min(prompt_len + (max_tokens or 0), vllm_config.model_config.max_model_len)
    request = request_config(config, extra_args)
    budget = request.budget(prompt_len, cache.block_size)
    need = request_peak_blocks(prompt_len, max_len, budget, cache.block_size,
                               bool(cache.enable_prefix_caching))
    if need <= pool:
        return
    chunked = budget.prefill_chunk is not None and budget.prefill_chunk < prompt_len
    how = ("a chunked prompt's peak is about budget + interval + chunk tokens (with prefix caching "
           "plus the budget again, the fresh blocks of its first compaction): lower h2o_prefill_chunk "
           "or the budget" if chunked else
           "the prompt is held whole until its end: set h2o_prefill_chunk (--h2o-prefill-chunk) so "
           "that H2O evicts between prompt chunks, or lower the budget")
    raise _request_error(
        f"this request needs up to {need} KV blocks at once (prompt of {prompt_len} tokens, at most "
        f"{max_len} in all, H2O budget {budget.tokens} tokens), more than the KV pool's {pool}: {how}",
        {"prompt_tokens": prompt_len, "max_tokens": max_tokens})
