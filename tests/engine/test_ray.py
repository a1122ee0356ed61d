"""`--distributed-executor-backend ray` on this CPU: vLLM's CPU platform has no Ray device key,
so stock vLLM itself (no plugin loaded) cannot start a Ray executor, and H2O fails the same way
with vLLM's own message, before any weight loads. Run against a local Ray cluster the test
starts (the one-machine stand-in for two nodes). The day vLLM's CPU engine gains Ray, the stock
case starts and this test fails: then H2O's Ray run against the oracle belongs here.

What runs without an engine does run here: a Ray actor set up the way each of vLLM's Ray
executors sets up its workers (process 0's environment as the executor sends it, then the
plugins loaded) writes its H2O metrics where process 0's /metrics reads them."""
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from h2o_vllm.metrics import DIR_ENV
from h2o_devtools.server import free_port

pytest.importorskip("ray", reason="Ray is the optional extra h2o-vllm[ray]")

RAY = str(Path(sys.executable).with_name("ray"))
CPU_HAS_NO_RAY = "current platform cpu does not support ray"
ENGINE = """
import sys
from vllm import LLM
h2o = {"additional_config": {"h2o": {}}} if sys.argv[2] == "h2o" else {}
try:
    LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32",
        enforce_eager=True, max_model_len=256, block_size=16, **h2o)
    print("ENGINE STARTED")
finally:
    print("PLUGIN LOADED", "h2o_vllm.plugin" in sys.modules)
"""


WORKER = """
import json, os, sys
import ray
from vllm.plugins import load_general_plugins
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
load_general_plugins()  # process 0 (here the driver): the metrics directory and collector
from h2o_vllm import metrics

@ray.remote
class Worker:
    def start(self, executor, env):
        if executor == "v2":  # RayWorkerProc.initialize_worker: fills in, never overwrites
            for key, value in env.items():
                os.environ.setdefault(key, value)
        else:  # RayDistributedExecutor: update_environment_variables, then init_worker
            from vllm.v1.worker.worker_base import WorkerWrapperBase
            WorkerWrapperBase(rpc_rank=0).update_environment_variables([env])
        load_general_plugins()  # WorkerWrapperBase.init_worker, in both executors
        metrics.recorder().add(evicted_tokens=7, attention_mass=2.5)
        metrics.recorder().flush()
        return os.getpid(), os.environ.get(metrics.DIR_ENV)

from vllm.ray.ray_env import get_env_vars_to_copy
from vllm.v1.executor.ray_env_utils import get_driver_env_vars
envs = {"v2": get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS),
        "legacy": {name: os.environ[name] for name in get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS)
                   if name in os.environ}}
ray.init(address=os.environ["RAY_ADDRESS"])
started = {executor: Worker.remote().start.remote(executor, env) for executor, env in envs.items()}
print(json.dumps({"driver_pid": os.getpid(), "driver_dir": os.environ[metrics.DIR_ENV],
                  "workers": {executor: ray.get(ref) for executor, ref in started.items()},
                  "totals": metrics.read_totals()}))
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head node on 127.0.0.1 with Ray's default token authentication (the token passed in
    the environment, as a second node or a driver would get it); yields the clients' env."""
    port = free_port()
    # Without this process's metrics directory (set when a test here loaded the plugin): Ray's
    # workers would inherit it from the head, and RayExecutorV2 never overwrites a worker's value.
    inherited = {k: v for k, v in os.environ.items() if k != DIR_ENV}
    env = {**inherited, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                    "--num-cpus=2", "--include-dashboard=false",
                    f"--temp-dir={tmp_path_factory.mktemp('ray')}"],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("engine", ["stock", "h2o"])
def test_cpu_engine_cannot_start_a_ray_executor(engine, ray_cluster, tiny_llama_dir):
    env = {**ray_cluster, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if engine == "stock":
        env["VLLM_PLUGINS"] = "none"  # vLLM loads only the plugins named: none of ours
    run = subprocess.run([sys.executable, "-c", ENGINE, str(tiny_llama_dir), engine], env=env,
                         capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "ENGINE STARTED" not in output, output[-4000:]
    assert CPU_HAS_NO_RAY in output, output[-4000:]
    assert "Starting to load model" not in output
    assert f"PLUGIN LOADED {engine == 'h2o'}" in output


def test_ray_worker_metrics_reach_process_0(ray_cluster):
    """Two workers, one per executor of vLLM 0.32: RayExecutorV2, the default (every driver
    variable, set with setdefault), and RayDistributedExecutor
    (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0: only the variables vLLM lists, H2O's added through
    VLLM_RAY_EXTRA_ENV_VARS_TO_COPY). Each adds to the counters; process 0 reads both."""
    run = subprocess.run([sys.executable, "-c", WORKER], env=ray_cluster,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    for executor, (pid, directory) in seen["workers"].items():
        assert pid != seen["driver_pid"] and directory == seen["driver_dir"], executor
    assert seen["totals"]["evicted_tokens"] == 14 and seen["totals"]["attention_mass"] == 5.0
