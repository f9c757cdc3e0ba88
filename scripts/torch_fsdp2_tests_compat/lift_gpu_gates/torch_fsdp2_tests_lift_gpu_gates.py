"""With ``run_torch_fsdp2_tests.sh --lift-gpu-gates`` (this folder on PYTHONPATH), torch's
``skip_if_lt_x_gpu(n)`` runs a test on a CPU-only machine as ``allow_cpu=True`` does, natively and
switched alike: for the test files whose every test is gated on an accelerator
(test_fully_shard_mixed_precision.py, ...). Only tests that then pass natively are run switched;
their outcomes are reported apart from the ungated ones (docs/fsdp2.md)."""

import torch.testing._internal.common_distributed as _common_distributed

_gate = _common_distributed.skip_if_lt_x_gpu


def skip_if_lt_x_gpu(x, *, allow_cpu=False):
    return _gate(x, allow_cpu=True)


_common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
