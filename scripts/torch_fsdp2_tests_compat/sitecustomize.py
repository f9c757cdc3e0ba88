"""Run torch's FSDP2 tests (a newer commit's) on torch 2.13's test harness on CPU; no test code of torch's.

Put this folder on PYTHONPATH for both runs, native and switched (scripts/run_torch_fsdp2_tests.sh
does), so that both see the same harness:

* torch 2.13's ``FSDPTest._run`` exits every multi-process test as "Need at least N CUDA devices"
  when ``torch.accelerator.device_count() < world_size``, which is 0 on a CPU-only machine, while
  the tests mark the CPU-capable ones ``@skip_if_lt_x_gpu(2, allow_cpu=True)``. The check is the
  first thing ``_run`` does; here ``torch.accelerator.device_count`` answers "enough" until
  ``_run`` reaches ``dist.init_process_group``, and the real function is back from then on (the
  test body sees the real one). Only where no accelerator is present.
* ``HardwareClassification`` (``common_utils``, newer than 2.13) is given as a stand-in enum, for
  test files that only set it as a class attribute.
"""

import enum

import torch
import torch.distributed as dist
import torch.testing._internal.common_utils as _common_utils

if not hasattr(_common_utils, "HardwareClassification"):

    class HardwareClassification(enum.Enum):
        GENERIC = "generic"
        ACCELERATOR = "accelerator"

    _common_utils.HardwareClassification = HardwareClassification

if torch.accelerator.device_count() == 0:
    import torch.testing._internal.common_fsdp as _common_fsdp

    _orig_run = _common_fsdp.FSDPTest._run.__func__

    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        real_count, real_init = torch.accelerator.device_count, dist.init_process_group

        def init_process_group(*args, **kw):
            torch.accelerator.device_count = real_count
            dist.init_process_group = real_init
            return real_init(*args, **kw)

        torch.accelerator.device_count = lambda: 1 << 20
        dist.init_process_group = init_process_group
        return _orig_run(cls, rank, test_name, file_name, pipe, **kwargs)

    _common_fsdp.FSDPTest._run = classmethod(_run)

    # The same for FSDPTestContinuous (one process group for a class's tests), whose _init_pg
    # checks the device count before init_process_group.
    _orig_init_pg = _common_fsdp.FSDPTestContinuous._init_pg.__func__

    def _init_pg(cls, rank, world_size, rdvz_file):
        real_count, real_init = torch.accelerator.device_count, dist.init_process_group

        def init_process_group(*args, **kw):
            torch.accelerator.device_count = real_count
            dist.init_process_group = real_init
            return real_init(*args, **kw)

        torch.accelerator.device_count = lambda: 1 << 20
        dist.init_process_group = init_process_group
        return _orig_init_pg(cls, rank, world_size, rdvz_file)

    _common_fsdp.FSDPTestContinuous._init_pg = classmethod(_init_pg)

try:  # on the path only under run_torch_fsdp2_tests.sh --lift-gpu-gates
    import torch_fsdp2_tests_lift_gpu_gates  # noqa: F401
except ImportError:
    pass
