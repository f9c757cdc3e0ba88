"""Point one of torch's own FSDP1 test files at fsdp_lite, changing only its imports.

torch's tests (pytorch/pytorch ``test/distributed/fsdp/test_fsdp_*.py``, ``test_wrap.py``) are never
copied into this repository: this script reads one from wherever it was put (outside the repo) and
writes the switched copy where ``-o`` says (scripts/run_torch_fsdp1_tests.sh calls it).

    python scripts/switch_torch_fsdp1_tests.py /tmp/fsdp1_tests/native/test_wrap.py \\
        -o /tmp/fsdp1_tests/switched/test_wrap.py

What changes, and nothing else (the import splitting is switch_torch_fsdp2_tests.py's):

1. Each ``from torch.distributed.fsdp import ...`` (and from ``.fully_sharded_data_parallel``,
   ``.api``) is split in two: the names fsdp_lite exports (``FullyShardedDataParallel``,
   ``ShardingStrategy``, ``MixedPrecision``, ``CPUOffload``, ``BackwardPrefetch``,
   ``StateDictType``, the state dict and optimizer state dict configs, ``OptimStateKeyType``, and
   the FSDP2 names) come from ``fsdp_lite``; the public names of ``torch.distributed.fsdp.wrap``
   from ``fsdp_lite.wrap``; ``ShardedGradScaler`` from ``fsdp_lite.sharded_grad_scaler``. Any
   other name (``FlatParameter``, the private ``_or_policy``, ``_wrap_module_cls_individually``)
   and every import of torch's private modules (``_flat_param``, ``_runtime_utils``, ...) stays
   torch's: tests that patch or read them test torch's internals.
2. Lines after the imports bind ``FSDP`` in torch's test utilities (``common_fsdp``), which wrap
   the reference models (``NestedWrappedModule.init``, ``TransformerWithSharedParams.init``,
   ``_test_fsdp_parity``) and call ``FSDP.summon_full_params`` at run time, to fsdp_lite's
   ``FullyShardedDataParallel``; and ``common_fsdp.fully_shard`` to fsdp_lite's. Nothing else of
   torch's test utilities or reference models changes.
3. One more line imports ``torch_fsdp2_tests_compat/torch_fsdp1_tests_internals.py``: the private
   helper of torch's FSDP1 that ``common_fsdp`` calls on the wrapper (``_assert_state``, after
   ``_train_for_several_steps``), checking the same training state on fsdp_lite's unit; it
   compares no number (see that file).

``--native-for-cpu`` writes instead the native copy for torch 2.13 on a CPU-only machine from a
test file of the 2023 layout (``CUDAInitMode``, ``.cuda()``): the renames torch itself made since
(``CUDAInitMode`` -> ``DEVICEInitMode``, ``cuda_init_mode`` -> ``device_init_mode``,
``_maybe_cuda`` -> ``_move_to_device``, ``_FSDPPolicy`` -> ``_Policy``, ``_gather_state_dict`` from
``torch.distributed._state_dict_utils``) and ``cuda`` -> ``cpu``
(``.cuda()``, ``"cuda"``, ``torch.cuda.device_count()`` reads 2; DDP's ``device_ids=[rank]``
and ``output_device=rank`` are None, as DDP takes them for a CPU module). Both runs, native and switched,
then see the same text. The script contains no test code of torch's; it prints what it changed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from switch_torch_fsdp2_tests import FSDP_LITE_NAMES as FSDP2_NAMES  # noqa: E402
from switch_torch_fsdp2_tests import switch, write  # noqa: E402

from fsdp_lite.wrap import __all__ as WRAP_NAMES  # noqa: E402

# The FSDP1 names fsdp_lite exports (fsdp_lite/__init__.py), by torch module.
FSDP1_NAMES = {
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "BackwardPrefetch",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "OptimStateKeyType",
    "StateDictSettings",
}

NAMES = {
    "torch.distributed.fsdp": dict.fromkeys(FSDP1_NAMES | FSDP2_NAMES, "fsdp_lite"),
    "torch.distributed.fsdp.fully_sharded_data_parallel": dict.fromkeys(FSDP1_NAMES, "fsdp_lite"),
    "torch.distributed.fsdp.api": dict.fromkeys(FSDP1_NAMES, "fsdp_lite"),
    "torch.distributed.fsdp.wrap": dict.fromkeys(
        WRAP_NAMES, "fsdp_lite.wrap"
    ),  # torch's public names
    "torch.distributed.fsdp.sharded_grad_scaler": {
        "ShardedGradScaler": "fsdp_lite.sharded_grad_scaler"
    },
}

RUNTIME_BINDINGS = """\
# --- added by fsdp_lite's scripts/switch_torch_fsdp1_tests.py: torch's test utilities wrap their
# --- reference models with FSDP at run time; bind fsdp_lite's there too.
import fsdp_lite as _fsdp_lite_switch
import torch.testing._internal.common_fsdp as _common_fsdp_switch

_common_fsdp_switch.FSDP = _fsdp_lite_switch.FullyShardedDataParallel
_common_fsdp_switch.fully_shard = _fsdp_lite_switch.fully_shard
# torch's private helpers that its test utilities call on the wrapper (no number compared):
import torch_fsdp1_tests_internals  # noqa: E402,F401
# --- end of switch
"""
BINDING_LOG = (
    "common_fsdp.FSDP and common_fsdp.fully_shard bound to fsdp_lite's; "
    "torch_fsdp1_tests_internals gives the wrapper torch's _assert_state"
)

# torch's renames since the 2023 layout, then cuda -> cpu; (pattern, replacement), in order.
NATIVE_FOR_CPU = [
    (r"\bCUDAInitMode\.CUDA_", "DEVICEInitMode.DEVICE_"),
    (r"\bCUDAInitMode\b", "DEVICEInitMode"),
    (r"\bcuda_init_mode\b", "device_init_mode"),
    (r"\b_maybe_cuda\b", "_move_to_device"),
    (r"\b_FSDPPolicy\b", "_Policy"),
    (
        r"torch\.distributed\.fsdp\._shard_utils import _gather_state_dict",
        "torch.distributed._state_dict_utils import _gather_state_dict",
    ),
    (r"torch\.cuda\.device_count\(\)", "2"),
    (r"torch\.cuda\.is_available\(\)", "True"),
    (r"torch\.cuda\.set_device\([^()]*\)", "None"),
    (r'torch\.device\("cuda", torch\.cuda\.current_device\(\)\)', 'torch.device("cpu", 0)'),
    (r"torch\.cuda\.current_device\(\)", 'torch.device("cpu")'),  # a device, as FSDP takes it
    (r"\.cuda\(\)", ".cpu()"),
    (r'"cuda"', '"cpu"'),
    (r'backend="nccl"', 'backend="gloo"'),
    # DDP on a CPU module takes no device ids (the reference model in the parity tests)
    (r"\bdevice_ids=\[[^\[\]]*\]", "device_ids=None"),
    (r"\boutput_device=(self\.)?rank\b", "output_device=None"),
]


def native_for_cpu(source: str) -> tuple[str, list[str]]:
    log = []
    for pattern, replacement in NATIVE_FOR_CPU:
        source, n = re.subn(pattern, replacement, source)
        if n:
            log.append(f"{pattern} -> {replacement}: {n}")
    return source, log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path, help="one of torch's FSDP1 test files")
    parser.add_argument("-o", "--output", type=Path, help="where to write (default: stdout)")
    parser.add_argument(
        "--native-for-cpu",
        action="store_true",
        help="write the native copy for torch 2.13 on CPU instead (renames, cuda -> cpu)",
    )
    args = parser.parse_args(argv)
    source = args.test_file.read_text()
    if args.native_for_cpu:
        out, log = native_for_cpu(source)
    else:
        out, log = switch(source, NAMES, RUNTIME_BINDINGS, BINDING_LOG)
    write(args.test_file, args.output, out, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
