#!/usr/bin/env bash
# A second device call beside gpu_all.sh: a profile of the step (device time by kind of kernel),
# train_draft end to end with the memory/speed trade-off that config options give (recompute off,
# the draft lm_head frozen as the peer's is), and the peer again, so that the ratios come from one
# call. Same layout as gpu_all.sh ($OUT, budget, logs).
#
#   bash benchmarks/gpu_variants.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
export GPU_ALL_ONLY_FUNCTIONS=1
source benchmarks/gpu_all.sh
run_env
# where the step's device time goes, by kind of kernel (the default path, both sizes)
part step_profile 150 $PY benchmarks/bench_train.py --sizes llama8b kimi --ttt 7 --iters 6 --profile "${SMALL[@]}"
part e2e_llama8b_frozen_norecompute 170 $PY benchmarks/bench_train_e2e.py --sizes llama8b --out "$OUT/a" --config '{"freeze_lm_head": true, "recompute": false}' "${SMALL[@]}"
run_peer
part e2e_kimi_frozen_norecompute 200 $PY benchmarks/bench_train_e2e.py --sizes kimi --out "$OUT/c" --config '{"freeze_lm_head": true, "recompute": false}' "${SMALL[@]}"
echo "== summary ($(( $(date +%s) - START ))s)"
$PY benchmarks/gpu_summary.py "$OUT"
