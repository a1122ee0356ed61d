"""The dense H2O oracle: a Hugging Face Llama-family causal LM run layer by layer with real
eviction of K/V (ARCHITECTURE.md, "What H2O is, precisely"). Runs in the caller's process; no vLLM.
"""
from __future__ import annotations

import torch

from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle.attention import DEFAULT_QUERY_CHUNK, attend_and_score
from h2o_vllm.oracle.cache import LayerCache, SequenceState


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class H2OOracle:
    """Greedy generation and teacher-forced scoring with H2O eviction, one sequence at a time.

    ``model``: a Hugging Face causal LM of the Llama family (``LlamaForCausalLM`` and lookalikes:
    ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and ``model.lm_head``; each layer
    with ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp``;
    GQA, projection biases and ``q_norm``/``k_norm`` are honoured). Only its weights and
    submodules are used: attention, scores and compaction are computed here, in fp32.

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
    - ``decay`` and ``query_weight`` (``obs_window``): queries in order, each does
      ``s(t) <- decay * s(t) + w_i * p_i(t)`` for every live token (``attend_and_score``); with
      decay 1 and every weight 1 (the paper's H2O) the arithmetic is the plain sum, unchanged.

    - ``prefill_chunk``: the prompt is written one chunk per step (``prefill``), the cadence
      checked after each, so a chunk's queries attend over what earlier chunks kept.

    Each sequence is its own H2O instance (its own prompt length, budget and scores). The prompt
    is one prefill step (one per chunk with ``prefill_chunk``); each later token is one decode step. After each call, ``last_states``
    holds one ``SequenceState`` per sequence: ``state.kv_len`` and, per layer,
    ``state.layers[i].positions`` / ``.scores`` ([num_kv_heads, kv_len]) are the kept tokens.
    """

    def __init__(self, model: torch.nn.Module, config: H2OConfig | None = None, *,
                 block_size: int | None = None, query_chunk: int = DEFAULT_QUERY_CHUNK) -> None:
        if config is not None and config.interval is None and block_size is None:
            raise ValueError("H2OOracle: the default interval is one KV block; pass block_size "
                             "(the engine's KV block size) or set interval in the config")
        self.model = model
        self.config = config
        self.block_size = block_size
        self.query_chunk = query_chunk
        hf = model.config
        self.num_q_heads = hf.num_attention_heads
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or self.num_q_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // self.num_q_heads
        self.scaling = self.head_dim ** -0.5
        self.last_states: list[SequenceState] = []

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[list[int]]:
        """Greedy continuation of each prompt: up to ``max_new_tokens`` new token ids per prompt
        (fewer only if ``eos_token_id`` is given and generated; it is included)."""
        outputs, self.last_states = [], []
        for prompt in prompts:
            state = self.new_state(len(prompt))
            generated: list[int] = []
            logits = self.prefill(state, prompt)
            while len(generated) < max_new_tokens:
                token = int(logits.argmax())
                generated.append(token)
                if token == eos_token_id or len(generated) == max_new_tokens:
                    break
                logits = self.step(state, [token])
            outputs.append(generated)
            self.last_states.append(state)
        return outputs

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
        layers = [LayerCache(self.num_kv_heads, self.head_dim, capacity=prompt_len + 64)
                  for _ in self.model.model.layers]
        budget = None if self.config is None else self.config.budget(prompt_len, self.block_size)
        return SequenceState(prompt_len=prompt_len, budget=budget, layers=layers)

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
        """One H2O step: write the tokens' K/V, attend, add scores, compact if due.
        Returns the fp32 next-token logits [vocab] of the last token."""
        body = self.model.model
        positions = torch.arange(state.num_tokens, state.num_tokens + len(token_ids))
        hidden = body.embed_tokens(torch.tensor([token_ids]))  # [1, num_new, hidden]
        # RoPE at logical positions; cos, sin: [1, num_new, head_dim]
        cos, sin = body.rotary_emb(hidden, positions.unsqueeze(0))
        decay = 1.0 if state.budget is None else state.budget.decay
        weights = state.query_weights(positions)  # None: every query counts fully
        for layer, cache in zip(body.layers, state.layers):
            residual = hidden
            attn_in = layer.input_layernorm(hidden)
            hidden = residual + self._attention(layer.self_attn, attn_in, cache, positions, cos[0], sin[0],
                                                decay, weights)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        state.num_tokens += len(token_ids)
        state.compact_if_due()
        return self.model.lm_head(body.norm(hidden[:, -1])).float()[0]

    def _attention(self, attn, hidden: torch.Tensor, cache: LayerCache, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, decay: float = 1.0,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
        num_new = hidden.shape[1]

        def heads(proj, num_heads, norm=None):  # -> [num_heads, num_new, head_dim]
            x = proj(hidden)[0].view(num_new, num_heads, self.head_dim)
            if norm is not None:
                x = norm(x)
            return x.transpose(0, 1).float()

        q = heads(attn.q_proj, self.num_q_heads, getattr(attn, "q_norm", None))
        k = heads(attn.k_proj, self.num_kv_heads, getattr(attn, "k_norm", None))
        v = heads(attn.v_proj, self.num_kv_heads)
        cos, sin = cos.float(), sin.float()
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.append(k, v, positions)
        # out: [num_new, q_heads * head_dim]
        out = attend_and_score(q, cache, self.scaling, self.query_chunk, decay=decay, weights=weights)
        return attn.o_proj(out.to(hidden.dtype).unsqueeze(0))
