"""Run-wide fixtures: the model directories every test tier shares, each built once per run.

Without a GPU the Triton kernels can only run interpreted. TRITON_INTERPRET is read when a
``@triton.jit`` kernel is defined (module import), so it is set here, before any tier's test
module imports ``h2o_vllm.kernels``. vLLM's CPU engines ignore it (its Triton check still
finds no CPU backend), so the engine tiers run as they would without it.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests check rules, not speed: on two cores shared by engines, hypothesis's default
# 200 ms deadline failed pure-policy examples that took 0.3 ms on retry.
settings.register_profile("h2o", deadline=None)
settings.load_profile("h2o")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The kernel tests interpret without an engine (no switch): cut the interpreter's waste here too.
    from h2o_vllm.vllm_hooks.triton_on_cpu import cut_interpreter_waste
    cut_interpreter_waste()

# Under pytest-xdist (the README's test command runs one worker per core, whole files per
# worker), each worker and the engines it starts keep to one core of their own: vLLM's CPU
# workers bind their OpenMP threads to every core by default, and two engines spinning on the
# same cores run slower than one after the other. (Tests that need two cores, tensor parallel,
# bind their ranks themselves.)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _core = sorted(os.sched_getaffinity(0))[int(_WORKER.removeprefix("gw")) % len(os.sched_getaffinity(0))]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_core))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

from h2o_devtools import models


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Tiny random GQA Llama with peaky attention (fp32, ~1 s to build): exactness tests."""
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def eagle_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A one-layer target an EAGLE-1 head can mirror, and that head (h2o_devtools.models.drafters):
    it drafts what the dense target generates, so drafts are accepted wherever eviction left
    the token unchanged. (No "eagle" in the target's path: vLLM takes a draft model whose path
    says "eagle" for an EAGLE head.)"""
    from h2o_devtools.models import drafters
    target = drafters.build_mirrored_llama(tmp_path_factory.mktemp("mirrored-target"))
    return target, drafters.build_eagle_head(target, tmp_path_factory.mktemp("eagle-head"))


@pytest.fixture(scope="session")
def mirrored_drafter(eagle_pair, tmp_path_factory):
    """``(method, drafts) -> (target, speculative config)`` for each drafter with layers of its
    own, mirroring a one-layer target (h2o_devtools.models.drafters), so drafts are accepted
    wherever eviction left the token unchanged: an EAGLE-1 or EAGLE-3 head, a model's own MTP
    layer, or the target drafting for itself (``draft_model``)."""
    from h2o_devtools.models import drafters

    def build(method: str, drafts: int) -> tuple[Path, dict]:
        spec = {"method": method, "num_speculative_tokens": drafts}
        if method == "mtp":  # a model's MTP layers are its own
            return drafters.build_mtp_target(tmp_path_factory.mktemp("mimo-target")), spec
        if method == "eagle3":
            target, head = drafters.build_mirrored_eagle3_pair(tmp_path_factory.mktemp("eagle3-target"),
                                                               tmp_path_factory.mktemp("eagle3-head"))
            return target, {**spec, "model": str(head)}
        target, head = eagle_pair
        return target, {**spec, "model": str(head if method == "eagle" else target)}
    return build


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, cached across runs in $H2O_VLLM_CACHE (~20 s on the first run)."""
    return models.smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_4_layers_dir(smollm2_dir) -> Path:
    """SmolLM2's first four layers (real weights, copies repeated text): ~3 s after smollm2_dir."""
    return models.smollm2_layers_dir(4)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M (hybrid sliding-window), cached like SmolLM2 (~2.3 min on the first run)."""
    return models.gemma3_dir()


@pytest.fixture(scope="session")
def load_benchmark():
    """benchmarks/<name>.py as a module: the scripts are files, not a package."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


# pytest-xdist hands each worker one test file at a time (--dist loadfile) and, by default,
# the files with the most tests first: the engine files with a few long tests then start last
# and one worker runs them alone while the other idles. The Makefile keeps this order instead
# (--no-loadscope-reorder): the slowest files first, heaviest first (the `--durations` list at
# the end of every CI log says which), the other engine and server files next, and the unit
# files, many and short, last, where they fill in whichever worker frees first.
SLOWEST_FIRST = ("engine/test_speculative.py", "engine/test_cuda_speculative.py", "engine/test_cuda.py",
                 "engine/test_benchmarks_run.py", "engine/test_architectures.py")


def _file_rank(path: Path) -> tuple[int, int]:
    relative = path.relative_to(Path(__file__).parent).as_posix()
    if relative in SLOWEST_FIRST:
        return 0, SLOWEST_FIRST.index(relative)
    return (2, 0) if relative.startswith("unit/") else (1, 0)


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: _file_rank(Path(item.path)))  # stable: a file keeps its order
