"""Where a shard lives: on the compute device, in CPU memory (ZeRO-Offload, arXiv 2101.06840), or in
files on local disk (ZeRO-Infinity, arXiv 2104.07857).

With ``CPUOffload(offload_params=True)`` each sharded param, its gradient and so the optimizer
state and step stay in CPU memory; only the all-gather input and the unsharded params are on the
compute device. With ``offload_dir`` set too they live in memory-mapped files that disk.py owns, and the four functions at the bottom are where the engine tells it a shard was used. This
file is the one place that decides devices and copies between them; on a CPU-only machine both
devices are the CPU and every copy below is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = [
    "after_copy_in",
    "after_shard_written",
    "after_grads",
    "DiskFiles",
    "DiskStoreCalls",
    "OffloadedParam",
    "new_shard",
    "storage_device",
    "to_device",
    "with_local",
]


class DiskFiles(Protocol):
    """One parameter's files under disk offload (disk.ParamFiles), as the engine uses them; a
    protocol, because disk.py builds on this file."""

    store: DiskStoreCalls
    unit_key: int

    def release(self) -> None: ...


class DiskStoreCalls(Protocol):
    """What the engine tells a rank's disk store (disk.DiskStore) about its shards."""

    def new_shard(self, files: DiskFiles, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def after_copy_in(self, unit_key: int, files: list[DiskFiles], phase: str) -> None: ...

    def after_grads(self, params: list[tuple[DiskFiles, nn.Parameter]]) -> None: ...


class OffloadedParam(Protocol):
    """A unit's parameter, as the two functions at the bottom read it (param.Param)."""

    disk_files: DiskFiles | None
    sharded_param: nn.Parameter


def storage_device(compute: torch.device, offload_params: bool) -> torch.device:
    """Where sharded params and their grads live."""
    return torch.device("cpu") if offload_params else compute


def new_shard(
    numel: int,
    dtype: torch.dtype,
    storage: torch.device,
    compute: torch.device,
    files: DiskFiles | None = None,
) -> torch.Tensor:
    """A zeroed 1D shard buffer on ``storage``; pinned when it is CPU memory feeding a GPU,
    so that copies to the GPU can run asynchronously; a file mapping when ``files`` is given."""
    if files is not None:
        return files.store.new_shard(files, numel, dtype)
    shard = torch.zeros(numel, dtype=dtype, device=storage)
    if storage.type == "cpu" and compute.type == "cuda":
        shard = shard.pin_memory()
    return shard


def with_local(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor laid out like ``like`` (mesh, placements, global shape) around ``local``."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when already there, else a copy.

    Only a copy from pinned host memory to the device is non-blocking: the device's kernels that
    read it are queued after it. A copy to the host blocks, because host code (a cast, the sum
    of accumulated gradients, the optimizer) reads it next, and a non-blocking one could still be
    in flight then.
    """
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.is_pinned() and device.type != "cpu")


# The functions below take a unit's parameters (param.py imports this file, not the reverse).


def after_shard_written(files: DiskFiles | None) -> None:
    """A shard was filled (at build, or from a state dict); on disk, drop its pages until used, so
    that building a model larger than memory never holds more than a unit of it."""
    if files is not None:
        files.release()


def after_copy_in(params: Sequence[OffloadedParam], phase: str) -> None:
    """The unit's shards are in ``all_gather_input``; on disk, drop them and read the next."""
    files = [p.disk_files for p in params if p.disk_files is not None]
    if files:
        files[0].store.after_copy_in(files[0].unit_key, files, phase)


def after_grads(params: Sequence[OffloadedParam]) -> None:
    """The unit's grad shards are written; on disk, move them to their files."""
    on_disk = [(p.disk_files, p.sharded_param) for p in params if p.disk_files is not None]
    if on_disk:
        on_disk[0][0].store.after_grads(on_disk)
