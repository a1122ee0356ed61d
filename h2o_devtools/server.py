"""An `h2o-vllm serve` subprocess for the benchmark scripts (client side, never the runtime).

``served_model``, ``run_header``, ``sides_of`` and ``results_subdir`` are the served
benchmarks' shared set-up.
``start_server`` launches ``h2o-vllm serve MODEL --host 127.0.0.1 --port <free port> FLAGS...``
in its own process group (API server, engine core and worker all in it), its output in a log
file, and waits for ``/health``; ``stop_server`` ends the whole group (SIGTERM, then SIGKILL
after 30 s). Used by ``benchmarks/soak.py`` (and through it ``keepalive_race.py``) and
``benchmarks/prefix_serving.py``.
"""
from __future__ import annotations

import datetime
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests

#: Environment every benchmark server gets on top of the caller's: a KV profile cap (the scripts
#: fix their pools with --num-gpu-blocks-override) and unbuffered logs.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def h2o_vllm_command() -> str:
    """The ``h2o-vllm`` console script of this interpreter's environment."""
    return str(Path(sys.executable).with_name("h2o-vllm"))


def start_server(model: str, flags: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                 timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """Start ``h2o-vllm serve model`` on a free local port with ``flags``, environment
    ``os.environ`` + ``SERVER_ENV`` + ``env``, output into ``log_path``; return the process
    (leader of its group) and its base URL once ``/health`` answers 200. Exits (SystemExit,
    naming the log) if the server dies or is not ready within ``timeout_s``."""
    port = free_port()
    cmd = [h2o_vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **SERVER_ENV, **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; log: {log_path}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"server not ready after {timeout_s:g} s; log: {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group; SIGKILL if its leader has not exited in 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def served_model(model: str | None, tiny: bool, tmp_prefix: str) -> tuple[str, str]:
    """(model directory, name for reports): ``--model``, else a fresh tiny random Llama with
    ``--tiny``, else the offline SmolLM2-135M-Instruct."""
    from h2o_devtools import models
    if model:
        return str(models.model_dir(model)), Path(model).name
    if tiny:
        return (str(models.build_tiny_llama(tempfile.mkdtemp(prefix=tmp_prefix))),
                "tiny-llama (h2o_devtools.models.build_tiny_llama)")
    return str(models.smollm2_dir()), "SmolLM2-135M-Instruct"


def run_header(script: str, argv: Sequence[str] | None) -> dict:
    """When, where and how a served benchmark ran: the head of its JSON report."""
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
            "command": " ".join([Path(sys.argv[0]).name if argv is None else script,
                                 *(sys.argv[1:] if argv is None else argv)])}


def sides_of(spec: str, known) -> list[str]:
    """``--sides``: a comma list of names from ``known``, in the given order."""
    sides = [side.strip() for side in spec.split(",") if side.strip()]
    if not sides or set(sides) - set(known):
        raise SystemExit(f"--sides: a comma list of {', '.join(known)}, got {spec!r}")
    return sides


def results_subdir(out: str | None, script: str, name: str) -> Path:
    """``--out`` or ``benchmarks/results/<date>-<host>/<name>/`` beside ``script``, with its
    ``logs/`` and ``bench/`` (vLLM's bench JSONs)."""
    path = Path(out or Path(script).parent / "results" / f"{datetime.date.today()}-{socket.gethostname()}" / name)
    for sub in ("logs", "bench"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    return path
