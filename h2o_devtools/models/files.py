"""Where the model directories live and how they are written: the cache folder, an atomic
build into it, and the tokenizer files every directory gets."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def default_cache_dir() -> Path:
    """`$H2O_VLLM_CACHE`, else `~/.cache/h2o-vllm`."""
    return Path(os.environ.get("H2O_VLLM_CACHE") or Path.home() / ".cache" / "h2o-vllm")


def cached_build(subdir: str, build, cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir/subdir``, made by ``build(tmp_dir)`` on first use.

    The directory appears atomically (built in a sibling temp dir, then renamed), so its existence
    means it is complete, and concurrent builders (pytest-xdist, two shells) do not corrupt it.
    """
    final = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / subdir
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{subdir}-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary shared folder
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race with another builder: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_tokenizer(tokenizer, out_dir: Path, **config_overrides) -> None:
    import json

    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its internal class name "TokenizersBackend"; "PreTrainedTokenizerFast"
    # names the same tokenizer.json-driven class in transformers 4 and 5 alike, and keeps
    # AutoTokenizer from swapping in a slow-tokenizer class that rebuilds the pre-tokenizer.
    path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.update(config_overrides)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
