"""A request's ``Budget``: resolved by one function (``request_budget``), once per process, and
read from a ``RequestBudgets`` everywhere after.

Pure: config only. The scheduler's ``H2OManager`` keeps a ``RequestBudgets`` (filled when a
request is added, ``scheduler.scheduling.add_request``) and the worker's runner keeps one
(filled when the scheduler first sends the request, ``worker.runner_state.RunnerState.begin_step``);
both resolve from the same engine config, the same sampling parameters and the same prompt
length, so every process counts every request's KV length alike.
"""
from __future__ import annotations

from typing import Any, Iterable

from h2o_vllm.config import Budget, H2OConfig, request_config


def request_budget(config: H2OConfig, params: Any, prompt_len: int, block_size: int) -> Budget:
    """The budget a request runs with: the engine's config with the request's overrides
    (``params``: its ``SamplingParams``, whose ``extra_args`` carry ``h2o_*`` keys; None: none)
    for an H2O prompt of ``prompt_len`` tokens. The one reader of a request's ``extra_args``
    for its budget."""
    extra_args = params.extra_args if params is not None else None
    return request_config(config, extra_args).budget(prompt_len, block_size)


class RequestBudgets:
    def __init__(self, config: H2OConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size  # the KV block: the default interval
        self._budgets: dict[str, Budget] = {}

    def resolve(self, request_id: str, prompt_len: int, params: Any = None) -> Budget:
        """The request's budget; resolved on first sight (``request_budget``), then read back."""
        budget = self._budgets.get(request_id)
        if budget is None:
            budget = self._budgets[request_id] = request_budget(self.config, params, prompt_len, self.block_size)
        return budget

    def __getitem__(self, request_id: str) -> Budget:
        """A budget resolved before (the worker's plan: every request was sent new first)."""
        budget = self._budgets.get(request_id)
        if budget is None:
            raise KeyError(f"h2o-vllm: request {request_id!r} reached a step plan without a resolved budget: "
                           "the runner hook saw no new-request data for it")
        return budget

    def forget(self, request_id: str) -> None:
        self._budgets.pop(request_id, None)

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not in ``request_ids`` (for holders that see no finish event)."""
        keep = set(request_ids)
        for gone in [r for r in self._budgets if r not in keep]:
            del self._budgets[gone]

    def __len__(self) -> int:
        return len(self._budgets)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._budgets
