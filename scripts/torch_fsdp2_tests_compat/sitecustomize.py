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
    import functools

    import torch.testing._internal.common_fsdp as _common_fsdp

    def _enough_devices_until_init(setup):
        """``setup`` (a classmethod's function) sees "enough" devices until it reaches
        init_process_group; the real count is back from there on."""

        @functools.wraps(setup)
        def run(cls, *args, **kwargs):
            real_count, real_init = torch.accelerator.device_count, dist.init_process_group

            def init_process_group(*a, **kw):
                torch.accelerator.device_count = real_count
                dist.init_process_group = real_init
                return real_init(*a, **kw)

            torch.accelerator.device_count = lambda: 1 << 20
            dist.init_process_group = init_process_group
            return setup(cls, *args, **kwargs)

        return classmethod(run)

    # FSDPTest._run per test; FSDPTestContinuous._init_pg once for a class's tests.
    _common_fsdp.FSDPTest._run = _enough_devices_until_init(_common_fsdp.FSDPTest._run.__func__)
    _common_fsdp.FSDPTestContinuous._init_pg = _enough_devices_until_init(
        _common_fsdp.FSDPTestContinuous._init_pg.__func__
    )

try:  # on the path only under run_torch_fsdp2_tests.sh --lift-gpu-gates
    import torch_fsdp2_tests_lift_gpu_gates  # noqa: F401
except ImportError:
    pass
try:  # on the path only under run_torch_fsdp2_tests.sh --backend-collectives
    import torch_fsdp2_tests_backend_collectives  # noqa: F401
except ImportError:
    pass
