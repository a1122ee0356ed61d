"""The engine settings H2O needs, settled before vLLM builds its config, and checked after.

Runs in the process that builds the engine config (process 0). ``settle_engine_args`` and
``check_engine_config`` are what the engine-args hook calls around
``EngineArgs.create_engine_config``: refusals raise ``ValueError`` naming the flag and the fix
(``conflicts``), before any model weight loads.
"""
from __future__ import annotations

import logging
from typing import Any

from h2o_vllm.config import H2OConfig, config_from_additional
from h2o_vllm.frontend import conflicts, cuda_config
from h2o_vllm.kv_transfer import transfer_config

logger = logging.getLogger("vllm.h2o_vllm")  # vLLM's handler prints its "vllm." loggers


def settle_engine_args(args: Any) -> H2OConfig | None:
    """Validate ``args.additional_config["h2o"]``, refuse conflicting flags and pick the CUDA
    settings. Returns the H2O config (None: off). Prefix caching stays as vLLM sets it (on by
    default): H2O keeps hits exact and never rewrites a cached block (docs/prefix-caching.md)."""
    h2o = config_from_additional(args.additional_config)
    if h2o is None:
        return None
    conflicts.check_engine_args(args, h2o)
    if (connector := transfer_config.settle(args)) is not None:
        logger.info("h2o: the KV connector is %s (on the settings given; it carries H2O's kept KV "
                    "and scores: docs/kv-transfer.md)", connector)
    cuda_config.adjust_engine_args(args)  # CUDA path: backend; CUDA only: runner, async, graphs
    return h2o


def check_engine_config(vllm_config: Any, h2o: H2OConfig | None) -> None:
    """What only the built config shows: the model's attention, max_model_len, CUDA graphs."""
    if h2o is None:
        return
    model = getattr(vllm_config, "model_config", None)
    if model is not None and not conflicts.has_full_attention(model):
        # Off in every process: the workers and the engine core read it from the config.
        logger.warning("%s", conflicts.nothing_to_evict_warning(model))
        vllm_config.additional_config.pop("h2o", None)
        return
    conflicts.check_vllm_config(vllm_config, h2o)
    cuda_config.check_vllm_config(vllm_config)
    if getattr(vllm_config, "speculative_config", None) is not None and h2o.interval == 1:
        logger.warning("h2o.interval 1 (--h2o-interval 1) compacts at every step, and a step with "
                       "speculative drafts may not compact: every draft is cut, so --speculative-config "
                       "adds work and no speed-up (docs/semantics.md, \"Speculative decoding\"). Use "
                       "an interval above the draft count, or per-request intervals.")
