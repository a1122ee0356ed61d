"""Graph-shaped decode on the CUDA path inside a real vLLM engine (``worker.decode_graph``):
every decode step of a batch size, compacting or not, launches the same H2O kernels with the
same grids, shapes, strides, scalars and buffer addresses, and runs the same due-pass ops over
the same step tensors: what a full CUDA graph captured once would replay
(docs/cuda.md, "What full CUDA graphs would need"). And it stays token for token the oracle's.

One engine core in this process (V1, async scheduling, prefix caching, a pool small enough to
preempt), the switch on (``decode_graph.SWITCH``); without a GPU, inside vLLM's CPU engine with
the kernels interpreted (``cuda_path``).

What a launch record holds, and why (``_record``): every tensor argument's shape, dtype,
strides and address, except where a graph supplies the tensor from its own memory pool, at the
same address at every replay: the model's activations (the attention's ``out`` and
``query``) and what the step's forward allocates (the attention's ``lse`` and ``logits``
scratch, the due pass's ``keep_idx``). Scalars must be equal: a captured launch bakes them
in; nothing of vLLM's rewrites them before a replay (its metadata rewritten in place is
tensors: block table, query_start_loc, seq_lens).
"""
import dataclasses

import pytest
import torch

from budgets import oracle
from cuda_path import CUDA_PATH_RUNS, DEVICE
from engines import V2_ENV, model_runner_of, random_prompts, run_steps, scheduler_of, greedy, vllm_engine
from h2o_vllm.worker.decode_graph import SWITCH as GRAPH_SWITCH

if not CUDA_PATH_RUNS:
    pytest.skip("no GPU and TRITON_INTERPRET != 1", allow_module_level=True)

BLOCK = 16
# Pooling ranks every row's first compaction: the pass's rank masks ride in every step.
ENGINE_H2O = {"heavy_tokens": 8, "recent_tokens": 8, "interval": 4, "sink_tokens": 2, "pool_kernel": 5}
PROMPTS = random_prompts((40, 5, 17, 24, 9, 33), seed=3)
PROMPTS.insert(2, PROMPTS[0][:36] + [7, 8, 9])  # shares the first prompt's two full blocks: a hit
MAX_TOKENS = 48
ABORTED = str(len(PROMPTS))  # one more request, aborted mid-run
#: Per kernel, the tensor arguments a graph supplies from its own pool (see the docstring).
POOLED = {"h2o_attention_kernel": {"out", "query", "lse", "logits"}, "compact_rows_kernel": {"keep_idx"}}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from h2o_devtools import models
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2-layers"), num_layers=2)


class StepRecorder:
    """Per engine step (one ``H2OStep``): its plan, the H2O Triton launches and the due pass's
    torch ops, as a graph would see them."""

    def __init__(self):
        self.steps: list[tuple[object, list]] = []  # (H2OStep, records)
        self.pending: list = []  # launches since the last layer's compaction
        self.recording_ops = False

    def launch(self, name, arg_names, grid, args, kwargs):
        pooled = POOLED.get(name, set())
        # A pointer the kernel never reads is passed as a pooled tensor (the launcher's ``unused``).
        aliases = {value.data_ptr(): f"= {arg_name}" for arg_name, value in zip(arg_names, args)
                   if arg_name in pooled and isinstance(value, torch.Tensor)}
        record = [name, tuple(grid)]
        for arg_name, value in zip(arg_names, args):
            if isinstance(value, torch.Tensor):
                address = "pooled" if arg_name in pooled else aliases.get(value.data_ptr(), value.data_ptr())
                record.append((arg_name, tuple(value.shape), value.dtype, value.stride(), address))
            else:
                record.append((arg_name, value))
        record.append(tuple(sorted(kwargs.items())))
        self.pending.append(tuple(record))

    def layer(self, step, ops):
        if not self.steps or self.steps[-1][0] is not step:
            self.steps.append((step, [_step_tensors(step)]))
        self.steps[-1][1].extend(self.pending + ops)
        self.pending = []


def _step_tensors(step) -> tuple:
    """The step's tensors a layer reads, by name, with their addresses and shapes."""
    out = [(f.name, tuple(t.shape), t.data_ptr()) for f in dataclasses.fields(step)
           if isinstance(t := getattr(step, f.name), torch.Tensor)]
    for i, due in enumerate(step.due):
        out += [(f"due{i}.{f.name}", tuple(t.shape), t.data_ptr()) for f in dataclasses.fields(due)
                if isinstance(t := getattr(due, f.name), torch.Tensor)]
        out += [(f"due{i}.rank{j}", tuple(t.shape), t.data_ptr()) for j, (_, t) in enumerate(due.rank)]
    index = step.device_index
    out.append(("decode_offsets", tuple(index.decode_offsets.shape), index.decode_offsets.data_ptr(),
                index.num_decode_keys))
    return tuple(out)


def _install(mp, recorder: StepRecorder) -> None:
    """Hooks: the Triton interpreter's launch (H2O's kernels only) and the impl's call of
    ``update_scores_and_compact`` (the due pass), whose torch ops a dispatch mode records."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from h2o_vllm.worker import attention_backend

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if recorder.recording_ops:
                tensors = [x for x in torch.utils._pytree.tree_flatten((args, kwargs))[0]
                           if isinstance(x, torch.Tensor)]
                self.ops.append((str(func), tuple((tuple(t.shape), t.dtype, t.stride()) for t in tensors)))
            return func(*args, **(kwargs or {}))

    run = InterpretedFunction.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("h2o_vllm.kernels"):
            recorder.launch(self.fn.__name__, self.arg_names, grid if not callable(grid) else grid(kwargs),
                            args, kwargs)
        was, recorder.recording_ops = recorder.recording_ops, False  # the interpreter's own ops
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            recorder.recording_ops = was

    original = attention_backend.update_scores_and_compact

    def recorded(step, *args, **kwargs):
        mode = Ops()
        recorder.recording_ops = True
        try:
            with mode:
                return original(step, *args, **kwargs)
        finally:
            recorder.recording_ops = False
            recorder.layer(step, mode.ops)

    mp.setattr(InterpretedFunction, "run", recorded_run)
    mp.setattr(attention_backend, "update_scores_and_compact", recorded)


def serve_recorded(model_dir):
    """(outputs by request id, the recorder, what the run went through)."""
    from h2o_vllm.scheduler.manager import H2OManager
    env = {**DEVICE.get("env", {}), V2_ENV: "0", GRAPH_SWITCH: "1"}
    recorder, seen = StepRecorder(), {"preempted": set(), "cached": {}}
    with vllm_engine(model_dir, in_process=True, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=128, num_gpu_blocks_override=9, env=env,
                     additional_config={"h2o": ENGINE_H2O}, **{k: v for k, v in DEVICE.items() if k != "env"}) as llm:
        builders = [b for groups in model_runner_of(llm).attn_groups for g in groups for b in g.metadata_builders]
        assert any(b.graph_width == 32 for b in builders)  # 2 + 8 + 8 + 4 tokens -> two blocks
        scheduler = scheduler_of(llm)

        def on_step():
            seen["preempted"].update(r.request_id for r in scheduler.running if r.num_preemptions)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(H2OManager, "admission_headroom", lambda self, *args: 0)  # preempt as stock does
            _install(mp, recorder)
            outputs = run_steps(llm, PROMPTS + [PROMPTS[-1]], greedy(MAX_TOKENS), on_step=on_step,
                                abort_after=(12, [ABORTED]), cached=seen["cached"])
    return outputs, recorder, seen


@pytest.fixture(scope="module")
def recorded_run(tiny_llama_dir):
    return serve_recorded(tiny_llama_dir)


def test_graph_shaped_decode_matches_the_dense_oracle(recorded_run, tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    outputs, _, seen = recorded_run
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    expected = oracle(hf, ENGINE_H2O, BLOCK).generate(PROMPTS, MAX_TOKENS)
    assert ABORTED not in outputs
    for i, want in enumerate(expected):
        assert outputs[str(i)] == want, f"request {i} left the oracle"


def test_every_decode_step_of_a_batch_size_launches_what_a_graph_replays(recorded_run):
    """Over the whole run (compactions, a prefix hit, an abort, a preemption), the decode-only
    steps of each batch size have identical records; the controls show the run went through
    what it should, and that the records do see what changes between batch sizes."""
    _, recorder, seen = recorded_run
    groups: dict[int, list] = {}
    compacting = quiet = 0
    for step, records in recorder.steps:
        plan = step.plan
        if not bool((plan.query_lens == 1).all()) or plan.prefix is not None:
            continue
        assert step.decode_width == 32 and len(step.due) == 1, "a decode step ran eagerly"
        groups.setdefault(plan.query_lens.shape[0], []).append(records)
        compacting += bool(plan.due.any())
        quiet += not bool(plan.due.any())
    assert sum(map(len, groups.values())) >= 100, {n: len(g) for n, g in groups.items()}
    assert compacting >= 10 and quiet >= 10, (compacting, quiet)
    assert seen["preempted"], "no request was preempted"
    assert max(seen["cached"].values()) >= BLOCK, "no request hit the prefix cache"
    for size, records in groups.items():
        for i, r in enumerate(records[1:], 1):
            assert r == records[0], f"batch of {size}: decode step {i} differs from the first: " + \
                next(f"{a} != {b}" for a, b in zip(r, records[0]) if a != b)
    firsts = [records[0] for records in groups.values()]
    assert len(firsts) >= 2 and firsts[0] != firsts[1]
