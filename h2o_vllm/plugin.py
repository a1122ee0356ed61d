"""The ``vllm.general_plugins`` entry point. vLLM runs it in every process, possibly twice."""
from __future__ import annotations

_registered = False


def register() -> None:
    """Install H2O into this process's vLLM: CPU backend override, KV-cache spec, hooks.

    Does nothing visible until a config carries ``additional_config["h2o"]``.
    """
    global _registered
    if _registered:
        return
    # Imported here, not at module top: vLLM only logs a failed plugin import, while an error
    # raised inside register() stops start-up with our message. The version goes first, before
    # any module that names vLLM's internals is imported.
    from h2o_vllm.vllm_shims.symbols import check_vllm_version  # plugin order: before the hooks
    check_vllm_version()
    from h2o_vllm import metrics, vllm_hooks  # plugin order: after the version check
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # plugin order
    register_backend(AttentionBackendEnum.CPU_ATTN, "h2o_vllm.worker.cpu.backend.H2OCPUAttentionBackend")
    _register_cuda_backend(vllm_hooks.triton_on_cpu.CUDA_BACKEND)
    vllm_hooks.install_triton_on_cpu()  # H2O_VLLM_TRITON_ON_CPU=1 only: the CUDA path on the CPU
    vllm_hooks.register_kv_cache_spec()
    vllm_hooks.register_kv_connector()
    vllm_hooks.install_engine_args_hook()
    vllm_hooks.install_runner_hook()
    vllm_hooks.install_runner_v2_hook()
    vllm_hooks.install_scheduler_hook()
    vllm_hooks.install_cli_flags_hook()
    vllm_hooks.install_request_validation_hook()
    vllm_hooks.install_metrics_hooks()
    metrics.setup_process0()  # before vLLM spawns the engine core: children inherit the path
    vllm_hooks.share_env_with_ray_workers(metrics.DIR_ENV)  # Ray workers get it from vLLM
    _registered = True


def _register_cuda_backend(backend: str, is_cuda: bool | None = None) -> None:
    """On CUDA, ``--attention-backend CUSTOM`` selects H2O's Triton backend (h2o_vllm.frontend.cuda_config
    picks CUSTOM when H2O is on and no backend was named). Other platforms are left alone."""
    from vllm.platforms import current_platform  # plugin order: after the version check
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # plugin order
    if current_platform.is_cuda() if is_cuda is None else is_cuda:
        register_backend(AttentionBackendEnum.CUSTOM, backend)
