"""KVStore: a prompt's H2O state as a KV connector leaves it on shared storage.

Pure: torch, safetensors and the stdlib. What one prompt's producer leaves under
``<root>/<key>/`` (docs/kv-transfer.md):

- ``rank<r>.safetensors``, one per tensor-parallel rank, written by that rank's worker: for
  each H2O layer ``<layer>.k`` / ``<layer>.v`` ([kv_len, kv_heads, head_size], the cache's dtype)
  and ``<layer>.scores`` ([kv_len, kv_heads] fp32) of the live KV positions only: what the
  prompt's compaction kept, so the bytes follow the budget, not the prompt.
- ``meta.json`` (``StoredPrompt``), written by the scheduler once the request has finished:
  the commit mark. Without it a consumer never looks at the rank files.

Logical positions need no storing (keys are cached after RoPE; a new token's position is the
request's count) and neither does the cadence (``policy.kv_len_after`` of the prompt length
and the budget, which the key pins).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from h2o_vllm.config import Budget

META = "meta.json"


def state_key(prompt_ids: Sequence[int], budget: Budget, block_size: int,
              whole_layers: Sequence[Sequence[str]] = ()) -> str:
    """The name of a prompt's state: its tokens, the budget it was compacted by and the block
    size (the default interval's unit), and the layers a speculative drafter keeps whole, by
    group (their blocks travel in the state). Engines whose budgets or drafters differ never
    share a state: a decoder with another drafter, or none, computes the prompt itself."""
    parts = [list(map(int, prompt_ids)), dataclasses.asdict(budget), block_size]
    if whole_layers:  # keys without a drafter stay as they were
        parts.append([list(names) for names in whole_layers])
    digest = hashlib.sha256()
    digest.update(json.dumps(parts).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class StoredPrompt:
    prompt_len: int   # H2O's prompt: the consumer's prompt less the producer's first token
    first_token: int  # what the producer sampled after the prompt
    kv_len: int       # live KV positions per (layer, KV head) after the prompt's compaction
    world_size: int   # tensor-parallel ranks, one rank file each


class KVStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def folder(self, key: str) -> Path:
        return self.root / key

    def rank_path(self, key: str, rank: int) -> Path:
        return self.folder(key) / f"rank{rank}.safetensors"

    def write_rank(self, key: str, rank: int, tensors: dict[str, torch.Tensor]) -> int:
        """One rank's tensors, renamed into place once whole (a reader never sees half a
        file); returns the bytes written."""
        path = self.rank_path(key, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(partial))
        os.replace(partial, path)
        return path.stat().st_size

    def read_rank(self, key: str, rank: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.rank_path(key, rank)))

    def commit(self, key: str, prompt: StoredPrompt) -> None:
        path = self.folder(key) / META
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(dataclasses.asdict(prompt)))
        os.replace(partial, path)

    def committed(self, key: str) -> StoredPrompt | None:
        try:
            return StoredPrompt(**json.loads((self.folder(key) / META).read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def flaw(self, key: str, prompt: StoredPrompt) -> str | None:
        """Why the committed state cannot be loaded (a rank file missing or cut short), or None
        when every rank file is whole: its size is what its safetensors header promises."""
        for rank in range(prompt.world_size):
            path = self.rank_path(key, rank)
            if not path.exists():
                return f"{path} is missing"
            size = path.stat().st_size
            expected = _safetensors_size(path)
            if expected != size:
                return f"{path} holds {size} bytes where its header promises {expected}"
        return None

    def nbytes(self, key: str) -> int:
        """Bytes the state of ``key`` holds on storage (rank files and meta)."""
        folder = self.folder(key)
        return sum(p.stat().st_size for p in folder.iterdir()) if folder.exists() else 0


def _safetensors_size(path: Path) -> int | None:
    """The file size a safetensors header promises: 8 + header + the end of its last tensor."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return None
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return 8 + header_len + max(ends, default=0)
