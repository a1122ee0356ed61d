"""A deliberately naive H2O, written apart from ``h2o_vllm.oracle`` to cross-check it.

Test-only. Nothing is cached: every step reruns the Hugging Face model's own (eager) forward over
ALL tokens so far. Eviction is a per-(layer, KV head) record of when each token was dropped; a
forward hook turns it into a per-layer, per-query-head additive mask in which every query sees
exactly the tokens that were live when that query ran, so the recomputed hidden states equal the
original ones. Scores are recomputed from scratch at every step as column sums of all recorded
probabilities; compaction is an explicit Python loop; the cadence is the closed form
``kv_len(n) = n if n < start else budget + (n - start) % interval`` with budget = sinks + heavy +
recent. The budget is resolved here from the config's fields (not through ``H2OConfig.budget``),
and an unset interval is one KV block (``block_size``), as vLLM and the oracle resolve it.

Score modes past the paper, each in the same from-scratch style: after ``N`` queries (all
tokens so far, in order), ``s(t) = sum_i decay**(N-1-i) * w_i * p_i(t)``, the unrolled form of
"each query does s <- decay*s + w_i*p_i", with ``w_i = 0`` for a prompt query before the
observation window (``i < prompt_len - obs_window``), else 1. Sinks: tokens at logical position
``< sink_tokens`` are never evicted. ``min_tokens``: the recent part grows until sinks + heavy +
recent reaches it; unset, it is ``DEFAULT_MIN_TOKENS`` when a part is a positive (or default)
ratio, 0 for token counts. ``pool_kernel``: at the first eviction only, each candidate is ranked by the
largest score among the candidates at most ``pool_kernel // 2`` places from it in the list of
live candidates.
"""
from __future__ import annotations

import math

import torch

from h2o_vllm.config import DEFAULT_MIN_TOKENS, H2OConfig

NEVER = math.inf


class NaiveH2O:
    """One sequence of naive H2O on ``model`` (an eager-attention HF Llama)."""

    def __init__(self, model, config: H2OConfig | None, prompt: list[int], *,
                 block_size: int | None = None) -> None:
        assert model.config._attn_implementation == "eager", "needs eager attention weights"
        self.model = model
        self.config = config
        self.prompt_len = len(prompt)
        self.num_layers = model.config.num_hidden_layers
        self.num_q = model.config.num_attention_heads
        self.num_kv = model.config.num_key_value_heads
        self.tokens: list[int] = []
        # step_end[t]: token count at the end of the step that processed token t (its query ran then).
        self.step_end: list[int] = []
        # dropped_at[layer][kv_head][t]: token count at the end of the step that evicted t.
        self.dropped_at = [[[] for _ in range(self.num_kv)] for _ in range(self.num_layers)]
        self.scores: list[list[list[float]]] = []
        self.evictions = 0
        self.sinks, self.decay, self.obs_window, self.pool = 0, 1.0, None, 1
        if config is not None:
            self.pool = config.pool_kernel or 1
            self.sinks = config.sink_tokens or 0
            self.heavy = config.part_budget("heavy", self.prompt_len)
            self.recent = config.part_budget("recent", self.prompt_len)
            floor = config.min_tokens
            if floor is None:  # the default floor: for a budget that grows with the prompt
                ratio_parts = [config.heavy_ratio if config.heavy_tokens is None else 0,
                               config.recent_ratio if config.recent_tokens is None else 0]
                floor = DEFAULT_MIN_TOKENS if any(r is None or r > 0 for r in ratio_parts) else 0
            if self.sinks + self.heavy + self.recent < floor:
                self.recent = floor - self.sinks - self.heavy
            self.decay = 1.0 if config.decay is None else float(config.decay)
            self.obs_window = config.obs_window
            if config.interval is not None:
                self.interval = config.interval
            else:
                assert block_size is not None, "an unset interval is one KV block: pass block_size"
                self.interval = block_size
        self.logits = self._step(list(prompt))

    def _mask(self, layer: int) -> torch.Tensor:
        """[1, num_q, n, n] additive mask: query q sees key k iff k <= q and k was still live when
        q's step ran (dropped at a later step end, or never)."""
        n = len(self.tokens)
        step_end = torch.tensor(self.step_end, dtype=torch.float64)
        heads = []
        for h in range(self.num_q):
            kv = h // (self.num_q // self.num_kv)
            dropped = torch.tensor(self.dropped_at[layer][kv], dtype=torch.float64)
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            heads.append(causal & (dropped[None, :] >= step_end[:, None]))
        visible = torch.stack(heads).unsqueeze(0)
        return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)

    def _forward(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        probs: list[torch.Tensor] = [None] * self.num_layers
        handles = []
        for i, layer in enumerate(self.model.model.layers):
            mask = self._mask(i)

            def pre(module, args, kwargs, mask=mask):
                kwargs["attention_mask"] = mask
                return args, kwargs

            def post(module, args, output, i=i):
                probs[i] = output[1][0].detach().clone()  # [num_q, n, n]

            handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(post))
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.tokens]), use_cache=False).logits[0, -1].float()
        finally:
            for handle in handles:
                handle.remove()
        return logits, probs

    def _live(self, layer: int, kv: int) -> list[int]:
        return [t for t in range(len(self.tokens)) if self.dropped_at[layer][kv][t] == NEVER]

    @property
    def budget_tokens(self) -> int:
        return self.sinks + self.heavy + self.recent

    def _due(self, n: int) -> bool:
        if self.config is None:
            return False
        budget = self.budget_tokens
        start = max(self.prompt_len, budget + self.interval)
        return n >= start and (n - start) % self.interval == 0

    def _step(self, new_tokens: list[int]) -> torch.Tensor:
        self.tokens += new_tokens
        n = len(self.tokens)
        self.step_end += [n] * len(new_tokens)
        for layer in range(self.num_layers):
            for kv in range(self.num_kv):
                self.dropped_at[layer][kv] += [NEVER] * len(new_tokens)
        logits, probs = self._forward()
        group = self.num_q // self.num_kv
        # scores from scratch: every probability any query ever gave each token, summed over the group
        coef = self._query_coefficients(n)
        if coef is None:  # the paper: a plain sum
            self.scores = [[probs[layer][kv * group:(kv + 1) * group].sum(dim=(0, 1)).tolist()
                            for kv in range(self.num_kv)] for layer in range(self.num_layers)]
        else:  # query i's row of probabilities weighted by decay**(n-1-i) * w_i, in fp64
            self.scores = [[(probs[layer][kv * group:(kv + 1) * group].double().sum(dim=0)
                             * coef[:, None]).sum(dim=0).tolist()
                            for kv in range(self.num_kv)] for layer in range(self.num_layers)]
        if self._due(n):
            for layer in range(self.num_layers):
                for kv in range(self.num_kv):
                    self._evict(layer, kv, n)
            self.evictions += 1
        return logits

    def _query_coefficients(self, n: int) -> torch.Tensor | None:
        """[n] fp64 weight of query i's probabilities in the scores after n queries (None: all 1)."""
        window = self.obs_window is not None and self.prompt_len - self.obs_window > 0
        if self.decay == 1.0 and not window:
            return None
        coef = []
        for i in range(n):
            weight = 0.0 if (i < self.prompt_len and self.obs_window is not None
                             and i < self.prompt_len - self.obs_window) else 1.0
            coef.append(self.decay ** (n - 1 - i) * weight)
        return torch.tensor(coef, dtype=torch.float64)

    def _evict(self, layer: int, kv: int, n: int) -> None:
        live = self._live(layer, kv)
        sinks = [t for t in live if t < self.sinks]
        assert sinks == list(range(self.sinks)), "a sink token was evicted"
        keep = set(sinks)
        live = [t for t in live if t >= self.sinks]  # the rest compete as in the paper
        if self.recent:
            keep.update(live[len(live) - self.recent:])
        rest = live[: len(live) - self.recent]
        score = self.scores[layer][kv]
        half = self.pool // 2 if self.evictions == 0 else 0
        rank = {t: max(score[u] for u in rest[max(0, i - half): i + half + 1]) for i, t in enumerate(rest)}
        # Highest rank first; among equal ranks the more recent token first.
        ranked = sorted(rest, key=lambda t: (-rank[t], -t))
        for t in ranked[: self.heavy]:
            keep.add(t)
        for t in live:
            if t not in keep:
                self.dropped_at[layer][kv][t] = n

    def feed(self, token: int) -> torch.Tensor:
        """Process one more token (a decode step); returns the next-token logits."""
        self.logits = self._step([token])
        return self.logits

    def kept(self, layer: int, kv: int) -> tuple[list[int], list[float]]:
        """Live positions (ascending) of (layer, KV head) and their scores."""
        live = self._live(layer, kv)
        return live, [self.scores[layer][kv][t] for t in live]

    def expected_kv_len(self) -> int:
        n = len(self.tokens)
        if self.config is None:
            return n
        start = max(self.prompt_len, self.budget_tokens + self.interval)
        return n if n < start else self.budget_tokens + (n - start) % self.interval


def naive_generate(model, config: H2OConfig | None, prompt: list[int], max_new_tokens: int, *,
                   block_size: int | None = None) -> tuple[list[int], NaiveH2O]:
    """Greedy generation; the last generated token is not fed (as in the oracle)."""
    run = NaiveH2O(model, config, prompt, block_size=block_size)
    out = []
    while True:
        out.append(int(run.logits.argmax()))
        if len(out) == max_new_tokens:
            return out, run
        run.feed(out[-1])


def naive_score(model, config: H2OConfig | None, prompt: list[int], continuation: list[int], *,
                block_size: int | None = None) -> torch.Tensor:
    """Teacher-forced log-probabilities of ``continuation``."""
    run = NaiveH2O(model, config, prompt, block_size=block_size)
    out = []
    for i, token in enumerate(continuation):
        out.append(torch.log_softmax(run.logits, -1)[token])
        if i + 1 < len(continuation):
            run.feed(token)
    return torch.stack(out)
