"""Per-request H2O budgets (``extra_args`` / OpenAI ``vllm_xargs``) checked before queueing.

Runs in process 0, called from the request-validation hooks (``vllm_hooks.requests``): a bad
override is a ``ValueError`` that the server answers with HTTP 400 and ``LLM.generate`` raises.
"""
from __future__ import annotations

from h2o_vllm.config import REQUEST_KEYS, config_from_additional, request_overrides

def _request_error(message: str, value) -> ValueError:
    """A ``ValueError`` that vLLM's async front end also maps to HTTP 400.

    ``AsyncLLM.generate`` turns any other exception, ``ValueError`` included, into a 500
    ``EngineGenerateError``; only ``VLLMClientError`` passes through as a client error."""
    from vllm.exceptions import VLLMValidationError

    class H2ORequestError(VLLMValidationError, ValueError):
        pass
    return H2ORequestError(message, parameter="vllm_xargs", value=value)


def check_request_overrides(additional_config, extra_args) -> None:
    """Raise ``ValueError`` naming the bad ``extra_args`` key (OpenAI: ``vllm_xargs``)."""
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
