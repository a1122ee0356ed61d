"""How a step's plan reaches vLLM's attention-metadata builders: for the extent of one build.

Runs in the worker process. vLLM's ``AttentionMetadataBuilder.build(common_prefix_len,
common_attn_metadata, fast_build)`` has no argument for a plugin's plan, and both runners call
it from inside their own methods. So the runner hooks (``vllm_hooks.runner_v1``,
``runner_v2``) open ``building(plan, layer_groups)`` around the call that builds the step's
metadata, as vLLM's ``set_forward_context`` opens its context around the forward for the
layers; a builder reads ``plan_for(its layer names)``. Nothing is kept on the builders or on
vLLM's objects: a build outside the block (dummy, profiling, capture) finds no plan, and none
survives the step.

Model Runner V2 makes the plan in one method (``prepare_attn``, where it has the runner's
state) and builds the metadata in another (``DefaultModelState.prepare_attn``), one after the
other in ``execute_model``: the plan is ``hold``-ed in between for that very batch and taken
once (``take_held``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from h2o_vllm.worker.plan import StepPlan


@dataclass(frozen=True)
class Building:
    plan: StepPlan
    #: Layer name -> its KV-cache group id (``RunnerState.layer_groups``): each group has its
    #: own prefix-cache orders (``StepPlan.for_group``).
    layer_groups: Mapping[str, int]

    def for_layers(self, layer_names: Sequence[str]) -> StepPlan:
        return self.plan.for_group(self.layer_groups[layer_names[0]])  # a group's layers share it


_current: ContextVar[Building | None] = ContextVar("h2o_building", default=None)
_held: ContextVar[tuple[object, Building] | None] = ContextVar("h2o_held", default=None)


def building(plan: StepPlan | None, layer_groups: Mapping[str, int]):
    """Builders inside the block build with ``plan`` (None: as vLLM's own)."""
    return _current_as(Building(plan, layer_groups) if plan is not None else None)


def plan_for(layer_names: Sequence[str]) -> StepPlan | None:
    """The plan of the build in progress, as the builder of ``layer_names`` runs it; None
    outside ``building``."""
    current = _current.get()
    return current.for_layers(layer_names) if current is not None else None


def hold(batch: object, plan: StepPlan, layer_groups: Mapping[str, int]) -> None:
    """Keep ``plan`` until ``batch``'s metadata is built (Model Runner V2)."""
    _held.set((batch, Building(plan, layer_groups)))


def building_held(batch: object):
    """``building`` with the plan held for this very ``batch``, taken once; without a plan
    for any other (dummy, profiling and capture runs build metadata for batches of their own)."""
    held = _held.get()
    taken = held[1] if held is not None and held[0] is batch else None
    if taken is not None:
        _held.set(None)
    return _current_as(taken)


@contextlib.contextmanager
def _current_as(value: Building | None) -> Iterator[None]:
    token = _current.set(value)
    try:
        yield
    finally:
        _current.reset(token)
