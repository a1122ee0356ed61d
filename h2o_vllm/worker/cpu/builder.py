"""H2OCPUMetadataBuilder: the stock CPU metadata, moved into KV space.

Runs in the worker process. RoPE positions stay logical (vLLM computes them); only the
slots this step writes, the lengths the kernel reads and its work plan change.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, CPUAttentionMetadataBuilder

from h2o_vllm.config import config_from_additional
from h2o_vllm.worker import announce_backend
from h2o_vllm.worker import plan as step_plan
from h2o_vllm.worker.plan import StepPlan, kv_slot_mapping
from h2o_vllm.worker.cpu.scores import DecodeIndex, decode_index

# The impl reads K/V back in these layouts (verified in the CPU cache study); others, such as
# AMX, pack K differently.
_READABLE_ISAS = ("vec", "vec16")


@dataclass
class H2OCPUAttentionMetadata(CPUAttentionMetadata):
    # None when H2O is off or outside a real step: the impl then behaves as stock vLLM.
    plan: StepPlan | None = None
    # Per-step indices every layer's impl reads (built once here, not once per layer):
    written: tuple[torch.Tensor, torch.Tensor] | None = None  # (block, offset) of new K/V
    decode: DecodeIndex | None = None                          # keys of the decode rows


class H2OCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.h2o = config_from_additional(vllm_config.additional_config)
        if self.h2o is not None and self.isa not in _READABLE_ISAS:
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)
        if self.h2o is not None:
            announce_backend("H2OCPUAttentionBackend", f"vLLM's CPU attention, ISA {self.isa}, "
                             "with H2O's torch scores and compaction")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> H2OCPUAttentionMetadata:
        cm = common_attn_metadata
        plan = step_plan.current() if self.h2o is not None else None
        if plan is not None:
            kv_seq_lens = plan.kv_seq_lens.to(torch.int32)
            cm = dataclasses.replace(
                cm, seq_lens=kv_seq_lens, max_seq_len=int(kv_seq_lens.max()),
                slot_mapping=kv_slot_mapping(plan, cm.block_table_tensor, cm.num_actual_tokens,
                                             self.block_size))
        metadata = super().build(common_prefix_len, cm, fast_build)
        written = decode = None
        if plan is not None:
            slots = metadata.slot_mapping[metadata.slot_mapping >= 0].long()
            written = (slots // self.block_size, slots % self.block_size)
            if plan.decode_rows.numel():
                rows = plan.decode_rows
                decode = decode_index(metadata.block_table[rows], plan.kv_seq_lens[rows], self.block_size)
        return H2OCPUAttentionMetadata(**{f.name: getattr(metadata, f.name)
                                          for f in dataclasses.fields(metadata)},
                                       plan=plan, written=written, decode=decode)
