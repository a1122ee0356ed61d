"""TransferScheduler: the scheduler's side of moving a prompt's H2O state between engines.

Runs in the engine-core process, behind H2O's KV connector (``kv_transfer.connector``); never
touches a tensor. The protocol (docs/kv-transfer.md): the producer prefills a prompt of ``L``
tokens, compacts it by the request's budget and saves the live KV; the consumer is given
that prompt plus the producer's first token and runs it as the producer's request continued:
H2O prompt length ``L``, so the first token is a decode step, as in one engine. Why not the
prompt alone with its last token recomputed (vLLM's NIXL protocol): that token's query saw the
whole prompt, which a compacted cache no longer holds; the first token is the one thing only
the producer can compute exactly, so it travels with the state.

A consumer's request that continues a committed state loads it when nothing of it is
computed yet and every rank file is whole; otherwise (a file missing or cut short, a local
prefix hit first, a preempted request coming back) it computes the prompt itself, with the
same H2O prompt length: the same tokens, at the cost of the prefill.

Where states live is the medium's: ``TransferScheduler`` is shared storage (``KVStore``);
``kv_transfer.nixl_scheduler.NixlTransferScheduler`` overrides the five medium hooks
(``_committed``, ``_readiness``, ``_staged``, ``_commit``, ``_forget``) for NIXL.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
from vllm.utils.math_utils import cdiv

from h2o_vllm import metrics
from h2o_vllm.budgets import request_budget
from h2o_vllm.config import H2OConfig
from h2o_vllm.kv_transfer.orders import KVMove, TransferOrders
from h2o_vllm.kv_transfer.store import KVStore, StoredPrompt, state_key
from h2o_vllm.policy import kv_len_after

logger = logging.getLogger("vllm.h2o_vllm")

#: ``_readiness``: the state is on its way (a NIXL read in flight); ask again next step.
PENDING = object()


class WholeGroup(NamedTuple):
    """A KV-cache group H2O leaves whole (a speculative drafter's layers): its block size cuts
    a request's blocks to those that hold the prompt, its layers name the state."""
    block_size: int
    layers: tuple[str, ...]


class TransferScheduler:
    def __init__(self, store: KVStore, config: H2OConfig, block_size: int, world_size: int,
                 produces: bool, consumes: bool, whole: tuple[WholeGroup, ...] = ()) -> None:
        self.store, self.config, self.block_size = store, config, block_size
        self.whole_groups = whole
        self.world_size, self.produces, self.consumes = world_size, produces, consumes
        self.continuations: dict[str, tuple[str, StoredPrompt]] = {}  # consumer request -> its state
        self.whole: set[str] = set()                            # continuations whose files were checked
        self.loading: dict[str, tuple[str, StoredPrompt]] = {}  # matched, awaiting allocation
        self.loads: list[KVMove] = []                           # allocated, for the next orders
        self.saving: dict[str, tuple[str, int, int]] = {}  # producer request -> (key, prompt, kv_len)
        self.first_tokens: dict[str, int] = {}  # continued from kv_transfer_params -> token to emit first
        self.num_loaded = self.num_recomputed = 0

    def _key(self, request, prompt_len: int) -> str:
        budget = request_budget(self.config, request.sampling_params, prompt_len, self.block_size)
        return state_key(request.prompt_token_ids[:prompt_len], budget, self.block_size,
                         [group.layers for group in self.whole_groups])

    def continue_from_params(self, request):
        """vLLM's own P/D protocol (its disaggregation proxy): the decoder gets the original
        prompt and the producer's ``kv_transfer_params``. An ``EngineCoreRequest`` whose params
        name a committed H2O state of exactly its prompt and budget becomes our protocol's
        request, built before vLLM makes its ``Request``: the prompt plus the producer's first
        token (the state then loads as for any continuation), ``max_tokens`` / ``min_tokens``
        one less, and that token is emitted first (``emit_first_tokens``). Anything else is
        left as it is: the prompt is computed here, exact too, as H2O holds a prompt whole."""
        params = request.sampling_params
        kv = (params.extra_args or {}).get("kv_transfer_params") if params is not None else None
        ids = request.prompt_token_ids
        if not self.consumes or not isinstance(kv, dict) or "h2o_kv_key" not in kv or ids is None:
            return request
        plain = (params.max_tokens is not None and params.max_tokens >= 2 and params.logprobs is None
                 and params.prompt_logprobs is None and params.structured_outputs is None and params.n == 1)
        key = self._key(request, len(ids))
        stored = self._committed(request.request_id, key, kv) if plain and kv["h2o_kv_key"] == key else None
        if (stored is None or stored.prompt_len != len(ids)
                or (not params.ignore_eos and stored.first_token in params.all_stop_token_ids)):
            return request
        continued = params.clone()
        continued.max_tokens -= 1
        continued.min_tokens = max(0, continued.min_tokens - 1)
        self.first_tokens[request.request_id] = stored.first_token
        return msgspec.structs.replace(request, prompt_token_ids=[*ids, stored.first_token],
                                       sampling_params=continued)

    def emit_first_tokens(self, outputs) -> None:
        """Each request continued from ``kv_transfer_params`` emits the producer's first token
        before its own (``outputs``: vLLM's ``EngineCoreOutputs`` of a step, by client)."""
        if not self.first_tokens:
            return
        for batch in outputs.values():
            for out in batch.outputs:
                if out.new_token_ids and out.request_id in self.first_tokens:
                    out.new_token_ids = [self.first_tokens.pop(out.request_id), *out.new_token_ids]

    def prompt_len(self, request) -> int:
        """H2O's prompt length for a request being added: ``L`` for a consumer's request that
        is a committed prompt of ``L`` tokens plus its first token, else vLLM's."""
        ids = request.prompt_token_ids or []
        n = len(ids)
        if not self.consumes or n < 2:
            return n
        key = self._key(request, n - 1)
        stored = self._committed(request.request_id, key)
        if stored is None or stored.prompt_len != n - 1 or stored.first_token != ids[-1]:
            return n
        self.continuations[request.request_id] = (key, stored)
        return n - 1

    def matched(self, request, num_local_computed: int, managers: Sequence) -> int | None:
        """Tokens the consumer loads for a waiting ``request`` (vLLM's
        ``get_num_new_matched_tokens``): its whole H2O prompt, when nothing is computed yet and
        the state is whole; None while it is still on its way (vLLM asks again next step);
        else 0 (it computes the prompt itself). ``managers``: the H2O groups' managers."""
        rid = request.request_id
        self.loading.pop(rid, None)
        found = self.continuations.get(rid)
        # vLLM drops any match for a request that skips cached tokens (prompt logprobs): it
        # must not hold KV space for a load that never comes.
        if (found is None or request.num_computed_tokens or num_local_computed or request.num_preemptions
                or request.skip_reading_prefix_cache):
            for manager in managers:
                manager.unload(rid)
            if found is not None:
                self._forget(rid)
            return 0
        key, stored = found
        flaw = None if rid in self.whole else self._readiness(rid, key, stored)
        if flaw is PENDING:
            return None
        if flaw is not None:
            del self.continuations[rid]  # computed here from now on; H2O's prompt stays L
            self._forget(rid)
            for manager in managers:
                manager.unload(rid)
            self.num_recomputed += 1
            metrics.recorder().add(kv_transfer_recomputed_prompts=1)
            logger.warning("h2o: request %s recomputes its prompt instead of loading the producer's "
                           "KV state: %s", rid, flaw)
            return 0
        self.whole.add(rid)  # vLLM asks again each step the request waits for blocks
        for manager in managers:
            manager.load(rid, stored.prompt_len, stored.kv_len)
        self.loading[rid] = found
        return stored.prompt_len

    def _world_flaw(self, stored: StoredPrompt) -> str | None:
        if stored.world_size != self.world_size:
            return f"it was saved by {stored.world_size} tensor-parallel ranks, this engine has {self.world_size}"
        return None

    # The medium's hooks: shared storage here.

    def _committed(self, req_id: str, key: str, kv_params: dict | None = None) -> StoredPrompt | None:
        """The committed state ``key`` that request ``req_id`` continues, if any (``kv_params``:
        its ``kv_transfer_params``, when the request came with them)."""
        return self.store.committed(key)

    def _readiness(self, req_id: str, key: str, stored: StoredPrompt):
        """None when the state can be loaded now, ``PENDING`` while it is on its way, else why not."""
        return self._world_flaw(stored) or self.store.flaw(key, stored)

    def _staged(self, request, move: KVMove) -> KVMove | None:
        """The save ``move`` as the medium takes it, or None to save nothing."""
        return move

    def _commit(self, req_id: str, key: str, stored: StoredPrompt) -> dict:
        """Make a saved state loadable; returns what ``kv_transfer_params`` add to name it."""
        self.store.commit(key, stored)
        return {}

    def _forget(self, req_id: str) -> None:
        """``req_id`` ends or gives up its save or load: drop what the medium holds for it."""

    def _whole(self, group_ids: Sequence[Sequence[int]], num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """The blocks of each whole group (``group_ids``: all of a request's, per group) that
        hold positions ``[0, num_tokens)``."""
        return tuple(tuple(ids[:cdiv(num_tokens, group.block_size)])
                     for ids, group in zip(group_ids, self.whole_groups, strict=True))

    def allocated(self, request, block_ids: Sequence[Sequence[int]], num_external_tokens: int,
                  whole_ids: Sequence[Sequence[int]] = ()) -> None:
        """vLLM allocated ``request``'s blocks (each H2O group's ``block_ids``, each whole
        group's ``whole_ids``) for a load."""
        found = self.loading.pop(request.request_id, None)
        if found is None or not num_external_tokens:
            return
        key, stored = found
        live = tuple(tuple(ids[:cdiv(stored.kv_len, self.block_size)]) for ids in block_ids)
        self.loads.append(KVMove(request.request_id, key, live, stored.kv_len,
                                 whole=self._whole(whole_ids, stored.prompt_len)))
        self.num_loaded += 1
        metrics.recorder().add(kv_transfer_loaded_prompts=1)

    def orders(self, scheduler_output, requests, managers: Sequence,
               whole_ids: Callable[[str], Sequence[Sequence[int]]] = lambda rid: ()) -> TransferOrders:
        """This step's orders: prompt lengths, the loads allocated since the last step, and
        the saves of producer requests whose prompt ends with this step (``managers``: the H2O
        groups', which share one plan; ``whole_ids``: a request's blocks in each whole group). Called while vLLM builds the step's output,
        before it advances the requests' computed tokens."""
        orders = TransferOrders(loads=self.loads)
        self.loads = []
        manager = managers[0]  # every H2O group runs the same plan: prompt, budget, kv_len
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            # Drafts are no prompt tokens (nor is vLLM's padding of a one-token step).
            num_new -= len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            request = requests[rid]
            prompt_len = manager.prompt_len_of(request)
            if prompt_len != request.num_prompt_tokens:
                orders.prompt_lens[rid] = prompt_len
            if (self.produces and rid not in self.continuations
                    and request.num_computed_tokens + num_new == prompt_len > request.num_computed_tokens):
                budget = manager.budgets[rid]
                kv_len = kv_len_after(prompt_len, prompt_len, budget)
                key = self._key(request, prompt_len)
                live = tuple(tuple(m.live_block_ids(rid, kv_len)) for m in managers)
                move = self._staged(request, KVMove(rid, key, live, kv_len,
                                                    whole=self._whole(whole_ids(rid), prompt_len)))
                if move is not None:
                    orders.saves.append(move)
                    self.saving[rid] = (key, prompt_len, kv_len)
        return orders

    def finished(self, request) -> dict | None:
        """A request finished (or was aborted): a producer's saved prompt is committed once its
        first token exists; returns the ``kv_transfer_params`` for the client, or None."""
        rid = request.request_id
        self.continuations.pop(rid, None)
        self.loading.pop(rid, None)
        self.whole.discard(rid)
        self.first_tokens.pop(rid, None)
        saved = self.saving.pop(rid, None)
        if saved is None or not request.output_token_ids:
            self._forget(rid)
            return None
        key, prompt_len, kv_len = saved
        first = int(request.output_token_ids[0])
        named = self._commit(rid, key, StoredPrompt(prompt_len=prompt_len, first_token=first, kv_len=kv_len,
                                                    world_size=self.world_size))
        self._forget(rid)
        return {"h2o_kv_key": key, "h2o_kv_tokens": kv_len, "h2o_prompt_tokens": prompt_len,
                "h2o_first_token": first, **named}

