"""Gradient clipping whose norm has the same bits at any world size.

Each parameter's squares are summed in a fixed tree over its elements (engine/canonical.py
``tree_pieces`` / ``combine_pieces``), wherever the shard boundaries fall, and the parameters'
sums in a fixed tree in the order given; the clip coefficient is then
``torch.nn.utils.clip_grad_norm_``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_lite.engine import canonical, collectives
from fsdp_lite.engine.param import Param
from fsdp_lite.engine.unit import ShardedUnit

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    params: Sequence[nn.Parameter],
    units: Sequence[ShardedUnit],
    group: dist.ProcessGroup | None,
    shard_rank: int,
    max_norm: float,
    norm_type: float,
) -> torch.Tensor:
    """Clip the gradients of ``params`` (those with one) by their world-size-invariant total
    norm, gathered within ``group`` (replicas hold the same gradients: each shard group combines
    its own, to the same bits); returns it (float32)."""
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise NotImplementedError(
            f"Canonical.clip_grad_norm_ takes norm_type 2 or inf, got {norm_type}"
        )
    params = [p for p in params if p.grad is not None]
    owners = {id(p.sharded_param): p for u in units for p in u.params if p.is_sharded}
    mine: list[list] = []  # per parameter: this rank's pieces (2-norm) or max (inf)
    numels: list[int] = []
    for p in params:
        local, start, counted = _local_grad(p, owners.get(id(p)), shard_rank)
        numels.append(p.numel())
        if not counted or local.numel() == 0:
            mine.append([])
        elif norm_type == math.inf:
            mine.append([local.abs().max().item()])
        else:
            mine.append(canonical.tree_pieces(local * local, start, p.numel()))
    ranks = collectives.all_gather_objects(mine, group) if group is not None else [mine]
    if norm_type == math.inf:
        total = max((v for r in ranks for per in r for v in per), default=0.0)
    else:
        sums = [
            canonical.combine_pieces([pc for r in ranks for pc in r[i]], numel)
            for i, numel in enumerate(numels)
        ]
        width = 1 << max(len(sums) - 1, 0).bit_length()
        leaves = [torch.tensor(s) for s in sums] + [torch.tensor(0.0)] * (width - len(sums))
        total = math.sqrt(canonical.tree_sum(leaves).item())
    total_norm = torch.tensor(canonical.fp32(total))
    # torch.nn.utils.clip_grad_norm_'s coefficient, from the invariant norm.
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(clip_coef.to(device=grad.device, dtype=grad.dtype))
    return total_norm


def _local_grad(
    p: nn.Parameter, owner: Param | None, shard_rank: int
) -> tuple[torch.Tensor, int, bool]:
    """This rank's gradient elements of ``p`` (flat, float32), where they start among the
    parameter's elements, and whether this rank counts them (a whole gradient held by every rank
    counts on rank 0 of the shard group only)."""
    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    flat = grad.reshape(-1).float()
    if owner is None:  # whole on every rank: NO_SHARD, a plain module, an ignored parameter
        return flat, 0, shard_rank == 0
    if owner.shard_dim != 0:
        raise NotImplementedError(
            f"Canonical.clip_grad_norm_: {owner.fqn!r} is sharded on dim {owner.shard_dim}; "
            "only dim-0 shards hold a contiguous range of the parameter's elements"
        )
    return flat, owner.rank * owner.shard_numel, True  # whole rows before this rank's
