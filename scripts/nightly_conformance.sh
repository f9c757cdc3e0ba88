#!/usr/bin/env bash
# The conformance default matrix at 4 ranks for every built-in implementation, for nightly use.
#
#   bash scripts/nightly_conformance.sh [OUT_DIR]
#
# Writes OUT_DIR/conformance_ws4.{json,xml,md} (default benchmarks/results/nightly) and exits with
# the suite's status: 0 only if no case failed. On 2 CPU cores this takes about 15 minutes.
set -euo pipefail
out="${1:-benchmarks/results/nightly}"
mkdir -p "$out"
python -m conformance --impl fsdp_lite fsdp_lite_fsdp2 torch_fsdp1 torch_fsdp2 --nproc 4 \
    --json "$out/conformance_ws4.json" --junit "$out/conformance_ws4.xml" \
    --markdown "$out/conformance_ws4.md"
