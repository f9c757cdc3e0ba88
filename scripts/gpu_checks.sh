#!/usr/bin/env bash
# Every check that needs a GPU, in one run of about 5 minutes, for a session lent one:
#
#     bash scripts/gpu_checks.sh            # results under $OUT (the device tool's), else gpu_results/
#
# 1. the gpu-marked tests: pinned CPU offload, and side streams (fsdp_lite/engine/streams.py) against
#    the same training without them, bitwise;
# 2. the conformance suite's quick matrix on NCCL (one GPU: one rank).
# Copy what it writes into docs/ or benchmarks/results/ with the date and the machine.
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
status=0

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

echo "== gpu-marked tests" | tee "$OUT/pytest_gpu.txt"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_offload.py tests/test_streams.py \
    2>&1 | tee -a "$OUT/pytest_gpu.txt" || status=1

echo "== conformance, NCCL, quick matrix" | tee "$OUT/conformance_nccl.txt"
timeout 240 "$PY" -m torch.distributed.run --nproc_per_node 1 -m conformance --backend nccl --quick \
    --json "$OUT/conformance_nccl.json" 2>&1 | tee -a "$OUT/conformance_nccl.txt" || status=1

echo "gpu_checks: exit $status; results in $OUT"
exit $status
