"""The canonical reduction mode: the same bits at any world size (docs/invariance.md).

``Canonical(model, virtual_batches=V)`` cuts every global batch into V micro-batches and sums
their gradients in one fixed binary tree (engine/canonical.py), so that training at 1, 2, 4 or 8
ranks, or in one process without a process group, gives the same parameters bit for bit::

    canon = Canonical(model, virtual_batches=8)       # a wrapped model (either front) or a plain one
    for x, y in loader:                               # the global batch, the same on every rank
        losses = []
        for xm, ym in canon.micro_batches(x, y):      # this rank's V / N micro-batches
            loss = loss_fn(model(xm), ym)             # each micro-batch's own mean, unscaled
            loss.backward()
            losses.append(loss.detach())
        canon.clip_grad_norm_(1.0)                    # optional: the norm in a fixed tree too
        optimizer.step()
        optimizer.zero_grad()
        print(canon.mean(losses))                     # the global batch's mean loss
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lite.canonical import clip
from fsdp_lite.canonical import schedule as schedules
from fsdp_lite.canonical.schedule import SCHEDULES
from fsdp_lite.canonical.tree import PlainTrees
from fsdp_lite.engine import canonical, collectives
from fsdp_lite.engine.unit import ShardedUnit, unit_owners

__all__ = ["SCHEDULES", "Canonical"]


class Canonical:
    """Put ``module``'s gradient reduction in the world-size-invariant tree of
    ``virtual_batches`` leaves per optimizer step (a power of two that the data-parallel world
    size divides). Call it once, after wrapping and before the first backward, on every rank.

    ``schedule``: ``"interleaved"`` or ``"local"`` (``SCHEDULES``).

    ``module``: a model wrapped by ``FullyShardedDataParallel`` or ``fully_shard`` (FULL_SHARD,
    SHARD_GRAD_OP, NO_SHARD, SHARD_OPTIM and their FSDP2 equivalents), or a plain ``nn.Module``
    in one process. The contract (what must stay the same between the runs to compare) is in
    docs/invariance.md: V, the global batch, the micro-batch's loss as its own mean, the thread
    count, and an optimizer whose result for an element does not depend on where it sits (not
    ``fused=True``: ``check_optimizer``).
    """

    def __init__(
        self, module: nn.Module, virtual_batches: int, schedule: str = "interleaved"
    ) -> None:
        if not isinstance(virtual_batches, int) or not canonical.is_power_of_two(virtual_batches):
            raise ValueError(f"virtual_batches must be a power of two, got {virtual_batches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.schedule = schedule
        self.module = module
        self.virtual_batches = virtual_batches
        self.units: list[ShardedUnit] = [m._unit for m in unit_owners(module)]
        groups = {(id(u.group), id(u.replicate_group)) for u in self.units}
        if len(groups) > 1:
            raise NotImplementedError("Canonical takes a model whose units share one process group")
        # The shard group, and HYBRID_SHARD's replicate group: rank (i, j) of the
        # (replicate, shard) mesh runs the micro-batches of leaf position i S + j.
        self.group: dist.ProcessGroup | None = self.units[0].group if self.units else None
        self.replicate_group = self.units[0].replicate_group if self.units else None
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "Canonical on a module without fsdp_lite units runs in one process; wrap it "
                "(FullyShardedDataParallel or fully_shard) to train at several ranks"
            )
        shards = dist.get_world_size(self.group) if self.group is not None else 1
        shard_rank = dist.get_rank(self.group) if self.group is not None else 0
        replicas, replica = 1, 0
        if self.replicate_group is not None:
            replicas = dist.get_world_size(self.replicate_group)
            replica = dist.get_rank(self.replicate_group)
        self.shard_rank = shard_rank
        self.world_size = replicas * shards  # the data-parallel ranks
        self.rank = replica * shards + shard_rank
        if virtual_batches % self.world_size:
            raise ValueError(
                f"virtual_batches ({virtual_batches}) must be a multiple of the data-parallel "
                f"world size ({self.world_size})"
            )
        # The thread count changes how matmuls sum (docs/invariance.md): the same on every rank
        # here; the same across runs is the user's part of the contract.
        self.threads = torch.get_num_threads()
        if self.group is not None:
            counts = self._gather(self.threads)
            if len(set(counts)) > 1:
                raise RuntimeError(
                    f"Canonical needs the same torch.get_num_threads() on every rank, got {counts}"
                )
        for unit in self.units:
            unit.use_canonical(virtual_batches, local=schedule == "local")
        # A plain module: its gradients climb trees of their own (tree.py); units reduce in
        # the tree themselves.
        self._plain = None if self.units else PlainTrees(module, virtual_batches)

    def __repr__(self) -> str:
        return (
            f"Canonical(virtual_batches={self.virtual_batches}, schedule={self.schedule!r}, "
            f"world_size={self.world_size}, micro_batches_per_rank={self.micro_steps}, "
            f"threads={self.threads})"
        )

    @property
    def micro_steps(self) -> int:
        """Micro-batches (forward and backward) each rank runs per optimizer step: V / N."""
        return self.virtual_batches // self.world_size

    # ---- data ----------------------------------------------------------------------------------

    def micro_batches(self, *tensors: torch.Tensor) -> list:
        """This rank's micro-batches of a global batch, in order: the leaves its schedule gives
        it (interleaved: r, r + N, r + 2N, ...) of the V equal cuts of each tensor's dim 0 (one
        tensor: a list of tensors; several: a list of tuples)."""
        return schedules.micro_batches(
            tensors, self.virtual_batches, self.schedule, self.rank, self.world_size
        )

    def mean(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global batch's mean of a per-micro-batch quantity (the loss), from this rank's
        ``micro_steps`` values in micro-batch order: their tree sum over all V leaves / V."""
        if len(losses) != self.micro_steps:
            raise ValueError(f"mean takes this rank's {self.micro_steps} values, got {len(losses)}")
        ranks = self._gather([float(v) for v in losses])
        return schedules.tree_mean(ranks, self.virtual_batches, self.schedule)

    def _gather(self, obj: object) -> list:
        """Every data-parallel rank's ``obj``, by leaf position (replica i, shard rank j: i S + j)."""
        if self.group is None:
            return [obj]
        within = collectives.all_gather_objects(obj, self.group)
        if self.replicate_group is None:
            return within
        return [
            o for per in collectives.all_gather_objects(within, self.replicate_group) for o in per
        ]

    # ---- gradients -----------------------------------------------------------------------------

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer whose result for an element depends on where it sits in its
        tensor: ``fused=True`` (measured: torch 2.13's fused CPU AdamW rounds a vectorized body
        and a scalar tail differently, and shard boundaries move with N)."""
        for group in optimizer.param_groups:
            if group.get("fused"):
                raise ValueError(
                    f"{type(optimizer).__name__}(fused=True) is not world-size invariant: its "
                    "result for an element depends on the element's place in the tensor; use "
                    "foreach=True or the default"
                )

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        parameters: Iterable[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` whose norm has the same bits at any world size:
        each parameter's squares are summed in a fixed tree over its elements, wherever the
        shard boundaries fall, and the parameters' sums in a fixed tree in ``parameters``' order
        (default: the module's). Returns the total norm (float32)."""
        params = list(parameters or self.module.parameters())
        return clip.clip_grad_norm_(
            params, self.units, self.group, self.shard_rank, max_norm, norm_type
        )
