"""The model's rotary embedding as a rotation by a position difference, for scores that move
post-RoPE queries ahead (docs/semantics.md, "Expected Attention").

Pure: stdlib and torch; reads the HF config only (the worker's source; the oracle rotates with
the transformers model's own ``rotary_emb``). RoPE rotates each pair ``(x_j, x_{j + d/2})``
(the "neox" layout, HF's ``rotate_half``) by ``position * inv_freq[j]``, so a query rotated
for position ``p`` is rotated for ``p + delta`` by a rotation of ``delta * inv_freq`` alone.
That holds for the rope types whose rotation is a pure function of the position (``default``,
``linear``); the others (scaled by the sequence length, or with a magnitude factor) are
refused here with a message, as are models whose RoPE is not the neox layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: HF ``model_type``s whose attention applies RoPE with ``rotate_half`` over the whole head
#: (vLLM: ``is_neox_style=True``): the models whose rotation ``Rotary`` states.
NEOX_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text")
#: Rope types whose rotation depends on the position alone, with no magnitude factor.
ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True)
class Rotary:
    inv_freq: torch.Tensor  # [head_size // 2] fp32: the angle per position of each pair

    def cos_sin(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[len(deltas), head_size] fp32 cos and sin of the rotation by each position
        difference, each pair's angle repeated over its two halves (HF's layout)."""
        angles = deltas.to(torch.float32)[:, None] * self.inv_freq[None, :].to(deltas.device)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotary_of(hf_text_config: Any, key: str = "h2o.score") -> Rotary:
    """The rotation of the model's full-attention layers, or ``ValueError`` naming ``key`` and
    why this model's RoPE cannot be moved ahead."""
    model_type = getattr(hf_text_config, "model_type", None)
    way_out = f"choose another {key} ('h2o' or 'keydiff')"
    if model_type not in NEOX_MODEL_TYPES:
        raise ValueError(f"{key} 'expected' moves queries ahead with the model's RoPE, written here for "
                         f"the rotate-half layout of {', '.join(NEOX_MODEL_TYPES)}; model_type "
                         f"{model_type!r} is not among them: {way_out}")
    params = _rope_parameters(hf_text_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{key} 'expected' needs a RoPE whose rotation depends on the position alone "
                         f"(rope_type {' or '.join(ROPE_TYPES)}); this model's is {rope_type!r}: {way_out}")
    if getattr(hf_text_config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(f"{key} 'expected' needs RoPE over the whole head; this model rotates "
                         f"{hf_text_config.partial_rotary_factor} of it: {way_out}")
    head_size = getattr(hf_text_config, "head_dim", None) or (
        hf_text_config.hidden_size // hf_text_config.num_attention_heads)
    # HF's default rope init, in the same dtype steps (int64 exponents, fp32 division).
    inv_freq = 1.0 / (float(params["rope_theta"]) ** (
        torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    return Rotary(inv_freq)


def rotary_or_none(model_config: Any) -> Rotary | None:
    """``rotary_of`` the model of vLLM's ``ModelConfig``, or None where it is refused (or the
    config is not there: a unit test's layer)."""
    hf = getattr(model_config, "hf_text_config", None)
    try:
        return None if hf is None else rotary_of(hf)
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


def _rope_parameters(hf_text_config: Any) -> dict:
    """The full-attention layers' rope parameters: transformers 5's ``rope_parameters`` (per
    layer type in hybrid models such as Gemma 3), else ``rope_theta`` and ``rope_scaling``."""
    params = getattr(hf_text_config, "rope_parameters", None)
    if params:
        return dict(params.get("full_attention", params))
    scaling = dict(getattr(hf_text_config, "rope_scaling", None) or {})
    return {"rope_theta": getattr(hf_text_config, "rope_theta", 10000.0), **scaling}
