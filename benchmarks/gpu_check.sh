#!/usr/bin/env bash
# H2O on one CUDA GPU: kernels compiled on the GPU, engine exactness against the dense oracle,
# >= 100 concurrent requests, per-layer kernel cost, and throughput stock vs H2O 20% at the same
# number of KV blocks on an 8B-shaped model.
#
#   benchmarks/gpu_check.sh             # writes benchmarks/results/<date>-<host>-gpu/
#   benchmarks/gpu_check.sh --dry-run   # everything up to the first GPU call (runs on a CPU)
#   PYTHON=python3 OUT_DIR=/tmp/x GPU_BUNDLE=.gpu-bundle benchmarks/gpu_check.sh
#   ONLY=engine,load benchmarks/gpu_check.sh     # setup, then only these GPU steps
#
# All steps need more than one 9-minute call on the bundle (the first H200 run, 2026-12-04:
# setup ~60 s a call, every spawned engine ~30 s of imports there). Within a 15-minute lease,
# two calls (each starts with the setup):
#   ONLY=kernels,engine,load                          ~430 s
#   ONLY=step_timing,throughput_stock,throughput_h2o  ~330 s
# and, with a third call or a later lease, the fp8 KV cache at equal bytes:
#   ONLY=throughput_stock_fp8,throughput_h2o_fp8      ~260 s (estimate: two engines as above)
# and the score modes' cost at the same workload and pool (issue 59; compare with throughput_h2o
# of the same lease, or rerun throughput_stock beside them):
#   ONLY=throughput_stock,throughput_h2o_keydiff,throughput_h2o_expected   ~390 s (estimate)
#
# vLLM: the environment's, if `import vllm` works; otherwise the offline bundle (make gpu-bundle,
# packaging/gpu_bundle/README.md), installed with pip --no-index --no-deps into a temporary
# folder put on PYTHONPATH. The dry run always installs the bundle, into a clean folder.
# Every step runs even if an earlier one failed, under its own time cap (STEP_CAPS below, in
# seconds, overridable as CAP_<step>=N); the exit status is non-zero if any failed.
# gpu_check.json in the output folder records each step's status, seconds and cap, the test
# counts, the load check and the throughput ratio; <step>.log holds each step's output.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-$REPO/.gpu-bundle}
SUFFIX=gpu; [ $DRY_RUN = 1 ] && SUFFIX=gpu-dry-run
OUT=${OUT_DIR:-benchmarks/results/$(date +%F)-$(hostname -s)-$SUFFIX}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 GPU_CHECK_DRY_RUN=$DRY_RUN GPU_CHECK_COMMAND="$0 $*"
# The checkout (h2o_vllm, h2o_devtools) and packaging/ (the gpu_bundle helpers).
export PYTHONPATH="$REPO:$REPO/packaging${PYTHONPATH:+:$PYTHONPATH}"
STEPS_FILE=$OUT/steps.txt; : > "$STEPS_FILE"
# Throughput workload (issue 13): 512 in / 384 out, ignore_eos; a pool of 16 full sequences
# (16 x 896 tokens / 16 per block) for both sides. 1024 new tokens did not finish within the
# cap on the H200 (engine start ~50 s, ~45 ms a step).
NUM_PROMPTS=${NUM_PROMPTS:-32} IN_LEN=${IN_LEN:-512} OUT_LEN=${OUT_LEN:-384}
BLOCKS=${BLOCKS:-$(( 16 * (IN_LEN + OUT_LEN) / 16 ))}
# One call must end within 9 minutes (BUDGET_S): every step gets its cap, cut to what is left.
# Setup took 40-100 s in rehearsals and 55-60 s on the H200 (its caps: 225 s).
BUDGET_S=${BUDGET_S:-540}
declare -A STEP_CAPS=([bundle_verify]=30 [bundle_install]=60 [imports]=90 [triton_compile]=180 [models]=45
                      [kernels]=90 [step_timing]=40 [engine]=240 [load]=55
                      [throughput_stock]=120 [throughput_h2o]=120
                      [throughput_stock_fp8]=120 [throughput_h2o_fp8]=120
                      [throughput_h2o_keydiff]=120 [throughput_h2o_expected]=120)

step() {  # step NAME COMMAND...: run under its cap, log to $OUT/NAME.log, record exit and seconds
  local name=$1; shift
  local cap_var="CAP_$name" cap t0=$SECONDS rc left
  cap=${!cap_var:-${STEP_CAPS[$name]:-60}}
  left=$(( BUDGET_S - SECONDS - 5 ))
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then  # out of time (or capped off): recorded as timed out, not started
    echo "== $name: not started: cap ${cap}s, ${left}s left of the ${BUDGET_S}s budget" | tee "$OUT/$name.log"
    echo "$name 124 0 0" >> "$STEPS_FILE"
    return
  fi
  echo "== $name (cap ${cap}s): $*"
  # timeout signals the whole process group, engine subprocesses included.
  timeout --kill-after=10 "$cap" "$@" > >(tee "$OUT/$name.log") 2>&1
  rc=$?
  echo "$name $rc $((SECONDS - t0)) $cap" >> "$STEPS_FILE"
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
}

# -- setup: vLLM (bundle if needed) and the models ------------------------------------------
MODE=installed
if [ $DRY_RUN = 1 ] || ! "$PY" -c "import vllm" >/dev/null 2>&1; then MODE=bundle; fi
export GPU_CHECK_MODE=$MODE
BUNDLE_ARGS=()
if [ $MODE = bundle ]; then
  SITE=$WORK/site
  step bundle_verify "$PY" -m gpu_bundle.bundle verify "$BUNDLE"
  cp "$BUNDLE/manifest.json" "$OUT/bundle-manifest.json" 2>/dev/null
  # Offline and without dependencies: only the bundle's wheels, for the GPU machine's Python.
  # shellcheck disable=SC2046
  step bundle_install "$PY" -m pip install --quiet --no-index --no-deps --no-compile \
    --target "$SITE" $("$PY" -m gpu_bundle.bundle pip-target) "$BUNDLE"/wheels/*.whl
  if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
    # Every module the GPU steps load, imported before any GPU call: names what is missing.
    IMPORT_ARGS=(); [ $DRY_RUN = 0 ] && IMPORT_ARGS=(--expect-cuda)
    step imports "$PY" -m gpu_bundle.imports "${IMPORT_ARGS[@]}"
    # Rehearsal only: the engines' Triton kernels compiled for sm_90 with this Triton, no GPU.
    [ $DRY_RUN = 1 ] && step triton_compile "$PY" -m gpu_bundle.triton_aot
  else  # a dry run elsewhere: the cp312 wheels installed but cannot load in this Python
    echo "== $PY is not Python 3.12: the bundle is installed but not put on PYTHONPATH"
  fi
  eval "$("$PY" -m gpu_bundle.settings env)"
  mapfile -t BUNDLE_ARGS < <("$PY" -m gpu_bundle.settings flags)
  export GPU_CHECK_SETTINGS="$("$PY" -m gpu_bundle.settings env | tr '\n' ' ') ${BUNDLE_ARGS[*]}"
fi
MODELS=$WORK/models
step models "$PY" -m gpu_bundle.check_models --out "$MODELS" --tokenizer "$BUNDLE/tokenizer"

# -- the GPU steps ----------------------------------------------------------------------------
gpu_step() {  # gpu_step NAME COMMAND...: a step; in a dry run only logged, not started
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return  # ONLY=engine,load: a rerun of some GPU steps in what is left of a lease
  fi
  if [ $DRY_RUN = 1 ]; then
    echo "== $name (dry run, not started): $(printf '%q ' "$@")" | tee "$OUT/$name.log"
  else
    step "$name" "$@"
  fi
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
# Verbose: one line per test as it ends, so a step its cap kills still names its failures.
ENGINE_PYTEST=("$PY" -m pytest -v -p no:cacheprovider) LOAD_ARGS=()
if [ $MODE = bundle ]; then
  # The bundle's engine settings for every LLM the tests build; no CUDA-graph engine (no _C).
  ENGINE_PYTEST+=(-p gpu_bundle.pytest_bundle -k "not piecewise and not speculative and not v2-") LOAD_ARGS=(--bundle-settings)
fi
BENCH=("$PY" -m h2o_vllm.frontend.cli bench throughput --model "$MODELS/llama-8b-shape"
       --load-format dummy --dtype bfloat16 --dataset-name random
       --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --num-prompts "$NUM_PROMPTS"
       --max-model-len $(( IN_LEN + OUT_LEN + 512 )) --block-size 16
       --num-gpu-blocks-override "$BLOCKS" --no-enable-prefix-caching
       --seed 0 "${BUNDLE_ARGS[@]}")

# 1. Triton kernels and the CUDA step, compiled for the GPU (the tests CI runs interpreted).
gpu_step kernels env TRITON_INTERPRET=0 "${PYTEST[@]}" tests/unit/kernels/test_kernels.py \
  tests/unit/kernels/test_split_decode.py tests/unit/kernels/test_select.py \
  tests/unit/worker/test_step.py --junitxml="$OUT/kernels.xml"
# 2. Per-layer cost of H2O's score accumulation and compaction, beside one SDPA.
gpu_step step_timing "$PY" benchmarks/cuda_step_timing.py --out "$OUT/cuda_step_timing.json"
# 3. Engines: H2O vs the dense oracle over the budget matrix, H2O off == stock Triton
#    attention, blocks drain.
#    Speculative decoding too (with the bundle, -k deselects that module by its name).
gpu_step engine "${ENGINE_PYTEST[@]}" tests/engine/test_cuda.py tests/engine/test_cuda_speculative.py \
  --junitxml="$OUT/engine.xml"
# 4. >= 100 concurrent requests, mixed lengths and budgets: 0 failures, pool idle after.
gpu_step load "$PY" -m gpu_bundle.load --model "$MODELS/tiny-llama" --out "$OUT/load.json" \
  --gpu-memory-utilization 0.3 --num-blocks 8192 "${LOAD_ARGS[@]}"
# 5. Throughput at the same KV pool: stock vLLM on Triton attention vs H2O 20%.
gpu_step throughput_stock "${BENCH[@]}" --attention-backend TRITON_ATTN \
  --output-json "$OUT/throughput-stock.json"
gpu_step throughput_h2o "${BENCH[@]}" --kv-eviction h2o --h2o-heavy-ratio 0.1 \
  --h2o-recent-ratio 0.1 --output-json "$OUT/throughput-h2o.json"
# 6. fp8 KV cache (e4m3, per-tensor scales) at the same KV bytes, twice the blocks: stock fp8 vs
#    H2O 20% + fp8 (issue 41; the flag's last value wins).
gpu_step throughput_stock_fp8 "${BENCH[@]}" --attention-backend TRITON_ATTN --kv-cache-dtype fp8 \
  --num-gpu-blocks-override $(( 2 * BLOCKS )) --output-json "$OUT/throughput-stock-fp8.json"
gpu_step throughput_h2o_fp8 "${BENCH[@]}" --kv-eviction h2o --h2o-heavy-ratio 0.1 \
  --h2o-recent-ratio 0.1 --kv-cache-dtype fp8 --num-gpu-blocks-override $(( 2 * BLOCKS )) \
  --output-json "$OUT/throughput-h2o-fp8.json"

# 7. The score modes past attention sums (issue 59), H2O 20% as in 5: KeyDiff ranks by the keys,
#    Expected Attention by the last 32 queries moved ahead with RoPE, at every compaction.
for score in keydiff expected; do
  gpu_step "throughput_h2o_$score" "${BENCH[@]}" --kv-eviction h2o --h2o-heavy-ratio 0.1 \
    --h2o-recent-ratio 0.1 --h2o-score "$score" --output-json "$OUT/throughput-h2o-$score.json"
done
"$PY" -m gpu_bundle.report "$OUT" "$STEPS_FILE"
failed=$(awk '$2 != 0 {print $1}' "$STEPS_FILE" | tr '\n' ' ')
if [ -n "$failed" ]; then echo "gpu_check: failed steps: $failed; results in $OUT"; exit 1; fi
echo "gpu_check: all steps passed$([ $DRY_RUN = 1 ] && echo ' (dry run: no GPU step started)'); results in $OUT"
