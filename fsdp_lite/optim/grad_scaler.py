"""Loss scaling for fp16 training on sharded gradients.

``torch.amp.GradScaler`` checks the gradients it sees for inf/nan and skips the step if it finds
any. Under sharding each rank sees only its shards, so one rank could step while another skips and
the replicas would drift apart. ``ShardedGradScaler`` checks the local shards (DTensor gradients are
unwrapped to their local tensors) and then all-reduces the verdict, so every rank skips together.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _MultiDeviceReplicator

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check spans every rank of ``process_group``.

    Args:
        device: where the scale lives, "cuda" (default) or "cpu".
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as GradScaler.
        process_group: the ranks whose gradients are checked together (default: all).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # allow_fp16 is ignored: with keep_low_precision_grads the shards' grads are fp16 on
        # purpose, and unscaling them in place is what torch's sharded scaler does too.
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad
                    local = grad.to_local() if hasattr(grad, "to_local") else grad
                    grads[local.device][local.dtype].append(local)
            for device, per_dtype in grads.items():
                for tensors in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        tensors, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                    )
        # A rank whose shards are all empty still takes part in the all-reduce below.
        found = per_device_found_inf._per_device_tensors or {
            found_inf.device: per_device_found_inf.get(found_inf.device)
        }
        for flag in found.values():
            dist.all_reduce(flag, group=self.process_group)  # > 0 on every rank if on any
        return found
