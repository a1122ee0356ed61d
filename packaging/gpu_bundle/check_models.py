"""The GPU check's models, built on the machine (no model can travel: gpu-device.md).

- ``tiny-llama/``: the tests' tiny random GQA Llama with saved weights
  (``h2o_devtools.models.build_tiny_llama``): exactness against the dense oracle and the load check.
- ``llama-8b-shape/``: ``config.json`` of a Llama-3-8B-shaped model (bf16) and a real tokenizer,
  no weights: vLLM's ``--load-format dummy`` fills random weights on the GPU. Throughput needs
  a real-sized model so that KV memory, not compute, bounds stock vLLM.

    python -m gpu_bundle.check_models --out DIR [--tokenizer .gpu-bundle/tokenizer]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

# Llama-3-8B's layer shapes (hidden 4096, 32 layers, GQA 32/8, head 128, MLP 14336, RoPE base
# 5e5). The vocabulary is the carried tokenizer's: random token ids must decode.
LLAMA_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "initializer_range": 0.02, "dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_size(tokenizer_json: Path) -> int:
    """Number of token ids the tokenizer can produce (vocabulary plus added tokens)."""
    doc = json.loads(tokenizer_json.read_text())
    ids = list(doc["model"]["vocab"].values()) + [t["id"] for t in doc.get("added_tokens", [])]
    return max(ids) + 1


def build_llama_8b_shape(out: Path, tokenizer_dir: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    ids = {k: added.get(tok_config.get(k.replace("_id", ""))) for k in ("bos_token_id", "eos_token_id")}
    config = {**LLAMA_8B_SHAPE, "vocab_size": tokenizer_size(tokenizer_dir / "tokenizer.json"),
              **{k: v for k, v in ids.items() if v is not None}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def default_tokenizer_dir() -> Path:
    """Without a bundle (vLLM installed): the project's SmolLM2 directory holds the same files."""
    from h2o_devtools import models
    return models.smollm2_dir()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=None, help="folder with tokenizer.json")
    a = p.parse_args(argv)
    from h2o_devtools import models

    tiny = models.build_tiny_llama(a.out / "tiny-llama")
    tokenizer = a.tokenizer if a.tokenizer and a.tokenizer.is_dir() else default_tokenizer_dir()
    big = build_llama_8b_shape(a.out / "llama-8b-shape", tokenizer)
    # Both load as Hugging Face folders, as vLLM will load them (config and tokenizer only).
    from transformers import AutoConfig, AutoTokenizer
    for folder in (tiny, big):
        config, tok = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        assert len(tok) <= config.vocab_size, (folder, len(tok), config.vocab_size)
        print(f"{folder}: {config.model_type}, {config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}, vocab {config.vocab_size}, tokenizer {len(tok)}")


if __name__ == "__main__":
    main()
