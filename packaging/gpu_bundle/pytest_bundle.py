"""pytest plugin for the GPU check with the bundle: every ``vllm.LLM`` the tests build gets the
bundle's engine settings (``settings.apply``: eager, custom ops off, native norms).

Loaded by ``gpu_check.sh`` with ``-p gpu_bundle.pytest_bundle``; the tests themselves stay as
they are. Wrapping the constructor reaches every engine however a test spells its arguments.
"""
from __future__ import annotations


def pytest_configure(config):
    import vllm

    from gpu_bundle import settings

    original = vllm.LLM.__init__
    if getattr(original, "_gpu_bundle", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **settings.apply(kwargs))

    __init__._gpu_bundle = True
    vllm.LLM.__init__ = __init__
