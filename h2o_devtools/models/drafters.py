"""Tiny drafters for the speculative tests: one-layer targets, and EAGLE heads and MTP layers
for them built from their own weights.

A random drafter drafts nothing the target accepts, and an accepted draft is what the
exactness tests must see. So the target is built so that an EAGLE-1 head can mirror it: vLLM's
EAGLE-1 Llama head (``EagleLlamaForCausalLM``) feeds ``fc([token embedding | target hidden])``
to a decoder layer without an input norm, then the target's output head. With ``fc`` passing
the embedding and dropping the hidden state, and the head's layer a copy of the target's only
layer, the head computes the target's layer whenever that layer's input norm is the identity:
every embedding row with RMS 1 and every norm weight 1 (the final norm then only scales, and
the argmax stays). Over its own whole KV cache the head drafts what the dense target would
generate, so under H2O a draft is accepted exactly where eviction left the token unchanged.

An EAGLE-3 head (``Eagle3LlamaForCausalLM``) adds its layer's output to the target's hidden
states of the token before, not to the token's embedding, so it mirrors only a target built for
it (``build_mirrored_eagle3_pair``: the target's greedy token ignores its residual stream).

An MTP layer mirrors as an EAGLE-1 head does: ``build_mtp_target`` is a one-layer MiMo model (a Qwen2 with
``model.mtp_layers``, the MTP family vLLM's CPU engine runs; DeepSeek's needs MLA, Qwen3-Next's
linear attention). Its MTP layer projects ``[target hidden | normed embedding]`` with
``[0 | I]`` into a copy of the target's layer, so it too computes the target's layer on the
next token's embedding.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from h2o_devtools.models.tiny import build_tiny_llama, build_tiny_model


def build_mirrored_llama(out_dir: str | os.PathLike, **sizes) -> Path:
    """``build_tiny_llama`` (one layer unless ``sizes`` say otherwise) with every embedding row
    scaled to RMS 1 and every norm weight 1."""
    from safetensors.torch import save_file

    out = build_tiny_llama(out_dir, **{"num_layers": 1, **sizes})
    save_file(_mirrored(out), out / "model.safetensors", metadata={"format": "pt"})
    return out


def build_mtp_target(out_dir: str | os.PathLike, **sizes) -> Path:
    """A one-layer MiMo model (``MiMoForCausalLM``: Qwen2 weights plus one MTP layer) whose MTP
    layer mirrors its layer, for ``--speculative-config '{"method": "mtp"}'``. transformers
    loads it as the Qwen2 it is (the MTP weights unused), so the oracle runs it unchanged."""
    import torch
    from safetensors.torch import save_file

    out = build_tiny_model(out_dir, "qwen2", **{"num_layers": 1, **sizes})
    weights = _mirrored(out)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    for name in [n for n in weights if n.startswith("model.layers.0.")]:
        weights["model.mtp_layers.0." + name.removeprefix("model.layers.0.")] = weights[name].clone()
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"model.mtp_layers.0.{norm}.weight"] = torch.ones(hidden)
    # vLLM's MiMo MTP layer concatenates [previous hidden | token embedding].
    weights["model.mtp_layers.0.input_proj.weight"] = torch.cat([torch.zeros(hidden, hidden),
                                                                 torch.eye(hidden)], dim=1)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _mirrored(model_dir: Path) -> dict:
    """The model's weights with every embedding row scaled to RMS 1 and every norm weight 1.
    The pad row, zero at initialisation, gets a random row first: scaled, a zero row would be
    NaN."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    zero = embed.pow(2).sum(-1) == 0
    generator = torch.Generator().manual_seed(1)
    embed[zero] = torch.randn(int(zero.sum()), embed.shape[1], generator=generator)
    weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = torch.ones_like(weights[name])
    return weights


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


def build_mirrored_eagle3_pair(target_dir: str | os.PathLike, head_dir: str | os.PathLike,
                               dead_layers: int = 0, **sizes) -> tuple[Path, Path]:
    """A one-layer Llama target and an EAGLE-3 head that mirrors it (``"method": "eagle3"``).
    With ``dead_layers`` the target has that many more layers, whose attention runs (H2O
    scores and evicts there) but writes nothing (o_proj and MLP 0): the target's tokens stay
    the first layer's, and vLLM splits the target into one KV-cache group per layer beside
    the head's, as it does a real target beside a one-layer head.

    vLLM's EAGLE-3 head (``Eagle3LlamaForCausalLM``) runs one decoder layer whose attention
    reads ``[input_layernorm(next token's embedding) | hidden_norm(fc(target's aux hidden
    states))]`` and whose residual is ``fc(aux hidden states)``, not the embedding: unlike an
    EAGLE-1 head it cannot add the token's embedding back as the target's layer does. So the
    target's logits are made independent of that residual by splitting the hidden dims in two
    halves: every embedding row lives in the first half only (RMS 1 over all dims, so with every
    norm weight 1 the input norm is the identity), the layer's attention writes (o_proj rows)
    into the second half only, its MLP is zero (down_proj 0), and the output head reads the
    second half only (lm_head's first-half columns 0). The final norm only scales, so the
    greedy token is argmax(lm_head @ attention output).

    The head: fc = 0 (the residual and hidden_norm's input are 0), q/k/v = [the target's | 0]
    over the 2H-wide input, o_proj and lm_head the target's, MLP 0, every norm weight 1, the
    target's vocabulary (no d2t; the embedding is the target's, shared by vLLM). Its first draft
    step computes the target's layer on the next token's embedding over its own whole KV cache:
    it drafts what the dense target generates. Later steps carry the previous step's attention
    output as their residual and are mostly rejected. The aux hidden state is layer 1's output
    (ids count the embedding as 0), named in ``eagle_config``: the runner reads the ids there or
    at the top level, but the head sizes fc from ``eagle_config`` only (3 layers otherwise).
    No "eagle" in ``target_dir``'s path (vLLM takes a draft model whose path says "eagle" for an
    EAGLE head)."""
    import torch
    from safetensors.torch import save_file

    target, out = build_tiny_llama(target_dir, **{**sizes, "num_layers": 1 + dead_layers}), Path(head_dir)
    weights = _mirrored(target)
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    half = hidden // 2
    embed[:, half:] = 0
    weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    weights["model.layers.0.self_attn.o_proj.weight"][:half] = 0
    weights["model.layers.0.mlp.down_proj.weight"].zero_()
    for dead in range(1, 1 + dead_layers):
        weights[f"model.layers.{dead}.self_attn.o_proj.weight"].zero_()
        weights[f"model.layers.{dead}.mlp.down_proj.weight"].zero_()
    weights["lm_head.weight"][:, :half] = 0
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})

    aux_layers = [1]
    layer = {name.removeprefix("model.layers.0."): w for name, w in weights.items()
             if name.startswith("model.layers.0.")}
    head = {"fc.weight": torch.zeros(hidden, hidden * len(aux_layers)),
            "midlayer.hidden_norm.weight": torch.ones(hidden),
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
            "midlayer.self_attn.o_proj.weight": layer["self_attn.o_proj.weight"].clone(),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": weights["lm_head.weight"].clone()}
    for proj in ("q_proj", "k_proj", "v_proj"):
        w = layer[f"self_attn.{proj}.weight"]
        head[f"midlayer.self_attn.{proj}.weight"] = torch.cat([w, torch.zeros_like(w)], dim=1)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        head[f"midlayer.mlp.{proj}.weight"] = torch.zeros_like(layer[f"mlp.{proj}.weight"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(head, out / "model.safetensors", metadata={"format": "pt"})
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    _copy_configs(target, out, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                  draft_vocab_size=vocab, eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers})
    return target, out


def _copy_configs(target: Path, out: Path, **config_changes) -> None:
    """The target's tokenizer files, and its config with ``config_changes``."""
    for path in target.iterdir():
        if path.suffix == ".json" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    config = json.loads((target / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_changes}, indent=2))
