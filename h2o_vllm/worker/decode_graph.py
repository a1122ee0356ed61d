"""Graph-shaped decode: whether an engine's decode steps run as a full CUDA graph would replay
them (every row through one due pass of a width fixed for the engine, the step's tensors in
persistent buffers), and that width. docs/cuda.md, "What full CUDA graphs would need".

Runs in the worker process, once per metadata builder (the CUDA path's; the CPU path's steps
stay eager: no graph replays them).
"""
from __future__ import annotations

import os

from h2o_vllm.config import H2OConfig

#: Turns graph-shaped decode on where vLLM's CUDA graphs do not ask for it (tests, on the CPU
#: engine). Read here only, when a builder starts.
SWITCH = "H2O_VLLM_GRAPH_SHAPED_DECODE"


def graph_width(vllm_config, h2o: H2OConfig, block_size: int) -> int | None:
    """The engine's due-pass width in KV positions when its decode steps run graph-shaped:
    vLLM's ``cudagraph_mode`` has full graphs, or ``SWITCH`` is 1; None: eager steps."""
    mode = vllm_config.compilation_config.cudagraph_mode
    full = mode is not None and mode.has_full_cudagraphs()
    if not (full or os.environ.get(SWITCH) == "1"):
        return None
    return engine_width(h2o, vllm_config.model_config.max_model_len, block_size)


def engine_width(h2o: H2OConfig, max_model_len: int, block_size: int) -> int:
    """A power of two of blocks, at least the engine budget's decode peak (budget + interval,
    ``StepPlan.kv_peak_lens``) at any prompt length. A budget's tokens never shrink as the
    prompt grows (ratios grow with it, floors and absolute counts stay), so the longest prompt's
    bounds them all. A request whose own budget peaks higher widens its steps' pass
    (``due_pass.due_passes``): correct, but a graph captured at this width would not hold it."""
    budget = h2o.budget(max_model_len, block_size)
    blocks = -(-(budget.tokens + budget.interval) // block_size)
    return (1 << (blocks - 1).bit_length()) * block_size
