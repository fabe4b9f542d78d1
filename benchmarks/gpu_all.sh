#!/usr/bin/env bash
# Everything issue 12 measures, in ONE device call (about 10 minutes on an H200, cold):
#   a correctness check of train_draft's CUDA path (fails fast), train_draft end to end at
#   Llama-3.1-8B and Kimi-K2.5 sizes (TTT 7; the default, FP8 products on Hopper, and Kimi again with
#   fp8 off), the peer (speculators) at both, extraction with its
#   forward ceiling, the step-only bench, then a summary table with the ratios to the peer.
# Each part has its own timeout, cut to what is left of GPU_ALL_BUDGET seconds (default 540), so a
# hang costs one part, not the call. Logs and results go to $OUT (default ./gpu_out).
#
#   bash benchmarks/gpu_all.sh
#
# The peer needs speculators: put its wheels in .whl/ (../shared/bench/README.md lists them) and
# its benchmark in shared_bench/; both are installed/used from there when present.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # BASH_SOURCE: right when sourced too (GPU_ALL_ONLY_FUNCTIONS=1)
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${GPU_ALL_BUDGET:-590}
START=$(date +%s)
PY=${PYTHON:-python3}
SMALL=()  # GPU_ALL_SMALL=1: tiny sizes, to try the plumbing on a CPU machine
if [ "${GPU_ALL_SMALL:-0}" = 1 ]; then SMALL=(--small); fi

part() {  # part NAME MAX_SECONDS CMD...: run with a timeout cut to the budget left, log to $OUT/NAME.log
  local name=$1 max=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  local t=$((max < left ? max : left))
  if ((t < 20)); then
    echo "== $name: skipped, ${left}s of the budget left" | tee "$OUT/$name.log"
    return 0
  fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START ))s into the call): $*"
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2> "$OUT/$name.err"
  local rc=$?
  grep -v '^SUMMARY ' "$OUT/$name.log" | cut -c1-600
  if ((rc == 124 || rc == 137)); then echo "== $name: TIMED OUT after ${t}s; stderr tail:"; tail -n 8 "$OUT/$name.err"
  elif ((rc != 0)); then echo "== $name: FAILED (exit $rc); stderr tail:"; tail -n 25 "$OUT/$name.err"; fi
  return $rc
}

run_env() {
  {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
    $PY -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    git log --oneline -1 2>/dev/null || true
  } 2>&1 | tee "$OUT/env.log"
  if [ -d .whl ] && ! $PY -c "import speculators" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
}

run_peer() {  # the peer, same call (its compiled step, eager loss: its fused loss does not compile here)
  if [ -f shared_bench/bench_speculators.py ]; then
    part peer 200 env LOSS_IMPL=eager $PY shared_bench/bench_speculators.py --ttt 7 --sizes llama8b kimi --iters 8 "${SMALL[@]}"
  else
    echo "== peer: shared_bench/bench_speculators.py missing, skipped" | tee "$OUT/peer.log"
  fi
}

if [ "${GPU_ALL_ONLY_FUNCTIONS:-0}" = 1 ]; then return 0; fi

run_env
# 1. correctness first: stop here if the fast path computes something else
if ! part check 280 $PY benchmarks/gpu_check.py; then
  echo "GPU CHECK FAILED: nothing timed (see $OUT/check.log)"
  exit 1
fi
# 2. train_draft end to end, default config (shards on local disk, made by extract_hidden)
part e2e_llama8b 170 $PY benchmarks/bench_train_e2e.py --sizes llama8b --out "$OUT" "${SMALL[@]}"
# 3. the peer, same call
run_peer
part e2e_kimi 200 $PY benchmarks/bench_train_e2e.py --sizes kimi --out "$OUT" "${SMALL[@]}"
# the default above has FP8 products where the GPU has them (train.fp8: auto); the same run in bf16
part e2e_kimi_bf16 150 $PY benchmarks/bench_train_e2e.py --sizes kimi --out "$OUT/bf16" --config '{"fp8": false}' "${SMALL[@]}"
# 4. extraction end to end (shard written) and its forward ceiling in the same process
part extract 120 $PY benchmarks/bench_extract.py --seqs 64 --out "${TMPDIR:-/tmp}" "${SMALL[@]}"
# 5. the step alone on GPU-resident tensors, the path train_draft picks by default
part step 90 $PY benchmarks/bench_train.py --sizes llama8b --ttt 7 --iters 8 "${SMALL[@]}"
# 6. if time is left: where the Kimi-size step's time goes, and the trained-lm_head option's cost
if (( BUDGET - ($(date +%s) - START) >= 60 )); then
  part step_profile 80 $PY benchmarks/bench_train.py --sizes kimi --ttt 7 --iters 6 --profile "${SMALL[@]}"
fi
if (( BUDGET - ($(date +%s) - START) >= 80 )); then
  part e2e_llama8b_trained_head 100 $PY benchmarks/bench_train_e2e.py --sizes llama8b --out "$OUT/trained" --config '{"freeze_lm_head": false}' "${SMALL[@]}"
fi

echo "== summary ($(( $(date +%s) - START ))s)"
$PY benchmarks/gpu_summary.py "$OUT"
