#!/usr/bin/env bash
# Run one of torch's FSDP2 test files one test at a time: natively, then, where the native run
# passed, switched to fsdp_lite (scripts/switch_torch_fsdp2_tests.py).
#   scripts/run_torch_fsdp2_tests.sh [--lift-gpu-gates] [--backend-collectives] [--fsdp1] [--ranks N]
#       DIR FILE [TIMEOUT_S] [PYTEST_K]
# DIR/native/FILE is torch's test file, put there by hand (never into this repo); the switched copy
# goes to DIR/switched/FILE. Both runs put scripts/torch_fsdp2_tests_compat on PYTHONPATH (the same
# harness for both) and this checkout before any installed fsdp_lite. Logs: DIR/logs/MODE/FILE/TEST.log;
# one line per test and mode in DIR/logs/FILE.tsv (test, mode, outcome, seconds). A test whose
# native line is already in the TSV is not run natively again.
# --lift-gpu-gates: skip_if_lt_x_gpu(n) runs the test on CPU too, both runs alike
# (torch_fsdp2_tests_compat/lift_gpu_gates/); give such runs a DIR of their own.
# --backend-collectives: fsdp_lite uses gloo's all-gather and reduce-scatter, not sends, so that
# torch's CommDebugMode counts them (torch_fsdp2_tests_compat/backend_collectives/).
# --fsdp1: one of torch's FSDP1 test files (test/distributed/fsdp/), switched by
# scripts/switch_torch_fsdp1_tests.py (scripts/run_torch_fsdp1_tests.sh passes it); torch's own
# FSDP1 gets device_id=cpu where it is given none (torch_fsdp2_tests_compat/sitecustomize.py).
# --ranks N: torch's FSDPTest runs N ranks where it reads its device count (common_fsdp's
# DEVICE_COUNT, 1 on a CPU-only machine), both runs alike (torch_fsdp2_tests_compat/sitecustomize.py).
set -u
LIFT=""; BACKEND=""; SWITCH=switch_torch_fsdp2_tests.py
while true; do
  case "${1:-}" in
    --lift-gpu-gates) LIFT=1; shift ;;
    --backend-collectives) BACKEND=1; shift ;;
    --fsdp1) SWITCH=switch_torch_fsdp1_tests.py; export FSDP_LITE_TORCH_TESTS_FSDP1=1; shift ;;
    --ranks) export FSDP_LITE_TORCH_TESTS_RANKS=$2; shift 2 ;;
    *) break ;;
  esac
done
DIR=$1; FILE=$2; TIMEOUT=${3:-600}; K=${4:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
export PYTHONPATH="$REPO/scripts/torch_fsdp2_tests_compat:$REPO"
if [ -n "$LIFT" ]; then
  PYTHONPATH="$REPO/scripts/torch_fsdp2_tests_compat/lift_gpu_gates:$PYTHONPATH"
fi
if [ -n "$BACKEND" ]; then
  PYTHONPATH="$REPO/scripts/torch_fsdp2_tests_compat/backend_collectives:$PYTHONPATH"
fi
mkdir -p "$DIR/switched" "$DIR/logs/native/$FILE" "$DIR/logs/switched/$FILE"
"$PY" "$REPO/scripts/$SWITCH" "$DIR/native/$FILE" -o "$DIR/switched/$FILE"
TSV="$DIR/logs/$FILE.tsv"; touch "$TSV"

run_one() {  # MODE TEST -> outcome on stdout
  local MODE=$1 T=$2 NAME=${2#*::} RC OUT START LOG
  LOG="$DIR/logs/$MODE/$FILE/${NAME//::/.}.log"
  START=$(date +%s)
  (cd "$DIR/$MODE" && timeout -k 10 "$TIMEOUT" nice -n 15 "$PY" -m pytest -q -rs -p no:cacheprovider "$T") > "$LOG" 2>&1
  RC=$?
  if [ $RC -eq 124 ] || [ $RC -eq 137 ]; then OUT=timeout
  elif grep -q " passed" "$LOG" && ! grep -q " failed" "$LOG"; then OUT=passed
  elif grep -q " skipped" "$LOG" && ! grep -qE " (failed|passed)" "$LOG"; then OUT=skipped
  else OUT=failed; fi
  printf '%s\t%s\t%s\t%s\n' "$NAME" "$MODE" "$OUT" "$(( $(date +%s) - START ))" >> "$TSV"
  echo "$OUT"
}

TESTS=$(cd "$DIR/native" && "$PY" -m pytest --collect-only -q "$FILE" ${K:+-k "$K"} 2>/dev/null | grep '::')
for T in $TESTS; do
  NAME=${T#*::}
  NATIVE=$(awk -F'\t' -v n="$NAME" '$1 == n && $2 == "native" {print $3}' "$TSV" | tail -1)
  [ -z "$NATIVE" ] && NATIVE=$(run_one native "$T")
  if [ "$NATIVE" = passed ] && ! awk -F'\t' -v n="$NAME" '$1 == n && $2 == "switched" {f=1} END {exit !f}' "$TSV"; then
    run_one switched "$T" > /dev/null
  fi
  grep -P "^\Q$NAME\E\t" "$TSV" | tail -2
done
