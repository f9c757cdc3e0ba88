#!/usr/bin/env bash
# The conformance matrix at 4 ranks (--all) for every built-in implementation, for nightly use.
#
#   bash scripts/nightly_conformance.sh [OUT_DIR]
#
# Writes OUT_DIR/conformance_ws4.{json,xml,md} and conformance_world_sizes.{json,md} (default
# benchmarks/results/nightly) and exits 0 only if no case of either run failed. On 2 CPU cores,
# before --all and hpZ (not remeasured since),
# measured: 830 cases in 17 min 38 s (2026-12-02, benchmarks/results/conformance_ws4_2026-12-02.md);
# fsdp_lite and fsdp_lite_fsdp2 alone, 408 cases: 7 min 20 s (before the disk-offload cases).
set -euo pipefail
# A rank that crashes prints every thread's Python stack (one run of 2026-12-01 lost rank 1 to a
# SIGSEGV in case 405, fsdp_lite_fsdp2/HYBRID_SHARD/fp32/clip_grad_norm/lm_untied/ws4, with no
# stack; it passed in every rerun).
export PYTHONFAULTHANDLER=1
out="${1:-benchmarks/results/nightly}"
mkdir -p "$out"
status=0
# --all: the default matrix (hpZ joins it at 4 ranks) and every optimizer's.
python -m conformance --all --impl fsdp_lite fsdp_lite_fsdp2 torch_fsdp1 torch_fsdp2 --nproc 4 \
    --json "$out/conformance_ws4.json" --junit "$out/conformance_ws4.xml" \
    --markdown "$out/conformance_ws4.md" || status=$?
# The same cases at 1, 2 and 4 ranks compared with each other: fsdp_lite's canonical mode must be
# bitwise across world sizes, the others are measured (162 cases, 4 min 12 s on 2 cores).
python -m conformance --world-sizes 1,2,4 --impl fsdp_lite fsdp_lite_fsdp2 fsdp_lite_canonical \
    fsdp_lite_fsdp2_canonical torch_fsdp1 torch_fsdp2 \
    --json "$out/conformance_world_sizes.json" --markdown "$out/conformance_world_sizes.md" \
    || status=$?
exit "$status"
