"""With ``run_torch_fsdp2_tests.sh --lift-gpu-gates`` (this folder on PYTHONPATH), torch's
``skip_if_lt_x_gpu(n)`` runs a test on a CPU-only machine as ``allow_cpu=True`` does, natively and
switched alike: for the test files whose every test is gated on an accelerator
(test_fully_shard_mixed_precision.py, ...). Only tests that then pass natively are run switched;
their outcomes are reported apart from the ungated ones (docs/fsdp2.md). Also: CPU variants of
tests instantiated ``except_for=["cpu"]``, 2 CPU "devices", and a module-level
``current_accelerator()`` that reads cpu."""

import sys

import torch
import torch.testing._internal.common_device_type as _common_device_type
import torch.testing._internal.common_distributed as _common_distributed

_gate = _common_distributed.skip_if_lt_x_gpu


def skip_if_lt_x_gpu(x, *, allow_cpu=False):
    return _gate(x, allow_cpu=True)


_common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu


# Files that instantiate their tests per device "except_for=['cpu']" get their CPU variant too.
_instantiate = _common_device_type.instantiate_device_type_tests


def instantiate_device_type_tests(cls, scope, except_for=None, *args, **kwargs):
    except_for = [d for d in except_for or () if d != "cpu"] or None
    return _instantiate(cls, scope, except_for, *args, **kwargs)


_common_device_type.instantiate_device_type_tests = instantiate_device_type_tests

# world_size = min(4, device_module.device_count()): 2 CPU "devices", so 2 ranks.
torch.cpu.device_count = lambda: 2

# A test file's module-level torch.accelerator.current_accelerator().type reads "cpu".
_current_accelerator = torch.accelerator.current_accelerator


def current_accelerator(*args, **kwargs):
    found = _current_accelerator(*args, **kwargs)
    caller = sys._getframe(1).f_code
    if found is None and caller.co_name == "<module>" and "test_fully_shard_" in caller.co_filename:
        return torch.device("cpu")
    return found


torch.accelerator.current_accelerator = current_accelerator
