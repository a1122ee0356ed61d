"""benchmarks/prefill_profile.py names the functions it times by reference: each still exists
under the name its callers look up, so a rename fails here rather than timing nothing. (Its run
end to end: tests/engine/test_benchmarks_run.py.)"""
import types

import pytest


@pytest.fixture(scope="module")
def profile(load_benchmark):
    return load_benchmark("prefill_profile")


def test_every_timed_part_resolves_to_the_attribute_its_callers_use(profile):
    parts = profile.timed_parts()
    assert {part for part, _, _ in parts} >= {"vLLM attention kernel", "K/V write", "H2O step metadata",
                                              "H2O compaction"}
    for part, owner, fn in parts:
        name = profile.attribute_name(owner, fn)
        assert getattr(owner, name) is fn, part


def test_a_function_held_under_another_name_is_refused(profile):
    def renamed():
        pass
    owner = types.SimpleNamespace(old_name=renamed)
    with pytest.raises(RuntimeError, match="timed_parts"):
        profile.attribute_name(owner, renamed)


def test_install_wraps_each_part_once(profile, monkeypatch):
    timer = profile.PartTimer()
    originals = [(owner, profile.attribute_name(owner, fn), fn) for _, owner, fn in profile.timed_parts()]
    for owner, name, fn in originals:  # undone after the test
        monkeypatch.setattr(owner, name, fn)
    timer.install()
    for owner, name, fn in originals:
        assert getattr(owner, name) is not fn
