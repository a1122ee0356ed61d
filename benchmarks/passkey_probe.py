"""Probe (not shipped): does SnapKV-style pooling of scores before the heavy-hitter pick keep
the pass key? Dense oracle on SmolLM2-135M, the quality benchmark's pass-key prompts.

Produced ``benchmarks/results/2026-12-01-vm/passkey-pooling-probe/`` (its README has the
table, ``probe.txt`` the raw lines). Since then the idea ships as ``pool_kernel``
(docs/score-modes.md), which pools at the prompt's compaction only; this probe pools at every
compaction and carries the pooled scores on.

    python benchmarks/passkey_probe.py POOL N 'CONFIG;CONFIG;...'   # CONFIG: full or H2O JSON
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import quality  # benchmarks/quality.py, beside this script
from h2o_devtools import models
from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import H2OOracle
from h2o_vllm.oracle import cache as oc


def main() -> None:
    pool_size, n, configs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(";")
    original = oc.LayerCache.compact

    def pooled(self, heavy, recent, sinks=0, pool=1):
        """Select on scores max-pooled over ``pool_size`` neighbours. Simplification of this
        probe: the kept tokens carry their pooled scores on (later compactions see them)."""
        if pool_size > 1:
            n = self.kv_len
            s = self._scores[:, :n].unsqueeze(1)
            self._scores[:, :n] = F.max_pool1d(s, pool_size, stride=1, padding=pool_size // 2).squeeze(1)[:, :n]
        return original(self, heavy, recent, sinks, pool)
    oc.LayerCache.compact = pooled

    d = models.smollm2_dir()
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    filler = tok.encode(quality.available_texts("gpl3")["gpl3"], add_special_tokens=False)
    items = quality.passkey_prompts(tok, filler, n, 512, 0)
    for c in configs:
        cfg = H2OConfig.from_dict(json.loads(c)) if c != "full" else None
        t = time.time()
        o = H2OOracle(model, cfg, block_size=32)
        outs = o.generate([p for p, _ in items], 12)
        hits = sum(k in tok.decode(out) for out, (_, k) in zip(outs, items))
        print(f"pool={pool_size} {c}: {hits}/{n} ({time.time() - t:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
