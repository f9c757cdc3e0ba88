#!/usr/bin/env bash
# Run one of torch's FSDP1 test files (pytorch/pytorch test/distributed/fsdp/test_fsdp_*.py,
# test_wrap.py) one test at a time: natively, then, where the native run passed, switched to
# fsdp_lite by scripts/switch_torch_fsdp1_tests.py. The runner is run_torch_fsdp2_tests.sh's:
#   scripts/run_torch_fsdp1_tests.sh [--lift-gpu-gates] [--ranks N] DIR FILE [TIMEOUT_S] [PYTEST_K]
# DIR/native/FILE is torch's test file, put there by hand (never into this repository); for a file
# of the 2023 layout, make it with `scripts/switch_torch_fsdp1_tests.py --native-for-cpu`.
# docs/compatibility.md ("torch's own FSDP1 tests switched to fsdp_lite") has the runs.
exec "$(dirname "$0")/run_torch_fsdp2_tests.sh" --fsdp1 "$@"
