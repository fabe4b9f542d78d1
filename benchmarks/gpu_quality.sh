#!/usr/bin/env bash
# benchmarks/draft_quality.py on the lent GPU machine, over several back-to-back calls (the machine keeps
# /tmp while it stays warm between them). What one call cannot carry arrives in parts first:
#
#   bash benchmarks/gpu_quality.sh take FILE...   copy carried files to /tmp/dq_in (the GGUF's parts, the wheels)
#   bash benchmarks/gpu_quality.sh data [ARGS]    join the GGUF, install the wheels, questions + answers (draft_quality.py
#                                                 data ARGS), then states for the sizes in $SIZES (default: its own)
#   bash benchmarks/gpu_quality.sh train [ARGS]   both trainers at every size (draft_quality.py train ARGS)
#   bash benchmarks/gpu_quality.sh rest [ARGS]    train, then eval and report in one call (REST_BUDGET seconds)
#   bash benchmarks/gpu_quality.sh eval           offline acceptance, report; results to $OUT
#
# The wheels (.whl/): speculators 0.9.0 and its needs (shared bench README), gguf and jsonschema with theirs.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}
IN=/tmp/dq_in
DIR=${DQ_DIR:-/tmp/dq}
mkdir -p "$OUT" "$IN" "$DIR"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stage=$1
shift

case $stage in
  take)
    cp -v "$@" "$IN"/ ;;
  data)
    nvidia-smi -L
    if [ -d .whl ]; then cp .whl/*.whl "$IN"/; fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$IN"/*.whl || exit 1
    cat "$IN"/gguf.part.* > "$IN"/model.gguf && ls -l "$IN"/model.gguf
    $PY -c "import torch, transformers, speculators, gguf, jsonschema; print('torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1
    $PY benchmarks/draft_quality.py data --dir "$DIR" --gguf "$IN"/model.gguf --mtbench "$IN"/question.jsonl "$@" \
      && $PY benchmarks/draft_quality.py states --dir "$DIR" ${SIZES:+--sizes $SIZES} ;;
  train)
    $PY benchmarks/draft_quality.py train --dir "$DIR" "$@" ;;
  check)
    $PY benchmarks/draft_quality.py check --dir "$DIR" "$@" ;;
  rest)  # train at every size (ARGS: draft_quality.py train's), then eval and report, inside REST_BUDGET seconds
    BUDGET=${REST_BUDGET:-570}; START=$(date +%s)
    left() { echo $((BUDGET - ($(date +%s) - START))); }
    most() { local n=$(( $(left) - $1 )); echo $(( n > 1 ? n : 1 )); }  # timeout refuses 0 and negatives
    timeout -k 5 "$(most 170)" $PY benchmarks/draft_quality.py train --dir "$DIR" "$@"
    echo "== train exit $?, $(left) s left"
    timeout -k 5 "$(most 10)" $PY benchmarks/draft_quality.py eval --dir "$DIR" \
      && $PY benchmarks/draft_quality.py report --dir "$DIR"
    cp "$DIR"/*.jsonl "$DIR"/quality.* "$OUT"/ 2>/dev/null ;;
  eval)
    $PY benchmarks/draft_quality.py eval --dir "$DIR" "$@" && $PY benchmarks/draft_quality.py report --dir "$DIR"
    cp "$DIR"/*.jsonl "$DIR"/quality.* "$OUT"/ 2>/dev/null ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
