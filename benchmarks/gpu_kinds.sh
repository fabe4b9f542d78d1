#!/usr/bin/env bash
# Issue 53, item 4, in ONE device call of about 5 minutes: the GPU checks of the new draft kinds (P-EAGLE's
# one flex layer call, DFlash's trainer on the device, each against its reference: gpu_check.py), then
# train_draft / train_dflash end to end at Llama-3.1-8B sizes for peagle, dflash and eagle3 (default
# config, one 2048-token sequence a step, shards made once on local disk and shared by the three), and one
# summary line per kind. Each part has its own timeout, cut to what is left of GPU_KINDS_BUDGET seconds
# (default 280); a failed check is reported and the timings still run. Logs go to $OUT (default ./gpu_out).
#
#   bash benchmarks/gpu_kinds.sh
#   GPU_KINDS_TINY=1 PYTHON=.venv/bin/python bash benchmarks/gpu_kinds.sh    # tiny sizes, the plumbing on a CPU
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TINY=${GPU_KINDS_TINY:-0}
CHECK_MAX=100
if [ "$TINY" = 1 ]; then CHECK_MAX=300; fi  # the checks' small draft on a 2-core CPU takes minutes
export GPU_ALL_ONLY_FUNCTIONS=1 GPU_ALL_SMALL=$TINY GPU_ALL_BUDGET=${GPU_KINDS_BUDGET:-$([ "$TINY" = 1 ] && echo 600 || echo 280)}
source benchmarks/gpu_all.sh  # part(), $OUT, $PY, $SMALL, the budget's clock
DATA=${GPU_KINDS_DATA:-${TMPDIR:-/tmp}/gpu_kinds_data}  # the shards: local disk, not $OUT (they do not come back)
E2E=(--sizes llama8b --seqs 20 --steps 20 --warmup 8 --data "$DATA")

{
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"

part check_kinds $CHECK_MAX $PY benchmarks/gpu_check.py --kinds peagle dflash
check_rc=$?
for kind in peagle dflash eagle3; do
  max=120  # peagle: the shards are made here (the first part to need them), then its flex kernel compiles
  [ "$kind" = dflash ] && max=70  # nothing compiled
  [ "$kind" = eagle3 ] && max=130  # compiling its step takes about a minute cold (RESULTS.md); it gets what is left
  part "e2e_$kind" "$max" $PY benchmarks/bench_train_e2e.py "${E2E[@]}" --kind "$kind" --out "$OUT/$kind" "${SMALL[@]}"
done

echo "== summary ($(( $(date +%s) - START ))s)"
$PY - "$OUT" "$check_rc" <<'EOF'
import json, sys
from pathlib import Path

out, check_rc = Path(sys.argv[1]), int(sys.argv[2])
log = (out / "check_kinds.log").read_text(errors="replace") if (out / "check_kinds.log").exists() else ""
checks = {line.split()[1]: line for line in log.splitlines() if line.startswith("CHECK ")}
for kind in ("peagle", "dflash", "eagle3"):
    check = checks.get(kind, "not checked in this call" if kind == "eagle3" else f"no result (gpu_check exit {check_rc})")
    rows = []
    p = out / f"e2e_{kind}.log"
    for line in (p.read_text(errors="replace").splitlines() if p.exists() else []):
        if line.startswith("SUMMARY "):
            rows = json.loads(line[len("SUMMARY "):])
    if rows:
        r = rows[0]
        timing = (f"{r['size']} {r['tokens_per_s']:,} tok/s, {r['step_ms']} ms/step, MFU {100 * r['mfu']:.1f}%, peak {r['peak_gib']} GiB, "
                  f"loss {r['loss_first']} -> {r['loss_last']}")
    else:
        timing = f"no timing (see {p.name} and {p.stem}.err)"
    print(f"KIND {kind}: {timing} | {check.strip()}")
EOF
