"""The soak's seeded request plan (client process: the test or benchmark driving a server):
``SoakConfig``, ``Job``, ``plan`` and the mixes they draw from.

Prompts are token ids (``prompt=[...]``), so lengths are exact and any vocabulary of at least
``TOKEN_IDS.stop`` ids works (the tiny test Llama has 512).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

TOKEN_IDS = range(10, 500)

#: Per-request budgets (``vllm_xargs``); None: the server's budget. Mixed ways and intervals.
BUDGETS: list[dict | None] = [
    None,
    {"h2o_heavy_tokens": 8, "h2o_recent_tokens": 8},
    {"h2o_heavy_tokens": 4, "h2o_recent_tokens": 12, "h2o_interval": 1},
    {"h2o_heavy_ratio": 0.05, "h2o_recent_ratio": 0.05},
    {"h2o_heavy_ratio": 0.3, "h2o_recent_ratio": 0.2, "h2o_interval": 16},
    {"h2o_heavy_tokens": 32, "h2o_recent_ratio": 0.1, "h2o_interval": 7},
    {"h2o_heavy_ratio": 0.0, "h2o_recent_tokens": 24},
    {"h2o_obs_window": 32, "h2o_pool_kernel": 15},             # the recommended score mode
    {"h2o_heavy_tokens": 1024, "h2o_recent_tokens": 1024},    # above every length: never evicts
]
#: A per-request value the server must refuse with HTTP 400 (interval must be >= 1).
BAD_BUDGET = {"h2o_interval": 0}
#: The stock side's invalid request: a value stock vLLM refuses with HTTP 400 before any stream
#: (``SamplingParams``: temperature must be non-negative), in place of the bad budget.
STOCK_BAD = {"temperature": -1.0}

#: ``VLLM_PLUGINS`` of the stock side's server: any installed plugin but ours, so no process
#: of that server loads h2o-vllm (as tests/engine/engines.py does for stock engines).
STOCK_PLUGINS = "lora_filesystem_resolver"

#: What a client does with its request.
FULL, CLOSE, CANCEL, BAD = "full", "close", "cancel", "bad"


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    xargs: dict | None
    action: str             # FULL: read to the end; CLOSE: close the stream after `after` chunks;
    after: int = 0          # CANCEL: cancel the task `delay_s` after sending; BAD: expect a 400
    delay_s: float = 0.0
    extra: dict | None = None   # further request fields (the stock side's invalid value)


@dataclass
class SoakConfig:
    requests: int = 80
    concurrency: int = 16
    duration_s: float = 90.0        # stop launching new requests after this
    max_model_len: int = 512
    prompt_len: tuple[int, int] = (1, 320)
    max_tokens: tuple[int, int] = (1, 192)
    close_share: float = 0.15       # disconnect after a few chunks
    cancel_share: float = 0.1       # cancel the task after a random delay (maybe before any chunk)
    bad_share: float = 0.04         # invalid per-request budget: must be a 400
    request_timeout_s: float = 300.0
    seed: int = 0
    budgets: list = field(default_factory=lambda: list(BUDGETS))
    h2o: bool = True                # False: the stock side, no h2o_* key in any request
    # Prefix caching under load: this share of prompts starts with one of a few seeded shared
    # prefixes (a system prompt), so hits, score records and their eviction meet aborts.
    shared_prefix_share: float = 0.4
    shared_prefix_lens: tuple[int, ...] = (40, 100, 200)


def plan(cfg: SoakConfig) -> Iterator[Job]:
    """Seeded, mixed requests, made as they are taken; prompt + max_tokens always fits
    ``max_model_len``."""
    rng = random.Random(cfg.seed)
    prefixes = [[rng.choice(TOKEN_IDS) for _ in range(n)] for n in cfg.shared_prefix_lens]
    for i in range(cfg.requests):
        # Lengths: mostly uniform, some at block boundaries (16/32 multiples) and the extremes.
        r = rng.random()
        if r < 0.15:
            prompt_len = rng.choice([1, 15, 16, 17, 31, 32, 33, 64, 128, 256])
        else:
            prompt_len = rng.randint(*cfg.prompt_len)
        prompt_len = min(prompt_len, cfg.max_model_len - 1)
        max_tokens = rng.choice([1, 2]) if rng.random() < 0.05 else rng.randint(*cfg.max_tokens)
        max_tokens = max(1, min(max_tokens, cfg.max_model_len - prompt_len))
        r = rng.random()
        extra = None
        if r < cfg.bad_share:
            action, xargs = BAD, BAD_BUDGET
        else:
            xargs = rng.choice(cfg.budgets)
            if r < cfg.bad_share + cfg.close_share:
                action = CLOSE
            elif r < cfg.bad_share + cfg.close_share + cfg.cancel_share:
                action = CANCEL
            else:
                action = FULL
        if not cfg.h2o:     # after every draw: both sides get the same sequence of requests
            xargs, extra = None, (STOCK_BAD if action == BAD else None)
        prefix = rng.choice(prefixes) if prefixes and rng.random() < cfg.shared_prefix_share else []
        prompt = prefix[:prompt_len] + [rng.choice(TOKEN_IDS) for _ in range(prompt_len - len(prefix))]
        yield Job(i, prompt, max_tokens, xargs, action,
                  after=rng.randint(1, 8), delay_s=rng.uniform(0.0, 2.0), extra=extra)
