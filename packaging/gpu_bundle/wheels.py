"""Byte-for-byte reproducible wheels: the pure-Python repack of vLLM and normalised copies of
built wheels.

A zip records each member's timestamp, order and permissions; pip and setuptools take them from
the file system. Writing every wheel through ``write_wheel`` (sorted members, one fixed
timestamp, fixed modes, one compression level, a fresh RECORD) makes a rebuild from the same
inputs give the same bytes (with the same zlib: the manifest records its version).
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import zipfile
from pathlib import Path

# The earliest time a zip can hold; the common choice for reproducible archives.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
COMPRESSLEVEL = 6
ELF_MAGIC = b"\x7fELF"
# C, C++ and CUDA sources and headers: inputs of vLLM's JIT-compiled kernels (DeepGEMM, cutlass
# FMHA), never read on the path the bundle serves.
NATIVE_SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".inl")


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def read_wheel(path: str | Path) -> dict[str, bytes]:
    """Member name -> bytes, directories left out."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


def dist_info_dir(entries: dict[str, bytes]) -> str:
    names = {name.split("/", 1)[0] for name in entries if name.split("/", 1)[0].endswith(".dist-info")}
    if len(names) != 1:
        raise ValueError(f"expected one .dist-info folder, found {sorted(names)}")
    return names.pop()


def write_wheel(path: str | Path, entries: dict[str, bytes]) -> Path:
    """Write ``entries`` (any RECORD among them is replaced) as a reproducible wheel."""
    info = dist_info_dir(entries)
    record_name = f"{info}/RECORD"
    files = {name: data for name, data in entries.items() if name != record_name}
    # Package files first, then .dist-info, RECORD last: the order the wheel spec recommends.
    order = sorted(files, key=lambda name: (name.startswith(info + "/"), name))
    # RECORD is CSV: names with commas (vLLM's tuned-kernel configs) must be quoted.
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    writer.writerows([name, _record_hash(files[name]), len(files[name])] for name in order)
    writer.writerow([record_name, "", ""])
    files[record_name] = record.getvalue().encode()
    order.append(record_name)
    path = Path(path)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=COMPRESSLEVEL) as z:
        for name in order:
            member = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            member.compress_type = zipfile.ZIP_DEFLATED
            member.external_attr = 0o644 << 16
            member.create_system = 3  # Unix, whatever machine builds it
            z.writestr(member, files[name], compresslevel=COMPRESSLEVEL)
    return path


def normalize_wheel(src: str | Path, out_dir: str | Path) -> Path:
    """A reproducible copy of a built wheel (same name, same files)."""
    return write_wheel(Path(out_dir) / Path(src).name, read_wheel(src))


def is_compiled(name: str, data: bytes) -> bool:
    """Compiled code (any ELF file: extensions, bundled executables) or native sources."""
    return data[:4] == ELF_MAGIC or name.endswith(NATIVE_SOURCE_SUFFIXES) or ".so." in name


def repack_pure(src: str | Path, out_dir: str | Path, replacements: dict[str, bytes],
                local_version: str) -> tuple[Path, list[str]]:
    """Repack a platform wheel as ``py3-none-any`` without its compiled files.

    ``replacements`` maps member names to new contents (added or overwritten: the stand-ins).
    The version gains a local part (``0.32.0+<local_version>``) so nothing mistakes the result
    for the upstream wheel. Returns the new wheel and the dropped member names.
    """
    entries = read_wheel(src)
    old_info = dist_info_dir(entries)
    name, version = old_info[: -len(".dist-info")].rsplit("-", 1)
    new_version = f"{version}+{local_version}"
    new_info = f"{name}-{new_version}.dist-info"
    dropped = sorted(n for n, data in entries.items() if is_compiled(n, data))
    kept = {n: d for n, d in entries.items() if n not in dropped}
    kept.update(replacements)
    out: dict[str, bytes] = {}
    for member, data in kept.items():
        if member.startswith(old_info + "/"):
            member = new_info + member[len(old_info):]
        out[member] = data
    metadata = out[f"{new_info}/METADATA"].decode()
    metadata, n = re.subn(r"(?m)^Version: .*$", f"Version: {new_version}", metadata, count=1)
    if n != 1:
        raise ValueError(f"{src}: no Version line in METADATA")
    out[f"{new_info}/METADATA"] = metadata.encode()
    out[f"{new_info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: h2o-vllm packaging/gpu_bundle\n"
                                "Root-Is-Purelib: true\nTag: py3-none-any\n\n").encode()
    filename = f"{name}-{new_version}-py3-none-any.whl"
    return write_wheel(Path(out_dir) / filename, out), dropped
