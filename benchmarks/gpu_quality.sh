#!/usr/bin/env bash
# benchmarks/draft_quality.py on the lent GPU machine, over several back-to-back calls (the machine keeps
# /tmp while it stays warm between them). What one call cannot carry arrives in parts first:
#
#   bash benchmarks/gpu_quality.sh take FILE...   copy carried files to /tmp/dq_in (the GGUF's parts, the wheels)
#   bash benchmarks/gpu_quality.sh data [ARGS]    join the GGUF, install the wheels, questions + answers (draft_quality.py
#                                                 data ARGS), then states for the sizes in $SIZES (default: its own)
#   bash benchmarks/gpu_quality.sh states [ARGS]  states again (a chunk already extracted is kept)
#   bash benchmarks/gpu_quality.sh train [ARGS]   both trainers at every size (draft_quality.py train ARGS)
#   bash benchmarks/gpu_quality.sh side G...      trainers side by side, one process per group "[SUB@]SIZES/TRAINERS"
#                                                 (SUB: a directory under the working one, e.g. conv's sets)
#   bash benchmarks/gpu_quality.sh conv [ARGS]    after data: two-turn conversations against first turns (issue 54,
#                                                 conversation_quality.py data ARGS), and both sets' states
#   bash benchmarks/gpu_quality.sh rest [ARGS]    train, then eval and report in one call (REST_BUDGET seconds)
#   bash benchmarks/gpu_quality.sh eval           offline acceptance, report; results to $OUT
#
# The wheels (.whl/ or carried into $IN): speculators 0.9.0 and its needs (shared bench README), gguf and jsonschema
# with theirs; the data stage needs only the latter (and transformers), so the wheels can arrive over several calls.
# The GGUF may arrive as gguf.part.* or as xz-compressed model.gguf.xz.part.* (98 MB -> 90 MB).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu_out}
IN=/tmp/dq_in
DIR=${DQ_DIR:-/tmp/dq}
mkdir -p "$OUT" "$IN" "$DIR"
export PYTHONPATH=/tmp/site:${EXTRA_SITE:+$EXTRA_SITE:}$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stage=$1
shift
install_wheels() {  # what was carried into $IN or .whl/ this call or earlier ones (the machine keeps /tmp)
  local w=("$IN"/*.whl); if [ -d .whl ]; then w+=(.whl/*.whl); fi
  [ -e "${w[0]}" ] || return 0
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${w[@]}"
}

case $stage in
  take)
    cp -v "$@" "$IN"/ ;;
  data)
    nvidia-smi -L
    install_wheels || exit 1
    if [ ! -f "$IN"/model.gguf ]; then
      if ls "$IN"/model.gguf.xz.part.* >/dev/null 2>&1; then cat "$IN"/model.gguf.xz.part.* | xz -d -T0 > "$IN"/model.gguf
      else cat "$IN"/gguf.part.* > "$IN"/model.gguf; fi
    fi
    ls -l "$IN"/model.gguf
    $PY -c "import torch, transformers, gguf, jsonschema; print('torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1
    $PY benchmarks/draft_quality.py data --dir "$DIR" --gguf "$IN"/model.gguf --mtbench "$IN"/question.jsonl "$@" \
      && $PY benchmarks/draft_quality.py states --dir "$DIR" ${SIZES:+--sizes $SIZES} ;;
  states)
    $PY benchmarks/draft_quality.py states --dir "$DIR" "$@" ;;
  side)  # each ARG "SIZES/TRAINERS" (space-separated within) trains in its own process, all at once on the GPU,
         # inside SIDE_BUDGET seconds; logs to $OUT/side_N.log. Wall times then overlap: a quality run only.
    install_wheels || exit 1
    $PY -c "import speculators" || exit 1
    BUDGET=${SIDE_BUDGET:-540}; i=0; pids=()
    for group in "$@"; do
      dir=$DIR; case $group in *@*) dir=$DIR/${group%%@*}; group=${group#*@} ;; esac
      sizes=${group%%/*}; trainers=${group#*/}; i=$((i + 1))
      timeout -k 5 "$BUDGET" $PY benchmarks/draft_quality.py train --dir "$dir" --sizes $sizes --trainers $trainers \
        > "$OUT/side_$i.log" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; echo "== $pid exit $?"; done
    tail -n 3 "$OUT"/side_*.log
    for d in "$DIR" "$DIR"/conv "$DIR"/first; do  # the conv stage's two sets train in directories of their own
      [ -f "$d"/train_results.jsonl ] && cp "$d"/train_results.jsonl "$OUT"/train_results.$(basename "$d").jsonl
    done ;;
  conv)  # after data: conversations against first turns (benchmarks/conversation_quality.py), then both sets' states
    $PY benchmarks/conversation_quality.py data --dir "$DIR" --mtbench "$IN"/question.jsonl "$@" || exit 1
    for s in conv first; do
      n=$(cat "$DIR/$s"/traces/chunk_*.jsonl | wc -l)
      $PY benchmarks/draft_quality.py states --dir "$DIR/$s" --sizes "$n" || exit 1
    done ;;
  train)
    $PY benchmarks/draft_quality.py train --dir "$DIR" "$@" ;;
  check)
    $PY benchmarks/draft_quality.py check --dir "$DIR" "$@" ;;
  rest)  # train at every size (ARGS: draft_quality.py train's), then eval and report, inside REST_BUDGET seconds
    install_wheels || exit 1
    BUDGET=${REST_BUDGET:-570}; START=$(date +%s)
    left() { echo $((BUDGET - ($(date +%s) - START))); }
    most() { local n=$(( $(left) - $1 )); echo $(( n > 1 ? n : 1 )); }  # timeout refuses 0 and negatives
    timeout -k 5 "$(most 170)" $PY benchmarks/draft_quality.py train --dir "$DIR" "$@"
    echo "== train exit $?, $(left) s left"
    timeout -k 5 "$(most 10)" $PY benchmarks/draft_quality.py eval --dir "$DIR" \
      && $PY benchmarks/draft_quality.py report --dir "$DIR"
    cp "$DIR"/*.jsonl "$DIR"/quality.* "$OUT"/ 2>/dev/null ;;
  eval)  # EVAL_SUB: a directory under the working one (conv, first) instead of it
    d=$DIR${EVAL_SUB:+/$EVAL_SUB}; tag=${EVAL_SUB:+.$EVAL_SUB}
    $PY benchmarks/draft_quality.py eval --dir "$d" "$@" && $PY benchmarks/draft_quality.py report --dir "$d"
    for f in "$d"/eval_results.jsonl "$d"/quality.md; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "${f%.*}")$tag.${f##*.}"; done ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
