"""Probe (not shipped): does SnapKV-style pooling of scores before the heavy-hitter pick keep
the pass key? Dense oracle on SmolLM2-135M, the quality benchmark's pass-key prompts."""
import sys, time, json
import torch
import torch.nn.functional as F
sys.path.insert(0, "/work/main/benchmarks")
from transformers import AutoModelForCausalLM, AutoTokenizer
from h2o_vllm.config import H2OConfig
from h2o_vllm.oracle import H2OOracle
from h2o_vllm.oracle import cache as oc
from h2o_vllm.tools import models
import quality

POOL = int(sys.argv[1]); N = int(sys.argv[2]); CONFIGS = sys.argv[3].split(";")
orig = oc.LayerCache.compact
def pooled(self, heavy, recent, sinks=0):
    """Select on scores max-pooled over POOL neighbours. Simplification of this probe: the
    kept tokens carry their pooled scores on (later compactions see them)."""
    if POOL > 1:
        n = self.kv_len
        s = self._scores[:, :n].unsqueeze(1)
        self._scores[:, :n] = F.max_pool1d(s, POOL, stride=1, padding=POOL // 2).squeeze(1)[:, :n]
    return orig(self, heavy, recent, sinks)
oc.LayerCache.compact = pooled

d = models.smollm2_dir()
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
filler = tok.encode(quality.available_texts("gpl3")["gpl3"], add_special_tokens=False)
items = quality.passkey_prompts(tok, filler, N, 512, 0)
for c in CONFIGS:
    cfg = H2OConfig.from_dict(json.loads(c)) if c != "full" else None
    t = time.time()
    o = H2OOracle(model, cfg, block_size=32)
    outs = o.generate([p for p, _ in items], 12)
    hits = sum(k in tok.decode(out) for out, (_, k) in zip(outs, items))
    print(f"pool={POOL} {c}: {hits}/{N} ({time.time()-t:.0f}s)", flush=True)
