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
* ``FSDP_LITE_TORCH_TESTS_FSDP1=1`` (``run_torch_fsdp2_tests.sh --fsdp1``), only where no
  accelerator is present: torch's ``FullyShardedDataParallel`` given no ``device_id`` gets
  ``device_id=torch.device("cpu")`` (torch 2.13's FSDP1 otherwise raises "FSDP needs a non-CPU
  accelerator device"). fsdp_lite's class is not touched; the switched run reaches torch's only
  where a test still builds torch's (a wrap policy's ``wrapper_cls`` it names, say).
* ``FSDP_LITE_TORCH_TESTS_RANKS=N`` (``run_torch_fsdp2_tests.sh --ranks N``): ``common_fsdp``'s
  ``DEVICE_COUNT``, the world size of torch's ``FSDPTest`` (1 on a CPU-only machine), reads N.
"""

import enum
import os

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

if os.environ.get("FSDP_LITE_TORCH_TESTS_FSDP1") and torch.accelerator.device_count() == 0:
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP

    _torch_fsdp_init = _TorchFSDP.__init__
    _DEVICE_ID_POSITION = 9  # after module, process_group, ..., param_init_fn

    @functools.wraps(_torch_fsdp_init)
    def _init_on_cpu(self, module, *args, **kwargs):
        if len(args) < _DEVICE_ID_POSITION and kwargs.get("device_id") is None:
            kwargs["device_id"] = torch.device("cpu")
        _torch_fsdp_init(self, module, *args, **kwargs)

    _TorchFSDP.__init__ = _init_on_cpu

if os.environ.get("FSDP_LITE_TORCH_TESTS_RANKS"):
    import torch.testing._internal.common_fsdp as _common_fsdp_ranks

    _common_fsdp_ranks.DEVICE_COUNT = int(os.environ["FSDP_LITE_TORCH_TESTS_RANKS"])

try:  # on the path only under run_torch_fsdp2_tests.sh --lift-gpu-gates
    import torch_fsdp2_tests_lift_gpu_gates  # noqa: F401
except ImportError:
    pass
try:  # on the path only under run_torch_fsdp2_tests.sh --backend-collectives
    import torch_fsdp2_tests_backend_collectives  # noqa: F401
except ImportError:
    pass
