"""Stand-in for ``vllm._C_stable_libtorch`` (vLLM's compiled CUDA op library) in the GPU bundle.

Why it exists: the GPU machine cannot take the CUDA ``vllm`` wheel (311 MiB, and it pins another
torch), so the bundle carries vLLM's Python files without their compiled extensions
(``packaging/gpu_bundle/README.md``). ``vllm.platforms.cuda`` imports this module
unconditionally to register the ``torch.ops._C`` ops. With custom ops off and eager execution a
Llama still reaches a few of them directly, so this module registers plain torch bodies for
those and answers vLLM's capability queries (cutlass and friends) with "unsupported", which
sends vLLM down its non-cutlass paths. Every other ``_C`` op stays missing and fails loudly
where it is called: the bundle is for dense Llama models on vLLM's Triton attention only.

The bodies are written from each op's schema and vLLM's Python reference implementations
(``vllm.ir.ops`` rms norms, ``SiluAndMul.forward_native``, ``RotaryEmbedding.forward_static``,
``apply_repetition_penalties_torch``) and are tested against them on the CPU
(``tests/unit/packaging/test_gpu_bundle_standins.py``). They favour being obviously right over speed.
"""
from __future__ import annotations

import torch

NAMESPACE = "_C"


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
             epsilon: float) -> None:
    out.copy_(_rms(input.float(), weight, epsilon).to(out.dtype))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       epsilon: float) -> None:
    # In place, as the CUDA kernel: residual <- input + residual, input <- rms_norm(that sum).
    total = input.float() + residual.float()
    residual.copy_(total.to(residual.dtype))
    # The norm reads the sum rounded to the activation dtype, as vLLM's native reference does.
    input.copy_(_rms(residual.float(), weight, epsilon).to(input.dtype))


def _rms(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return x if weight is None else x.to(weight.dtype) * weight


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    half = input.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(input[..., :half]) * input[..., half:])


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                     rope_dim_offset: int = 0, inverse: bool = False) -> None:
    # cos_sin_cache rows are [cos | sin] for one position, rot_dim values in all; the rotated
    # slice of each head is [rope_dim_offset, rope_dim_offset + rot_dim). Rotates in place.
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    if inverse:
        sin = -sin
    rot_dim = cos_sin_cache.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(positions.numel(), -1, head_size)
        part = heads[..., rope_dim_offset:rope_dim_offset + rot_dim]
        c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        if is_neox:  # halves: (x1, x2) = first and second half of the rotated slice
            x1, x2 = part.chunk(2, dim=-1)
            rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:  # GPT-J: interleaved pairs (even, odd)
            x1, x2 = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        part.copy_(rotated)


def apply_repetition_penalties_(logits: torch.Tensor, prompt_mask: torch.Tensor,
                                output_mask: torch.Tensor,
                                repetition_penalties: torch.Tensor) -> None:
    # Tokens seen in the prompt or output: positive logits divided by the penalty, others
    # multiplied by it; unseen tokens untouched.
    seen = prompt_mask | output_mask
    penalty = repetition_penalties.unsqueeze(1).to(logits.dtype).expand_as(logits)
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, scaled, logits))


def unsupported(cuda_device_capability: int) -> bool:
    """Capability queries: no cutlass / FP8 / FP4 kernels exist in the bundle."""
    return False


# name -> (schema, body). Schemas are those of vLLM 0.32's CUDA build (csrc/torch_bindings.cpp),
# so vLLM's Python wrappers call these exactly as they would call the compiled ops.
OPS = {
    "rms_norm": ("(Tensor! out, Tensor input, Tensor? weight, float epsilon) -> ()", rms_norm),
    "fused_add_rms_norm": ("(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
                           fused_add_rms_norm),
    "silu_and_mul": ("(Tensor! out, Tensor input) -> ()", silu_and_mul),
    "rotary_embedding": ("(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
                         "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, "
                         "bool inverse=False) -> ()", rotary_embedding),
    "apply_repetition_penalties_": ("(Tensor! logits, Tensor prompt_mask, Tensor output_mask, "
                                    "Tensor repetition_penalties) -> ()",
                                    apply_repetition_penalties_),
}
CAPABILITY_QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                      "cutlass_scaled_mm_supports_fp4", "cutlass_group_gemm_supported",
                      "mxfp4_experts_quant_supported")


def register(namespace: str = NAMESPACE) -> torch.library.Library:
    """Define and implement the ops under ``torch.ops.<namespace>``; keep the returned library
    alive (its ops are unregistered when it is garbage-collected)."""
    lib = torch.library.Library(namespace, "FRAGMENT")
    for name, (schema, body) in OPS.items():
        lib.define(name + schema)
        lib.impl(name, body, "CompositeExplicitAutograd")
    for name in CAPABILITY_QUERIES:
        lib.define(f"{name}(int cuda_device_capability) -> bool")
        lib.impl(name, unsupported, "CompositeExplicitAutograd")
    return lib


# Registers only when imported under vLLM's name (inside the bundle); tests load this file under
# another name and register into a namespace of their own.
if __name__ == "vllm._C_stable_libtorch":
    _LIBRARY = register()
