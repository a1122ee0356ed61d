"""Compile, without a GPU, the Triton kernels the GPU check's engines launch, for the H200 (sm_90).

Why: the GPU machine's Triton (3.6) is older than the one vLLM 0.32 ships with, and a kernel
that fails to compile there stops every engine minutes into a scarce GPU call. Triton can compile
for a named target on any machine (its wheel carries ptxas), so the dry run does it first:
H2O's per-layer step (fused attention, score accumulation, compaction) and vLLM's ``reshape_and_cache_flash``,
``unified_attention`` (2D and 3D / segment reduction) and the runner's slot mapping, at the
throughput model's shapes (bf16, head 128, GQA 4) and the tests' tiny Llama's (fp32, head 32,
GQA 2). Kernels are compiled, never launched, so the CPU tensors are only read for their dtypes
and strides.

How: a stand-in Triton driver that names the target, ``JITFunction.run`` forced to warm up
(compile only), and ``torch.cuda`` device queries answered as an H200. Both are Triton and torch
internals, patched in this process only; this is a rehearsal tool, not runtime code.

    python -m gpu_bundle.triton_aot        # exit 1 if any kernel fails to compile
"""
from __future__ import annotations

import os
import sys
import traceback

# vLLM disables Triton when no GPU driver is active, except while the visible-device list is
# empty (its distributed start-up case): that keeps its real Triton kernels importable here.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED: list[str] = []


class _TargetOnlyDriver:
    """Enough of a Triton driver to compile for one target; launching is never reached."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _H200:
    name, major, minor, multi_processor_count, warp_size = "NVIDIA H200 (compile only)", 9, 0, 132, 32
    total_memory, max_shared_memory_per_block_optin = 143 * 2**30, 232448


def install(arch: int = 90) -> None:
    driver.set_active(_TargetOnlyDriver(arch))
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append(f"{self.fn.__module__}.{self.fn.__name__}")
        return kernel

    JITFunction.run = compile_only
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)
    torch.cuda.get_device_properties = lambda *a, **k: _H200()
    torch.cuda.current_device = lambda: 0


def h2o_step(rows, kv_len, q_len, due, kv_heads, group, head, dtype, block=16, fused=False,
             decay=1.0):
    """One layer's update_scores_and_compact (as benchmarks/cuda_step_timing.py builds it);
    fused: after the CUDA path's fused attention (TritonOps.attend), as the engine runs it."""
    from h2o_vllm.config import Budget
    from h2o_vllm.worker.cuda.ops import TritonOps
    from h2o_vllm.worker.plan import kv_slot_mapping, make_step_plan
    from h2o_vllm.worker.step import make_step, update_scores_and_compact

    def t(v):
        return torch.full((rows,), v, dtype=torch.int64)
    if q_len > 1:
        computed, prompt, budget = 0, q_len, kv_len
    else:
        prompt, budget = 64, kv_len - (block if due else block // 2)
        computed = max(prompt, budget + block) + (block - 1 if due else block // 2 - 1)
    budgets = [Budget(heavy=budget // 2, recent=budget - budget // 2, interval=block,
                      decay=decay)] * rows
    plan = make_step_plan(t(computed), t(q_len), t(prompt), budgets)
    per_row = -(-int(plan.kv_seq_lens.max()) // block)
    num_blocks = rows * per_row + 1
    table = (torch.arange(rows * per_row) + 1).view(rows, -1).to(torch.int32)
    ops = TritonOps(head)  # K and V as views of one Triton-attention kv_cache, as in the engine
    views = ops.cache_views(torch.zeros(num_blocks, kv_heads, block, 2 * head, dtype=dtype))
    scores = torch.zeros(num_blocks, kv_heads, block)
    tokens = int(plan.query_lens.sum())
    query = torch.zeros(tokens, kv_heads * group, head, dtype=dtype)
    slots = kv_slot_mapping(plan, table, tokens, block)
    step = make_step(plan, table, slots, block)
    if fused:
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), plan.query_lens.cumsum(0)])
        ops.attend(step, query, views, torch.empty_like(query), scores, head ** -0.5,
                   starts.to(torch.int32))
    update_scores_and_compact(step, ops, query, views, scores, head ** -0.5, accumulated=fused)


def vllm_attention(kv_heads, group, head, dtype, block=16):
    """vLLM's KV write and unified attention: a prompt (2D kernel) and a small decode batch
    (3D kernel and segment reduction), with the buffers TritonAttentionImpl passes."""
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_blocks, heads = 64, kv_heads * group
    k_cache = torch.zeros(num_blocks, block, kv_heads, head, dtype=dtype)
    new = torch.zeros(24, kv_heads, head, dtype=dtype)
    one = torch.ones((), dtype=torch.float32)
    triton_reshape_and_cache_flash(new, new, k_cache, k_cache.clone(), torch.arange(24), "auto",
                                   one, one)
    threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // kv_heads
    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    padded = 1 << (head - 1).bit_length()
    segm = dict(seq_threshold_3D=threshold, num_par_softmax_segments=segments,
                softmax_segm_output=torch.empty(threshold, heads, segments, padded),
                softmax_segm_max=torch.empty(threshold, heads, segments),
                softmax_segm_expsum=torch.empty(threshold, heads, segments))
    for q_lens, kv_lens in (([20], [20]), ([1, 1, 1, 1], [100, 200, 300, 37])):
        q = torch.zeros(sum(q_lens), heads, head, dtype=dtype)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.arange(len(q_lens) * 20, dtype=torch.int32).view(len(q_lens), 20) % num_blocks
        unified_attention(q, k_cache, k_cache, torch.empty_like(q), starts, max(q_lens),
                          torch.tensor(kv_lens, dtype=torch.int32), max(kv_lens), head ** -0.5,
                          True, (-1, -1), table, 0, None, None, None, **segm)


def vllm_slot_mapping(block=16):
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel
    kernel = ComputeSlotMappingKernel()
    kernel.compile_many(kernel.get_warmup_keys(
        kv_cache_block_size=block, total_cp_world_size=1, total_cp_rank=0,
        cp_kv_cache_interleave_size=1, block_table_stride=128))
    COMPILED.append("vllm.v1.worker.block_table.ComputeSlotMappingKernel")


CASES = {
    "h2o decode, bf16 head 128 GQA 4": lambda: h2o_step(64, 1024, 1, False, 8, 4, 128, torch.bfloat16),
    "h2o decode + compaction, bf16": lambda: h2o_step(64, 1024, 1, True, 8, 4, 128, torch.bfloat16),
    "h2o prefill, bf16": lambda: h2o_step(1, 512, 512, False, 8, 4, 128, torch.bfloat16),
    "h2o decode + compaction, fp32 head 32 GQA 2": lambda: h2o_step(8, 300, 1, True, 2, 2, 32, torch.float32),
    "h2o fused decode, bf16 head 128 GQA 4": lambda: h2o_step(64, 1024, 1, False, 8, 4, 128, torch.bfloat16, fused=True),
    "h2o fused decode + compaction, decay, bf16": lambda: h2o_step(64, 1024, 1, True, 8, 4, 128, torch.bfloat16, fused=True, decay=0.9),
    "h2o fused prefill, bf16": lambda: h2o_step(1, 512, 512, False, 8, 4, 128, torch.bfloat16, fused=True),
    "h2o fused prefill, decay, bf16": lambda: h2o_step(1, 512, 512, False, 8, 4, 128, torch.bfloat16, fused=True, decay=0.9),
    "h2o fused decode + compaction, fp32 head 32 GQA 2": lambda: h2o_step(8, 300, 1, True, 2, 2, 32, torch.float32, fused=True),
    "h2o fused prefill, fp32 head 32 GQA 2": lambda: h2o_step(2, 40, 40, False, 2, 2, 32, torch.float32, fused=True),
    "vllm attention, bf16 head 128 GQA 4": lambda: vllm_attention(8, 4, 128, torch.bfloat16),
    "vllm attention, fp32 head 32 GQA 2": lambda: vllm_attention(2, 2, 32, torch.float32),
    "vllm slot mapping": vllm_slot_mapping,
}


def main() -> int:
    install()
    import triton
    print(f"Triton {triton.__version__}, target sm_90")
    failed = 0
    for name, case in CASES.items():
        try:
            case()
            print(f"ok   {name}")
        except Exception as e:  # noqa: BLE001 - each case reported, then the next
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-3)
    print("compiled:", ", ".join(sorted(set(COMPILED))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
