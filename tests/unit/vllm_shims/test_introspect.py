"""Upstream-drift guards for h2o_vllm.vllm_shims.introspect, the tools' read-only views of an
offline engine (the demo, the benchmarks, the GPU load check).

What is guarded here:
- every vLLM symbol introspect looks up is in ``introspect.SYMBOLS`` (no other ``_require``) and
  is recorded here with the parameter list it was written against (``RECORDED``), as are the
  vLLM methods it and its callers call on what it returns (``CALLED``);
- the instance attributes it walks are still assigned by vLLM's classes: ``LLMEngine
  .engine_core`` -> ``InprocClient.engine_core`` -> ``EngineCore.scheduler`` ->
  ``Scheduler.kv_cache_manager`` -> ``KVCacheManager.block_pool / coordinator`` ->
  ``single_type_managers`` -> ``req_to_blocks``, ``kv_cache_spec``, ``KVCacheBlock.is_null``;
- that an offline engine without multiprocessing gets the ``InprocClient``, and that every
  preemption goes through ``Scheduler._preempt_request``;
- each view on small stand-ins: what it returns, that the wrappers count and unwind, and that a
  renamed symbol fails naming itself and the supported range.

What is NOT guarded here: the numbers on a real engine (tests/engine/test_benchmarks_run.py and
tests/engine/test_long_prompts_run.py run the tools that use these views).
"""
import ast
import importlib
import inspect
import re
from types import SimpleNamespace

import pytest

from h2o_vllm.vllm_shims import introspect
from h2o_vllm.vllm_shims.symbols import SUPPORTED_VLLM

_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl"

#: Each symbol of introspect.SYMBOLS -> its parameter names (None: a class, checked by isinstance).
RECORDED = {
    "vllm.v1.engine.core_client:InprocClient": None,
    f"{_SCHEDULER}._preempt_request": ["self", "request", "timestamp", "drop_stale_output"],
    "vllm.v1.core.block_pool:BlockPool.get_new_blocks": ["self", "num_blocks"],
    "vllm.v1.kv_cache_interface:SlidingWindowSpec": None,
    _CPU_ATTN: None,
}
#: Methods called on what introspect returns (by it, the tools, benchmarks/prefill_profile.py).
CALLED = {
    "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": ["self"],
    f"{_CPU_ATTN}.forward": ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata",
                             "output", "output_scale", "output_block_scale"],
    f"{_CPU_ATTN}.do_kv_cache_update": ["self", "layer", "key", "value", "kv_cache", "slot_mapping"],
}


def _resolve(path: str):
    """The object at "module:Qual.name", independent of seam._require."""
    module_name, _, qualname = path.partition(":")
    obj = importlib.import_module(module_name)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


def _params(obj) -> list[str]:
    return list(inspect.signature(inspect.unwrap(obj)).parameters)


def _assigned(cls) -> set[str]:
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(cls)))


def test_every_symbol_introspect_requires_is_recorded():
    tree = ast.parse(inspect.getsource(introspect))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "_require"]
    assert calls
    for call in calls:  # SYMBOLS["..."] only: the table is the whole list of touches
        (arg,) = call.args
        assert (isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name)
                and arg.value.id == "SYMBOLS"), ast.unparse(call)
    assert set(introspect.SYMBOLS.values()) == set(RECORDED), (
        "record each new introspect symbol in RECORDED with its signature")


@pytest.mark.parametrize("path", sorted(RECORDED))
def test_symbol_has_recorded_signature(path):
    obj = _resolve(path)
    if RECORDED[path] is None:
        assert inspect.isclass(obj)
    else:
        assert _params(obj) == RECORDED[path]


@pytest.mark.parametrize("path", sorted(CALLED))
def test_called_method_has_recorded_signature(path):
    assert _params(_resolve(path)) == CALLED[path]


@pytest.mark.parametrize("path, attrs", [
    ("vllm.v1.engine.llm_engine:LLMEngine", {"engine_core"}),
    ("vllm.v1.engine.core_client:InprocClient", {"engine_core"}),
    ("vllm.v1.engine.core:EngineCore", {"scheduler"}),
    (_SCHEDULER, {"kv_cache_manager", "running", "waiting"}),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager", {"block_pool", "coordinator"}),
    ("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", {"single_type_managers"}),
    ("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
     {"req_to_blocks", "kv_cache_spec"}),
    ("vllm.v1.core.block_pool:BlockPool", {"num_gpu_blocks"}),
])
def test_instance_attributes_introspect_walks_are_assigned(path, attrs):
    cls = _resolve(path)
    assigned = set().union(*(_assigned(c) for c in cls.__mro__ if c.__module__.startswith("vllm")))
    assert attrs <= assigned, f"{path} no longer assigns {sorted(attrs - assigned)}"


def test_a_block_says_whether_it_is_null():
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    assert KVCacheBlock(block_id=0).is_null is False


def test_an_offline_engine_without_multiprocessing_gets_the_in_process_client():
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine
    assert "self.engine_core = EngineCoreClient.make_client(" in inspect.getsource(LLMEngine.__init__)
    make_client = inspect.getsource(EngineCoreClient.make_client)
    assert "multiprocess_mode" in make_client and "return InprocClient(" in make_client


def test_every_preemption_goes_through_preempt_request():
    """count_preemptions wraps ``_preempt_request``: the scheduler must preempt only through it
    (the one place that counts a request's preemptions) and call it as an attribute of self."""
    from vllm.v1.core.sched import scheduler
    source = inspect.getsource(scheduler)
    assert source.count("num_preemptions += 1") == 1
    assert "request.num_preemptions += 1" in inspect.getsource(_resolve(f"{_SCHEDULER}._preempt_request"))
    assert "self._preempt_request(" in inspect.getsource(_resolve(f"{_SCHEDULER}.schedule"))


def test_in_process_scheduler_reads_the_engine_core_in_this_process():
    from vllm.v1.engine.core_client import InprocClient
    client = object.__new__(InprocClient)  # no engine: only the attribute the view reads
    scheduler = object()
    client.engine_core = SimpleNamespace(scheduler=scheduler)
    assert introspect.in_process_scheduler(SimpleNamespace(engine_core=client)) is scheduler
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        introspect.in_process_scheduler(SimpleNamespace(engine_core=SimpleNamespace()))


def test_block_pool_and_held_blocks_by_kind():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    block = [SimpleNamespace(is_null=False), SimpleNamespace(is_null=True)]
    full = SimpleNamespace(kv_cache_spec=object(), req_to_blocks={"a": block * 2, "b": block[:1]})
    sliding = SimpleNamespace(kv_cache_spec=object.__new__(SlidingWindowSpec), req_to_blocks={"a": block})
    pool = object()
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=[full, sliding])))
    assert introspect.block_pool(scheduler) is pool
    assert introspect.held_blocks_by_kind(scheduler) == {"global": 3, "sliding": 1}


def test_count_preemptions_counts_and_passes_through():
    calls = []
    scheduler = SimpleNamespace(_preempt_request=lambda *args, **kwargs: calls.append((args, kwargs)))
    read = introspect.count_preemptions(scheduler)
    assert read() == 0
    scheduler._preempt_request("r", 1.0, drop_stale_output=True)
    scheduler._preempt_request("s", 2.0)
    assert read() == 2
    assert calls == [(("r", 1.0), {"drop_stale_output": True}), (("s", 2.0), {})]


def test_after_each_allocation_calls_back_then_unwinds():
    class Pool:
        def get_new_blocks(self, num_blocks):
            return list(range(num_blocks))
    pool, seen = Pool(), []
    with introspect.after_each_allocation(pool, lambda: seen.append(len(seen))):
        assert pool.get_new_blocks(3) == [0, 1, 2]
        pool.get_new_blocks(1)
    assert seen == [0, 1]
    assert "get_new_blocks" not in vars(pool)  # the class's method again
    pool.get_new_blocks(2)
    assert seen == [0, 1]


def test_cpu_attention_impl_is_vllms_class():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    assert introspect.cpu_attention_impl() is CPUAttentionBackendImpl


def test_a_renamed_symbol_fails_naming_it_and_the_supported_range(monkeypatch):
    monkeypatch.setitem(introspect.SYMBOLS, "preempt_request", f"{_SCHEDULER}._preempt_renamed")
    with pytest.raises(RuntimeError, match=r"Scheduler\._preempt_renamed") as error:
        introspect.count_preemptions(SimpleNamespace(_preempt_request=None))
    assert str(SUPPORTED_VLLM) in str(error.value)
