"""Where a shard lives: on the compute device, or in CPU memory (ZeRO-Offload, arXiv 2101.06840).

With ``CPUOffload(offload_params=True)`` each sharded param, its gradient and so the optimizer
state and step stay in CPU memory; only the all-gather input and the unsharded params are on the
compute device. This file is the one place that decides devices and copies between them; on a
CPU-only machine both devices are the CPU and every copy below is skipped.
"""

from __future__ import annotations

import torch

__all__ = ["new_shard", "storage_device", "to_device"]


def storage_device(compute: torch.device, offload_params: bool) -> torch.device:
    """Where sharded params and their grads live."""
    return torch.device("cpu") if offload_params else compute


def new_shard(numel: int, dtype: torch.dtype, storage: torch.device, compute: torch.device):
    """A zeroed 1D shard buffer on ``storage``; pinned when it is CPU memory feeding a GPU,
    so that copies to the GPU can run asynchronously."""
    shard = torch.zeros(numel, dtype=dtype, device=storage)
    if storage.type == "cpu" and compute.type == "cuda":
        shard = shard.pin_memory()
    return shard


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when already there, else a (non-blocking) copy."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.is_pinned() or device.type == "cpu")
