"""Hooks on request validation: per-request H2O budgets refused before queueing (HTTP 400).

Runs in process 0. Two seams, one check (``check_request_overrides``), and one check of the
processed request (``check_request_fits``: a request that could never fit the KV pool):

- ``InputProcessor._validate_params``: every request, offline (``LLM.generate`` raises) and
  served. In the server it runs inside the engine client's ``generate``, which a streaming
  response only iterates once its HTTP 200 has been sent, so alone it turns a bad streaming
  request into an SSE error event.
- The OpenAI serving entry points (completions, chat completions, responses): the same check on
  ``vllm_xargs`` before the handler builds anything, so a streaming request is refused with the
  HTTP 400 a non-streaming one gets, from vLLM's own ``VLLMError`` exception handler.
"""
from __future__ import annotations

import multiprocessing

from h2o_vllm.frontend.requests import check_request_fits, check_request_overrides
from h2o_vllm.vllm_hooks.wrapping import _wrap


def install_request_validation_hook() -> None:
    """Refuse bad per-request H2O budgets before the request is queued (HTTP 400)."""
    _wrap("vllm.v1.engine.input_processor:InputProcessor._validate_params", _validate_params_wrapper)
    _wrap("vllm.v1.engine.input_processor:InputProcessor.process_inputs", _process_inputs_wrapper)
    # The serving modules cost ~0.7 s to import and only API servers use them: not in the
    # spawned engine core and workers.
    if _is_api_server_process():
        install_serving_validation_hook()


def _is_api_server_process() -> bool:
    """A top-level process 0, or an API server vLLM spawned for ``--api-server-count > 1``
    (``APIServerProcessManager`` names them ``ApiServer_<i>``)."""
    return (multiprocessing.parent_process() is None
            or multiprocessing.current_process().name.startswith("ApiServer_"))


def install_serving_validation_hook() -> None:
    """The OpenAI entry points that take ``vllm_xargs``, wrapped to check it before any stream."""
    _wrap("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.create_completion",
          _serving_wrapper)
    _wrap("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion",
          _serving_wrapper)
    _wrap("vllm.entrypoints.openai.responses.serving:OpenAIServingResponses.create_responses",
          _serving_wrapper)


def _validate_params_wrapper(original):
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        extra_args = getattr(params, "extra_args", None)
        if extra_args:
            check_request_overrides(self.vllm_config.additional_config, extra_args)
        return result
    return _validate_params


def _process_inputs_wrapper(original):
    """The request as the engine will see it (prompt tokens, max_tokens resolved): refused
    if it could never fit the KV pool."""
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        params = request.sampling_params
        if params is not None and request.prompt_token_ids is not None:
            check_request_fits(self.vllm_config, len(request.prompt_token_ids), params.max_tokens,
                               params.extra_args)
        return request
    return process_inputs


def _serving_wrapper(original):
    async def create(self, request, *args, **kwargs):
        # vllm_xargs becomes SamplingParams.extra_args unchanged (to_sampling_params); the
        # raise reaches vLLM's VLLMError handler: a JSON 400 before any response has started.
        xargs = getattr(request, "vllm_xargs", None)
        if xargs:
            check_request_overrides(self.engine_client.vllm_config.additional_config, xargs)
        return await original(self, request, *args, **kwargs)
    return create
