"""Tiny EAGLE drafters for the speculative tests: a one-layer Llama target and EAGLE heads for
it, built from its own weights.

A random EAGLE head drafts nothing the target accepts, and an accepted draft is what the
exactness tests must see. So the target is built so that an EAGLE-1 head can mirror it: vLLM's
EAGLE-1 Llama head (``EagleLlamaForCausalLM``) feeds ``fc([token embedding | target hidden])``
to a decoder layer without an input norm, then the target's output head. With ``fc`` passing
the embedding and dropping the hidden state, and the head's layer a copy of the target's only
layer, the head computes the target's layer whenever that layer's input norm is the identity:
every embedding row with RMS 1 and every norm weight 1 (the final norm then only scales, and
the argmax stays). Over its own whole KV cache the head drafts what the dense target would
generate, so under H2O a draft is accepted exactly where eviction left the token unchanged.

An EAGLE-3 head (``Eagle3LlamaForCausalLM``) reads the target's hidden states of the token
before, so it cannot mirror a layer this way: ``build_eagle3_head`` is random (its drafts are
rejected; the tests check the plumbing and exactness with it).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from h2o_devtools.models.tiny import build_tiny_llama


def build_mirrored_llama(out_dir: str | os.PathLike, **sizes) -> Path:
    """``build_tiny_llama`` (one layer unless ``sizes`` say otherwise) with every embedding row
    scaled to RMS 1 and every norm weight 1. The pad row, zero at initialisation, gets a
    random row first: scaled, a zero row would be NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    out = build_tiny_llama(out_dir, **{"num_layers": 1, **sizes})
    weights = load_file(out / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    zero = embed.pow(2).sum(-1) == 0
    generator = torch.Generator().manual_seed(1)
    embed[zero] = torch.randn(int(zero.sum()), embed.shape[1], generator=generator)
    weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = torch.ones_like(weights[name])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def build_eagle_head(target_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """An EAGLE-1 head for a Llama target: the target's layer 0 (without its input norm, which
    EAGLE-1 heads lack) and ``fc = [I | 0]``. For ``build_mirrored_llama``'s target it drafts
    what the dense target generates; for another Llama, something less."""
    import torch
    from safetensors.torch import load_file, save_file

    target, out = Path(target_dir), Path(out_dir)
    weights = load_file(target / "model.safetensors")
    head = {name.removeprefix("model."): w for name, w in weights.items()
            if name.startswith("model.layers.0.") or name == "model.embed_tokens.weight"}
    del head["layers.0.input_layernorm.weight"]
    hidden = head["embed_tokens.weight"].shape[1]
    head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    out.mkdir(parents=True, exist_ok=True)
    save_file(head, out / "model.safetensors", metadata={"format": "pt"})
    _copy_configs(target, out, num_hidden_layers=1)
    return out


def build_eagle3_head(target_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A random EAGLE-3 head for a Llama target of three or more layers (one decoder layer over
    [embedding | fc of the inputs of the target's last three layers], the target's vocabulary):
    drafts that are rejected."""
    import torch
    from safetensors.torch import save_file

    target, out = Path(target_dir), Path(out_dir)
    config = json.loads((target / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = config.get("head_dim") or hidden // heads, config["intermediate_size"]
    num_layers = config["num_hidden_layers"]
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head reads three target layers; the target has {num_layers}")
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * config.get("initializer_range", 0.02)

    head = {"fc.weight": rand(hidden, 3 * hidden),
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.hidden_norm.weight": torch.ones(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
            "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
            "midlayer.mlp.up_proj.weight": rand(inter, hidden),
            "midlayer.mlp.down_proj.weight": rand(hidden, inter),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": rand(config["vocab_size"], hidden)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(head, out / "model.safetensors", metadata={"format": "pt"})
    _copy_configs(target, out, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                  draft_vocab_size=config["vocab_size"],
                  eagle_aux_hidden_state_layer_ids=list(range(num_layers - 3, num_layers)))
    return out


def _copy_configs(target: Path, out: Path, **config_changes) -> None:
    """The target's tokenizer files, and its config with ``config_changes``."""
    for path in target.iterdir():
        if path.suffix == ".json" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    config = json.loads((target / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_changes}, indent=2))
