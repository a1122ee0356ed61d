"""The CPU attention builder's ISA, read and set where vLLM keeps it.

Runs in the worker process. H2O reads K back from the CPU cache in the ``vec``/``vec16``
layouts (``worker/cpu/layout.py``, verified in the CPU cache study); others, such as AMX, pack
K differently, so an H2O engine runs one of those two.
"""
from __future__ import annotations

READABLE_ISAS = ("vec", "vec16")


def use_readable_isa(builder, layer_names) -> str:
    """Switch ``builder`` (a ``CPUAttentionMetadataBuilder``) and its layers to a readable ISA
    if vLLM chose another; returns the ISA in use."""
    if builder.isa not in READABLE_ISAS:
        builder.isa = "vec" if builder.block_size % 32 == 0 else "vec16"
        builder._set_isa_to_layers(layer_names)
    return builder.isa
