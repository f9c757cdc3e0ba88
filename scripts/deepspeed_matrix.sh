#!/usr/bin/env bash
# The conformance matrix for DeepSpeed ZeRO on 2 CPU ranks, beside fsdp_lite's disk offload, in one run.
#
#   bash scripts/deepspeed_matrix.sh [--libaio] [OUT_PREFIX]
#
# Makes (or reuses) a venv at $DS_VENV (default .venv-deepspeed) holding torch 2.13.0, this repository
# and its `deepspeed` extra (deepspeed 0.19.8, numpy). --libaio first installs libaio-dev with apt-get
# (needs root), without which the NVMe cases are reported unsupported; their first run then JIT-builds
# DeepSpeed's async_io op (about 10 minutes on 2 cores, cached in ~/.cache/torch_extensions).
# Writes OUT_PREFIX.json and .md (default benchmarks/results/deepspeed_ws2_DATE) and exits with the
# suite's status: 1 when a case failed, which DeepSpeed's known bugs make it do (docs/deepspeed.md).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--libaio" ]]; then
    shift
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq libaio-dev
    else
        echo "deepspeed_matrix: --libaio needs root and apt-get; the NVMe cases stay unsupported" >&2
    fi
fi
out="${1:-benchmarks/results/deepspeed_ws2_$(date +%F)}"
venv="${DS_VENV:-.venv-deepspeed}"

if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
    # torch alone and first: resolving it together with deepspeed pulls a multi-GB CUDA build.
    "$venv/bin/pip" install -q torch==2.13.0
fi
"$venv/bin/pip" install -q -e '.[test,deepspeed]'

# DeepSpeed picks its accelerator by probing; say CPU so that a machine with a GPU runs the same.
# OMP_NUM_THREADS=1 per rank, as torchrun sets it: 2 ranks on 2 cores.
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
mkdir -p "$(dirname "$out")"
# deepspeed's whole matrix; deepspeed_torch_linear only where it differs (ZeRO-3); the optimizer
# built from DeepSpeed's config on the plain and offload cases of lm_untied; fsdp_lite's disk offload,
# the same feature judged in the same run.
exec "$venv/bin/python" -m conformance \
    --impl deepspeed deepspeed_torch_linear deepspeed_config_optimizer fsdp_lite \
    --only 'deepspeed/*' --only 'deepspeed_torch_linear/FULL_SHARD/*' \
    --only 'deepspeed_config_optimizer/*/*/plain/lm_untied/*' \
    --only 'deepspeed_config_optimizer/*/*/*offload*/lm_untied/*' \
    --only 'fsdp_lite/*/*/disk_offload/*' \
    --json "$out.json" --markdown "$out.md"
