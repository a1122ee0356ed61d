"""The GPU bundle's manifest: what went in (pins and sha256 of every input), what came out (sha256
and size of every file), and the checks both machines run on it.

Standard library only: ``gpu_check.sh`` runs ``python -m gpu_bundle.bundle verify`` on the GPU
machine before installing anything from the bundle.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_bundle.wheels import sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
# What may travel to the GPU machine is 64 MiB with the working tree; the tree is ~2 MiB.
SIZE_LIMIT_BYTES = 60 * 2**20
# The GPU machine (/work/shared/design/gpu-device.md): CPython 3.12 on manylinux x86_64. The
# build downloads for it and the install names it, so the same install command also runs on a
# CPU machine with another Python (the dry run).
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp",
              "--abi", "cp312", "--abi", "abi3", "--abi", "none",
              *[arg for tag in ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64",
                                "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
                                "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                "manylinux_2_5_x86_64", "manylinux1_x86_64")
                for arg in ("--platform", tag)]]


def bundle_files(root: str | Path) -> dict[str, dict]:
    """Every file under ``root`` but the manifest: POSIX relative path -> sha256 and bytes."""
    root = Path(root)
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST:
            files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return files


def write_manifest(root: str | Path, inputs: list[dict], build: dict) -> dict:
    """Record ``inputs`` (each with a sha256), the build settings and the files now in ``root``.

    Nothing time- or machine-dependent goes in: a rebuild from the same inputs writes the same
    manifest, byte for byte.
    """
    for item in inputs:
        if not item.get("sha256"):
            raise ValueError(f"input without sha256: {item}")
    files = bundle_files(root)
    doc = {"format": FORMAT, "build": build, "inputs": inputs, "files": files,
           "total_bytes": sum(f["bytes"] for f in files.values())}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    (Path(root) / MANIFEST).write_text(text)
    doc["total_bytes_with_manifest"] = doc["total_bytes"] + len(text.encode())
    return doc


def verify(root: str | Path, limit: int = SIZE_LIMIT_BYTES) -> list[str]:
    """Problems with the bundle at ``root`` (empty when it is intact and within ``limit``)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        return [f"{path}: no manifest (build it: make gpu-bundle)"]
    doc = json.loads(path.read_text())
    problems = []
    if doc.get("format") != FORMAT:
        problems.append(f"manifest format {doc.get('format')!r}, expected {FORMAT}")
    recorded, present = doc.get("files", {}), bundle_files(root)
    for rel in sorted(set(recorded) - set(present)):
        problems.append(f"missing: {rel}")
    for rel in sorted(set(present) - set(recorded)):
        problems.append(f"not in the manifest: {rel}")
    for rel in sorted(set(recorded) & set(present)):
        if recorded[rel] != present[rel]:
            problems.append(f"changed since the build: {rel}")
    for item in doc.get("inputs", []):
        if not item.get("sha256"):
            problems.append(f"input without sha256: {item}")
    total = sum(f["bytes"] for f in present.values()) + path.stat().st_size
    if total > limit:
        problems.append(f"{total / 2**20:.1f} MiB is over the {limit / 2**20:.0f} MiB limit")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check a GPU bundle against its manifest.")
    p.add_argument("command", choices=["verify", "pip-target"],
                   help="verify: check files and size; pip-target: print pip's target flags")
    p.add_argument("bundle", nargs="?", default=".gpu-bundle")
    a = p.parse_args(argv)
    if a.command == "pip-target":
        print(" ".join(PIP_TARGET + ["--only-binary=:all:"]))
        return 0
    problems = verify(a.bundle)
    for problem in problems:
        print(f"gpu bundle: {problem}", file=sys.stderr)
    if not problems:
        total = sum(f.stat().st_size for f in Path(a.bundle).rglob("*") if f.is_file())
        print(f"gpu bundle: {a.bundle} intact, {total / 2**20:.1f} MiB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
