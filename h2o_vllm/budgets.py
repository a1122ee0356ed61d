"""RequestBudgets: each request's ``Budget``, resolved once per process and read from there.

Pure: config only. The scheduler's ``H2OManager`` keeps one (filled when a request is added)
and the worker's runner keeps one (filled when a request first enters a batch); both resolve
from the same engine config, the same ``extra_args`` and the same prompt length, so every
process counts every request's KV length alike.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from h2o_vllm.config import Budget, H2OConfig, request_config


class RequestBudgets:
    def __init__(self, config: H2OConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size  # the KV block: the default interval
        self._budgets: dict[str, Budget] = {}

    def resolve(self, request_id: str, prompt_len: int,
                extra_args: Mapping[str, Any] | None = None) -> Budget:
        """The request's budget; resolved on first sight, then read back."""
        budget = self._budgets.get(request_id)
        if budget is None:
            config = request_config(self.config, extra_args)
            budget = self._budgets[request_id] = config.budget(prompt_len, self.block_size)
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
