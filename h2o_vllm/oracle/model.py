"""The dense H2O oracle: a Hugging Face causal LM whose attention is replaced, through
transformers' attention-function registry, by real eviction of K/V (docs/semantics.md, "What H2O
is, precisely"). Runs in the caller's process; no vLLM.

The model's own forward runs every step (embeddings, RoPE or learned positions, qk-norm, fused
projections, residual layout, final norm), so any architecture whose attention goes through
``ALL_ATTENTION_FUNCTIONS`` is covered without a forward written here per family; only the
attention over the cache, the scores and the compaction are the oracle's.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle.attention import DEFAULT_QUERY_CHUNK, attend_and_score
from h2o_vllm.oracle.cache import LayerCache, SequenceState
from h2o_vllm.oracle.stored_kv import StoredKV
from h2o_vllm.score_modes.expected import FUTURE_POSITIONS

#: The registry name the oracle's attention is installed under while a step runs.
ATTN_IMPLEMENTATION = "h2o_oracle"


@dataclass
class _Row:
    """One sequence of the step in progress: what the attention function needs from it."""

    state: SequenceState
    positions: torch.Tensor
    query_scale: float
    weights: torch.Tensor | None
    query_chunk: int
    stored_kv: StoredKV


_STEP: contextvars.ContextVar[tuple[_Row, ...] | None] = contextvars.ContextVar("h2o_oracle_step", default=None)


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      softcap=None, sliding_window=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: ``query`` [B, q_heads, n, head_dim] and
    ``key``/``value`` [B, kv_heads, n, head_dim] for this step's ``n`` tokens of each of its B
    sequences only (the model runs without its own cache). Returns ([B, n, q_heads, head_dim], None).

    ``attention_mask`` is the model's causal mask over the step's own tokens, which
    ``attend_and_score`` applies itself over each sequence's whole live cache. A ``sliding_window``
    layer is not evicted: it keeps every token and each query sees its last ``sliding_window``."""
    rows = _STEP.get()
    if rows is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs inside H2OOracle steps only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1] * query.shape[3], dtype=torch.float32)
    for b, row in enumerate(rows):  # each sequence attends over its own cache, as H2O evicts per sequence
        state, index = row.state, module.layer_idx
        if state.layers[index] is None:
            state.layers[index] = LayerCache(key.shape[1], key.shape[-1], capacity=state.prompt_len + 64,
                                             window=sliding_window)
        cache = state.layers[index]
        cache.append(*row.stored_kv.round(key[b].float(), value[b].float()), row.positions)
        window = state.budget.key_scorer.query_window if state.budget and state.budget.key_scorer else 0
        if window:  # what a key scorer reads at this step's compaction
            cache.queries, cache.scale = query[b, :, -window:].float(), scale
        out[b] = attend_and_score(query[b].float(), cache, scale, row.query_chunk, query_scale=row.query_scale,
                                  weights=row.weights, softcap=softcap,
                                  sinks=None if s_aux is None else s_aux.float())
    return out.view(query.shape[0], query.shape[2], query.shape[1], query.shape[3]).to(query.dtype), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _oracle_attention)


class H2OOracle:
    """Greedy generation and teacher-forced scoring with H2O eviction, each sequence its own H2O
    instance (``generate_each`` runs the decode steps of many as one batch of the model).

    ``model``: a Hugging Face causal LM whose attention modules call transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, OPT, GPT-NeoX,
    gpt-oss, ...) and carry ``layer_idx``. Its weights and modules run as they are; the
    attention over the live cache, the scores and the compaction are computed here, in fp32,
    with the model's scaling, logit soft-cap (``softcap``) and attention sinks (``s_aux``).
    Sliding-window layers keep every token and attend over their window: H2O evicts from the
    full-attention layers only, as the engine does.

    ``config``: the H2O budget and cadence; ``None`` keeps every token (a full cache). Each
    sequence's ``Budget`` is resolved from it once (``H2OConfig.budget``), as vLLM resolves it:
    an unset ``interval`` is one KV block of ``block_size`` tokens (the engine's), so
    ``block_size`` is needed then. Every field of the ``Budget`` is honoured:

    - ``heavy``, ``recent``, ``sinks``: at compaction each (layer, KV head) keeps its first
      ``sinks`` live tokens (logical 0..sinks-1, never evicted), its ``recent`` newest and the
      ``heavy`` highest-scoring of the rest (ties keep the more recent); ``recent`` already
      includes the ``min_tokens`` floor. ``tokens`` (= sinks + heavy + recent) is the size
      compacted back to, and with ``interval`` the cadence: compact when, after the prompt,
      ``kv_len >= tokens + interval``.
    - ``scoring``, the score modes (``h2o_vllm.score_modes``), by their oracle rules: queries
      in order, each does ``s(t) <- a * s(t) + w_i * p_i(t)`` for every live token
      (``attend_and_score``; ``a``: ``SequenceState.query_scale``, ``w_i``: ``query_weight``),
      and the first compaction ranks by ``ScoreMode.oracle_rank``; with ``a = 1`` and every
      weight 1 (the paper's H2O) the arithmetic is the plain sum, unchanged. With
      ``score: keydiff`` every compaction ranks by ``KeyDiff.oracle_scores`` of the live keys;
      with ``score: expected`` by ``ExpectedAttention.oracle_scores`` of the live K/V and the
      last step's queries, moved ahead with the model's ``rotary_emb``.

    - ``prefill_chunk``: the prompt is written one chunk per step (``prefill``), the cadence
      checked after each, so a chunk's queries attend over what earlier chunks kept.

    ``stored_kv``: how the engine's cache stores K/V (``oracle.stored_kv``: as computed, or fp8
    with per-tensor scales); the oracle attends over and scores the values read back.

    Each sequence is its own H2O instance (its own prompt length, budget and scores). The prompt
    is one prefill step (one per chunk with ``prefill_chunk``); each later token is one decode step. After each call, ``last_states``
    holds one ``SequenceState`` per sequence: ``state.kv_len`` and, per layer,
    ``state.layers[i].positions`` / ``.scores`` ([num_kv_heads, kv_len]) are the kept tokens.
    """

    def __init__(self, model: torch.nn.Module, config: H2OConfig | None = None, *,
                 block_size: int | None = None, query_chunk: int = DEFAULT_QUERY_CHUNK,
                 stored_kv: StoredKV = StoredKV()) -> None:
        if config is not None and config.interval is None and block_size is None:
            raise ValueError("H2OOracle: the default interval is one KV block; pass block_size "
                             "(the engine's KV block size) or set interval in the config")
        self.model = model
        self.config = config
        self.block_size = block_size
        self.query_chunk = query_chunk
        self.stored_kv = stored_kv
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.last_states: list[SequenceState] = []
        self._rotations: tuple[torch.Tensor, torch.Tensor] | None = None  # _rotate's table

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[list[int]]:
        """Greedy continuation of each prompt: up to ``max_new_tokens`` new token ids per prompt
        (fewer only if ``eos_token_id`` is given and generated; it is included)."""
        return generate_each([(self, prompts)], max_new_tokens, eos_token_id)[0]

    @torch.no_grad()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher-forced log-probabilities [len(continuation)] fp32 of each continuation token,
        with eviction running: the prompt is prefilled (``prefill``), then one token per step."""
        if not prompt:
            raise ValueError("score() needs a non-empty prompt")
        state = self.new_state(len(prompt))
        logprobs = []
        logits = self.prefill(state, prompt)
        for i, token in enumerate(continuation):
            logprobs.append(torch.log_softmax(logits, dim=-1)[token])
            if i + 1 < len(continuation):
                logits = self.step(state, [token])
        self.last_states = [state]
        return torch.stack(logprobs) if logprobs else torch.zeros(0)

    def new_state(self, prompt_len: int) -> SequenceState:
        """An empty sequence whose budget is taken from ``prompt_len``."""
        layers: list[LayerCache | None] = [None] * self.num_layers  # made by the first step
        budget = None if self.config is None else self.config.budget(prompt_len, self.block_size)
        return SequenceState(prompt_len=prompt_len, budget=budget, layers=layers, rotate=self._rotate)

    def _rotate(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own RoPE (its ``rotary_emb``, the full-attention layers' in a hybrid
        model) at positions ``deltas``: (cos, sin) [m, head_dim] fp32, the rotation by each
        position difference. Written apart from the engine's ``score_modes.rotary``; a table
        of positions 0.. is made once and grown as asked (every compaction asks the same)."""
        if self._rotations is None or int(deltas.max()) >= self._rotations[0].shape[0]:
            rotary = next(m for name, m in self.model.named_modules() if name.endswith("rotary_emb"))
            args = ("full_attention",) if getattr(rotary, "layer_types", None) else ()
            positions = torch.arange(max(int(deltas.max()) + 1, 2 * FUTURE_POSITIONS))
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None], *args)
            if not torch.allclose(cos * cos + sin * sin, torch.ones(()), atol=1e-5):
                raise ValueError("the oracle's Expected Attention needs a RoPE that only rotates; "
                                 "this model's scales its cos and sin (an attention factor)")
            self._rotations = (cos[0].float(), sin[0].float())
        return self._rotations[0][deltas], self._rotations[1][deltas]

    @torch.no_grad()
    def prefill(self, state: SequenceState, prompt: list[int]) -> torch.Tensor:
        """The prompt as one step, or with ``prefill_chunk`` C as one step per chunk (tokens
        [0, C), [C, 2C), ..., the rest), each followed by the cadence's check. Returns the
        last step's logits."""
        chunk = state.budget.prefill_chunk if state.budget is not None else None
        chunk = chunk or len(prompt)
        for start in range(0, len(prompt), chunk):
            logits = self.step(state, prompt[start:start + chunk])
        return logits

    @torch.no_grad()
    def step(self, state: SequenceState, token_ids: list[int]) -> torch.Tensor:
        """One H2O step: the model's forward over the new tokens at their logical positions,
        each attention layer writing their K/V, attending and adding scores; then compact if
        due. Returns the fp32 next-token logits [vocab] of the last token."""
        return _step(self.model, [(self, state, token_ids)])[0]

    def _row(self, state: SequenceState, positions: torch.Tensor) -> _Row:
        return _Row(state, positions, state.query_scale(), state.query_weights(positions), self.query_chunk,
                    self.stored_kv)


@torch.no_grad()
def generate_each(jobs: Sequence[tuple[H2OOracle, list[list[int]]]], max_new_tokens: int,
                  eos_token_id: int | None = None) -> list[list[list[int]]]:
    """``H2OOracle.generate`` of each (oracle, prompts) job, the decode steps of every sequence
    of every job run as one batch of the shared model (its linear layers cost about the same
    for one sequence as for a few dozen on a CPU). Each sequence still has its own budget,
    cache and scores, and attends over them alone; the prompts run one by one (their steps
    differ in length). Each oracle's ``last_states`` holds its sequences' states after."""
    if len({id(oracle.model) for oracle, _ in jobs}) > 1:
        raise ValueError("generate_each: the oracles of one batch share one model")
    seqs = [_Sequence(oracle, state, oracle.prefill(state, prompt))
            for oracle, prompts in jobs
            for state, prompt in zip(_new_states(oracle, prompts), prompts)]
    live = seqs
    while live:
        for seq in live:
            seq.tokens.append(int(seq.logits.argmax()))
        live = [seq for seq in live if seq.tokens[-1] != eos_token_id and len(seq.tokens) < max_new_tokens]
        if live:
            batch = [(seq.oracle, seq.state, seq.tokens[-1:]) for seq in live]
            for seq, logits in zip(live, _step(live[0].oracle.model, batch)):
                seq.logits = logits
    outputs, i = [], 0
    for _, prompts in jobs:
        outputs.append([seq.tokens for seq in seqs[i:i + len(prompts)]])
        i += len(prompts)
    return outputs


@dataclass
class _Sequence:
    """One sequence of ``generate_each``: its oracle and state, what it has generated, and the
    logits its next token is taken from."""

    oracle: H2OOracle
    state: SequenceState
    logits: torch.Tensor
    tokens: list[int] = field(default_factory=list)


def _new_states(oracle: H2OOracle, prompts: list[list[int]]) -> list[SequenceState]:
    """The oracle's fresh states for ``prompts``, kept as its ``last_states``."""
    oracle.last_states = [oracle.new_state(len(prompt)) for prompt in prompts]
    return oracle.last_states


def _step(model: torch.nn.Module, batch: Sequence[tuple[H2OOracle, SequenceState, list[int]]]) -> list[torch.Tensor]:
    """One H2O step of each (oracle, state, new tokens) in one forward of ``model``: every
    attention layer writes each sequence's K/V, attends and adds scores over that sequence's
    cache; then each compacts if due. The sequences' new tokens are equally many. Returns each
    one's fp32 next-token logits [vocab] of its last token."""
    rows = tuple(oracle._row(state, torch.arange(state.num_tokens, state.num_tokens + len(tokens)))
                 for oracle, state, tokens in batch)
    kwargs = {"logits_to_keep": 1} if batch[0][0]._keep_last else {}
    with _attention(model), _stepping(rows):
        logits = model(input_ids=torch.tensor([tokens for _, _, tokens in batch]),
                       position_ids=torch.stack([row.positions for row in rows]), use_cache=False,
                       **kwargs).logits
    for (_, state, tokens) in batch:
        state.num_tokens += len(tokens)
        state.compact_if_due()
    return [logits[b, -1].float() for b in range(len(batch))]


@contextlib.contextmanager
def _attention(model: torch.nn.Module):
    """The oracle's attention installed for one step, the model's own restored after (the
    caller's model stays usable as it was)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def _stepping(rows: tuple[_Row, ...]):
    token = _STEP.set(rows)
    try:
        yield
    finally:
        _STEP.reset(token)
