"""Server-tier harness: `h2o-vllm serve` as a subprocess on 127.0.0.1, one per test module."""
import contextlib
import glob
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from h2o_vllm.policy import kv_len_after

H2O_VLLM = str(Path(sys.executable).with_name("h2o-vllm"))
COMMON_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--seed", "0"]
OFFLINE_SCRIPT = str(Path(__file__).with_name("offline.py"))


def server_env() -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: a child orphaned by
    the API server's exit is reparented to PID 1, which need not reap it here."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Server:
    """A running server; ``stop()`` ends its whole process group and checks nothing is left."""

    def __init__(self, model_dir, args, timeout_s: float = 240, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="h2o-server-", suffix=".log", delete=False)
        cmd = [H2O_VLLM, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
               *COMMON_ARGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**server_env(), **(env or {})},
                                     start_new_session=True)
        self.timeout_s = timeout_s

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {self.timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-n:]

    def client(self):
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("h2o_vllm:"):
                name, value = line.rsplit(" ", 1)
                values[name.removeprefix("h2o_vllm:")] = float(value)
        return values

    def settled_metrics(self) -> dict[str, float]:
        """Metrics once earlier requests' last updates have landed (writers flush every 0.2 s)."""
        values = self.metrics()
        while True:
            time.sleep(0.6)
            again = self.metrics()
            if again == values:
                return values
            values = again

    def stop(self) -> None:
        """SIGTERM to the group (API server, engine core, worker); the group must be empty."""
        pgid = self.proc.pid
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while group_alive(pgid) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.2)
        orphans = group_alive(pgid)
        if orphans:
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        assert not orphans, f"server processes left 30 s after SIGTERM:\n{self.tail()}"


@contextlib.contextmanager
def serving(server: Server):
    """A module fixture's body: ``server`` once ready, with ``server.model`` its served name;
    stopped (and checked to leave no process) afterwards."""
    try:
        server.wait_ready()
        server.model = server.client().models.list().data[0].id
        yield server
    finally:
        server.stop()


class Offline:
    """Reference answers from `LLM.generate` / `LLM.chat`, computed in a subprocess that runs
    while the server starts (see offline.py for the spec format)."""

    def __init__(self, spec: dict) -> None:
        self.out = tempfile.NamedTemporaryFile(prefix="h2o-offline-", suffix=".json", delete=False).name
        spec_path = self.out + ".spec"
        Path(spec_path).write_text(json.dumps(spec))
        # The engine core in the script's own process: a spawned one brings a spawned worker on
        # the CPU, two more processes importing vLLM (~15 s each) beside the starting server.
        env = {**server_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.proc = subprocess.Popen([sys.executable, OFFLINE_SCRIPT, spec_path, self.out],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, text=True)

    def result(self, timeout_s: float = 300) -> dict:
        try:
            log, _ = self.proc.communicate(timeout=timeout_s)
        finally:
            if group_alive(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)
        assert self.proc.returncode == 0, log[-4000:]
        return json.loads(Path(self.out).read_text())


def expected_counts(prompt_len: int, num_generated: int, config, block_size: int) -> dict[str, int]:
    """What the engine evicts for one request, from the shared policy: the worker compacts
    after a step when the live length falls; the scheduler frees the tail blocks when it
    schedules that step (the last one's too)."""
    budget = config.budget(prompt_len, block_size)

    def kv(t):
        return kv_len_after(t, prompt_len, budget)
    # Steps: the prefill (0 -> prompt_len tokens processed), then one token per decode step;
    # the last sampled token is never processed.
    steps = [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, prompt_len + num_generated - 1)]
    evicted = compactions = freed = held = 0
    for before, after in steps:
        held = max(held, math.ceil((kv(before) + after - before) / block_size))  # allocated
        keep = math.ceil(kv(after) / block_size)  # cut_scheduled, once the step is scheduled
        freed += max(0, held - keep)
        held = min(held, keep)
        dropped = kv(before) + (after - before) - kv(after)
        evicted += dropped
        compactions += dropped > 0
    return {"evicted_tokens": evicted, "compactions": compactions, "freed_blocks": freed}


from h2o_devtools.models import TINY_CHAT_TEMPLATE  # noqa: E402,F401  (the tests' import point)


def wait_for(predicate, timeout_s: float = 5.0):
    """Poll ``predicate()`` until it returns a truthy value (metrics are flushed every 0.2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
