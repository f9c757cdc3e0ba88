#!/usr/bin/env bash
# Conformance cases under valgrind, each rank its own log, then a count of what it found.
#
#   bash scripts/valgrind_cases.sh OUT_DIR [memcheck|helgrind] -- CONFORMANCE_ARGS...
#   e.g. bash scripts/valgrind_cases.sh /tmp/vg memcheck -- --impl fsdp_lite_fsdp2 --case NAME
#
# memcheck runs with --undef-value-errors=no: CPython's start-up hashes bytes valgrind counts as
# undefined (getrandom), and that taint reaches tensor code as thousands of false reports; what
# a heap corruption needs is an invalid write, read or free, which this counts. The 4 invalid
# reads of size 8 in ld.so's strncmp (dl-load.c, each library's RPATH) are glibc's known noise.
# About 60 x slower than native: a case takes 40-140 s on 2 cores, torch's import 2-3 minutes.
set -euo pipefail
out="$1"; tool="${2:-memcheck}"; shift 2
[[ "${1:-}" == "--" ]] && shift
mkdir -p "$out"
extra=()
[[ "$tool" == "memcheck" ]] && extra=(--undef-value-errors=no)
# Python's own allocator hides heap blocks from valgrind; malloc lets it see every one.
PYTHONMALLOC=malloc torchrun --standalone --nproc_per_node 2 --no-python \
    valgrind --tool="$tool" "${extra[@]}" --error-limit=no --num-callers=40 --fair-sched=yes \
    --log-file="$out/$tool.%p.log" \
    python -m conformance --timeout 1800 --jsonl "$out/cases.jsonl" "$@" | tee "$out/conformance.out"
for log in "$out/$tool".*.log; do
    echo "== $log"
    grep -E "^==[0-9]+== (Invalid|Mismatched|Source and destination|Possible data race|Lock)" "$log" \
        | sed 's/^==[0-9]*== //' | sort | uniq -c || echo "      0 errors of those kinds"
    grep -E "ERROR SUMMARY" "$log" || true
done
