"""What greedy n-gram speculation drafts and accepts on a finished greedy sequence, replayed
without an engine: an n-gram drafter reads only the tokens, and greedy verification accepts a
draft's longest prefix that equals what the model generated next, so the prompt and the
output decide both counts. Run with H2O's draft cut (``budget``: the scheduler's
``policy.draft_step_limit``) it is what the engine counts; run without, what the same output
would have accepted had no step been cut. ``benchmarks/speculative.py`` reports both, so an
acceptance gap to stock splits into what H2O generated and what the cut cost.

vLLM's own matcher does the drafting (``ngram_proposer``'s KMP search, numba-compiled).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from h2o_vllm.config import Budget
from h2o_vllm.policy import draft_step_limit


@dataclass(frozen=True)
class NgramDrafter:
    """vLLM's ``{"method": "ngram", ...}`` speculative config."""
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_model_len: int

    @classmethod
    def from_config(cls, spec: dict, max_model_len: int) -> "NgramDrafter":
        # vLLM's SpeculativeConfig fills a missing bound with the other one, both with 5
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        low = low or high or 5
        return cls(spec["num_speculative_tokens"], low, high or low, max_model_len)

    def draft(self, tokens: np.ndarray) -> np.ndarray:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
        return _find_longest_matched_ngram_and_propose_tokens(
            tokens, self.prompt_lookup_min, self.prompt_lookup_max, self.max_model_len,
            self.num_speculative_tokens)


def replay(prompt: Sequence[int], output: Sequence[int], drafter: NgramDrafter,
           budget: Budget | None = None) -> tuple[int, int]:
    """(draft tokens verified, draft tokens accepted) over greedy ``output`` after ``prompt``.
    The prefill step samples the first output token; each later step verifies the drafts made
    from every token so far and keeps the accepted ones plus the next sampled token. With
    ``budget`` each step's drafts are cut where H2O's scheduler cuts them. Drafts past the
    output's end are checked against nothing: the engine, which samples there before it stops,
    may count one or two more accepted per request; and a preempted request's redone steps
    draft anew in the engine, not here."""
    tokens = np.asarray([*prompt, *output], dtype=np.int32)
    n, end = len(prompt) + 1, len(tokens)
    drafted = accepted = 0
    while n < end:
        draft = drafter.draft(tokens[:n])
        if budget is not None:  # the step starts with n - 1 tokens computed and holds 1 + drafts
            draft = draft[:draft_step_limit(n - 1, len(prompt), budget) - 1]
        hits = 0
        while hits < len(draft) and n + hits < end and draft[hits] == tokens[n + hits]:
            hits += 1
        drafted, accepted, n = drafted + len(draft), accepted + hits, n + hits + 1
    return drafted, accepted
