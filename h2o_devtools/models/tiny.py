"""Tiny random causal LMs of each family the engine is tested on, with a locally trained
byte-level BPE: seconds to build, same seed same bytes."""

from __future__ import annotations

import os
import random
from pathlib import Path

from h2o_devtools.models.files import save_tokenizer

# Debian ships this on every machine; real English gives the tiny tokenizer realistic merges.
_TINY_CORPUS = Path("/usr/share/common-licenses/GPL-3")
_TINY_SPECIAL = "<|endoftext|>"


#: Tiny random models of each family the engine is tested on: (config class, model class,
#: the family's own settings). Every family gets the same sizes from ``build_tiny_model``.
TINY_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v projection biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # qk-norm
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate/up projections
    # Soft-capped attention logits; every layer global (a tiny hybrid Gemma is "gemma3").
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_logit_softcapping": 20.0,
                                                     "final_logit_softcapping": 30.0,
                                                     "tie_word_embeddings": True}),  # vLLM ties them
    # Hybrid: sliding-window layers (vLLM keeps their window) and full-attention ones (H2O's),
    # alternating, the last one full; a 24-token window that the tests' prompts outgrow.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 24, "tie_word_embeddings": True}),
    # The paper's other two families: learned absolute positions, no GQA; partial rotary and a
    # parallel residual.
    "opt": ("OPTConfig", "OPTForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25, "use_parallel_residual": True}),
    # Learned sink logits in every softmax, mixture-of-experts MLPs, YaRN RoPE, and hybrid like
    # gemma3 (vLLM and transformers both slide the even layers).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"sliding_window": 24, "num_local_experts": 4,
                                                     "num_experts_per_tok": 2}),
}

#: Families that multiply embeddings by sqrt(hidden_size) and tie the output head (Gemma): at
#: the common init each token's own embedding outweighs everything attention adds, so every
#: greedy step repeats the input token whatever is evicted. Their embeddings are shrunk by this.
_EMBED_SHRINK = {"gemma2": 0.1, "gemma3": 0.1}

#: Families with learned attention-sink logits (gpt-oss), drawn from N(mean, std) instead of
#: the common init's ~0.02, which next to logits of std ~5 takes no share of any softmax: a
#: sink left out of the scores or the output would go unseen.
_SINK_INIT = {"gpt_oss": (4.0, 1.0)}

def _family_config(family: str, *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, intermediate_size: int, vocab_size: int, init_std: float,
                   max_position_embeddings: int, eos_id: int) -> dict:
    """The config kwargs of one family at the given sizes (OPT and GPT-NeoX: no GQA, and
    head_dim = hidden_size / num_heads)."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, max_position_embeddings=max_position_embeddings,
                  bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                  tie_word_embeddings=False)
    if family == "opt":
        return {**common, "ffn_dim": intermediate_size, "word_embed_proj_dim": hidden_size, "init_std": init_std}
    if family == "gpt_neox":
        return {**common, "intermediate_size": intermediate_size, "initializer_range": init_std}
    kwargs = {**common, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
              "intermediate_size": intermediate_size, "initializer_range": init_std}
    if family == "gemma2":
        # Every layer global; transformers' Gemma 2 still builds a sliding mask, so the window is
        # set, as long as the model.
        kwargs.update(query_pre_attn_scalar=head_dim, layer_types=["full_attention"] * num_layers,
                      sliding_window=max_position_embeddings)
    if family == "gemma3":
        kwargs.update(query_pre_attn_scalar=head_dim, layer_types=[
            "full_attention" if (num_layers - 1 - i) % 2 == 0 else "sliding_attention" for i in range(num_layers)])
    return kwargs


def build_tiny_model(
    out_dir: str | os.PathLike,
    family: str = "llama",
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    init_std: float = 0.2,
    seed: int = 0,
    max_position_embeddings: int = 4096,
    layer_types: list[str] | None = None,
) -> Path:
    """Save a tiny random causal LM of ``family`` (``TINY_FAMILIES``; fp32) plus a locally
    trained byte-level BPE.

    `init_std` is the normal std of every linear and embedding weight. At 0.2 (10x Llama's 0.02)
    attention logits have std ~5, so each query attends to a few keys: heavy hitters are
    well separated and H2O's keep/evict choices are not decided by float noise. `head_dim` must be
    one vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...). `layer_types` replaces a
    hybrid family's pattern ("full_attention" / "sliding_attention" per layer). Same seed, same
    bytes.
    """
    import torch
    import transformers

    config_class, model_class, own = TINY_FAMILIES[family]
    out = Path(out_dir)
    tokenizer = _tiny_tokenizer(vocab_size, max_position_embeddings)
    eos_id = tokenizer.convert_tokens_to_ids(_TINY_SPECIAL)
    kwargs = _family_config(family, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                            vocab_size=vocab_size, init_std=init_std,
                            max_position_embeddings=max_position_embeddings, eos_id=eos_id)
    if layer_types is not None:
        kwargs["layer_types"] = list(layer_types)
    config = getattr(transformers, config_class)(**{**kwargs, **own})
    config.dtype = torch.float32
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
        if family in _SINK_INIT:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.normal_(*_SINK_INIT[family])
    if family in _EMBED_SHRINK:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(_EMBED_SHRINK[family])
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    return out


#: The tiny tokenizer has no chat template: serve with ``--chat-template`` this.
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def build_tiny_llama(out_dir: str | os.PathLike, **sizes) -> Path:
    """``build_tiny_model`` of the Llama family: the exactness tests' model."""
    return build_tiny_model(out_dir, "llama", **sizes)


def _tiny_tokenizer(vocab_size: int, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[_TINY_SPECIAL], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    # The model's embedding has vocab_size rows; ids the tokenizer cannot decode would make
    # detokenizing random generations fail, so the two must agree exactly.
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is more than the tiny corpus yields "
                         f"({tok.get_vocab_size()} tokens)")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=_TINY_SPECIAL, eos_token=_TINY_SPECIAL,
        unk_token=_TINY_SPECIAL, pad_token=_TINY_SPECIAL, add_bos_token=False,
        model_input_names=["input_ids", "attention_mask"], clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def _tiny_corpus() -> list[str]:
    if _TINY_CORPUS.is_file():
        return _TINY_CORPUS.read_text(encoding="utf-8").splitlines()
    # Fallback for non-Debian machines: pseudo-words with enough distinct letter pairs for a few
    # hundred merges; seeded, so the tokenizer stays deterministic.
    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    weights = [1.0 / (rank + 1) for rank in range(len(letters))]
    lines = []
    for _ in range(2000):
        words = ("".join(rng.choices(letters, weights, k=rng.randint(1, 8)))
                 for _ in range(rng.randint(5, 15)))
        lines.append(" ".join(words) + f" {rng.randint(0, 9999)}.")
    return lines
