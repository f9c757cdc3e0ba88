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

import math
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from fsdp_lite.engine import canonical, collectives
from fsdp_lite.engine.param import Param
from fsdp_lite.engine.unit import ShardedUnit, unit_owners

__all__ = ["SCHEDULES", "Canonical"]

# Which of a global batch's V micro-batches rank r of N runs, and when the gradients are reduced.
# Both sum the same tree, so both give the same bits (docs/invariance.md).
SCHEDULES = {
    # leaves r, r + N, r + 2N, ...: one reduction per micro-batch; no gradient kept unsharded
    "interleaved": lambda k, r, n, per_rank: k * n + r,
    # leaves [r V/N, (r+1) V/N): summed locally, unsharded (up to log2(V/N) + 1 buffers), then
    # one reduction per step, as gradient accumulation under no_sync
    "local": lambda k, r, n, per_rank: r * per_rank + k,
}


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
        # A plain module: at the end of each backward every parameter's gradient (zeros for one
        # this micro-batch did not use, as the units' reductions fill them) climbs its tree.
        self._trees: dict[nn.Parameter, canonical.TreeSum] = {}
        self._landed: dict[nn.Parameter, weakref.ref] = {}
        self._leaves: dict[nn.Parameter, torch.Tensor] = {}  # this backward's gradients
        self._used: dict[nn.Parameter, bool] = {}  # a leaf of this step had a gradient
        self._end_queued = False
        if not self.units:
            for p in module.parameters():
                if p.requires_grad:
                    self._trees[p] = canonical.TreeSum(virtual_batches)
                    p.register_post_accumulate_grad_hook(self._climb)

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
        size = tensors[0].size(0)
        if any(t.size(0) != size for t in tensors) or size % self.virtual_batches:
            raise ValueError(
                f"the global batch's dim 0 ({[t.size(0) for t in tensors]}) must be one size, "
                f"a multiple of virtual_batches ({self.virtual_batches})"
            )
        cut = size // self.virtual_batches
        out = []
        leaf_of = SCHEDULES[self.schedule]
        for k in range(self.micro_steps):
            leaf = leaf_of(k, self.rank, self.world_size, self.micro_steps)
            piece = tuple(t[leaf * cut : (leaf + 1) * cut] for t in tensors)
            out.append(piece[0] if len(tensors) == 1 else piece)
        return out

    def mean(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global batch's mean of a per-micro-batch quantity (the loss), from this rank's
        ``micro_steps`` values in micro-batch order: their tree sum over all V leaves / V."""
        if len(losses) != self.micro_steps:
            raise ValueError(f"mean takes this rank's {self.micro_steps} values, got {len(losses)}")
        ranks = self._gather([float(v) for v in losses])
        leaf_of = SCHEDULES[self.schedule]
        by_leaf = {
            leaf_of(k, r, self.world_size, self.micro_steps): value
            for r, values in enumerate(ranks)
            for k, value in enumerate(values)
        }
        leaves = [torch.tensor(by_leaf[leaf]) for leaf in range(self.virtual_batches)]
        return canonical.tree_sum(leaves) / self.virtual_batches

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

    def _climb(self, p: nn.Parameter) -> None:
        """A plain module's hook: take this backward's gradient off the parameter; at the end
        of the backward every parameter's leaf climbs its tree (``_end_of_backward``)."""
        landed = self._landed.get(p)
        if landed is not None and landed() is p.grad:
            raise RuntimeError(
                "Canonical: a gradient from the last step is still there; call "
                "optimizer.zero_grad() (set_to_none, its default) between steps"
            )
        self._leaves[p], p.grad = p.grad, None
        if not self._end_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    def _end_of_backward(self) -> None:
        """Push every parameter's leaf, zeros where this micro-batch left none; after the
        step's last micro-batch the root, / V, becomes the gradient of each parameter some leaf
        used (the others keep None)."""
        self._end_queued = False
        leaves, self._leaves = self._leaves, {}
        for p, tree in self._trees.items():
            leaf = leaves.get(p)
            self._used[p] = self._used.get(p, False) or leaf is not None
            total = tree.push(leaf if leaf is not None else torch.zeros_like(p))
            if total is not None and self._used.pop(p):
                p.grad = total.div_(self.virtual_batches)
                self._landed[p] = weakref.ref(p.grad)

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
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise NotImplementedError(
                f"Canonical.clip_grad_norm_ takes norm_type 2 or inf, got {norm_type}"
            )
        params = [p for p in (parameters or self.module.parameters()) if p.grad is not None]
        owners = {id(p.sharded_param): p for u in self.units for p in u.params if p.is_sharded}
        mine: list[list] = []  # per parameter: this rank's pieces (2-norm) or max (inf)
        numels: list[int] = []
        for p in params:
            local, start, counted = self._local_grad(p, owners.get(id(p)))
            numels.append(p.numel())
            if not counted or local.numel() == 0:
                mine.append([])
            elif norm_type == math.inf:
                mine.append([local.abs().max().item()])
            else:
                mine.append(canonical.tree_pieces(local * local, start, p.numel()))
        # Replicas hold the same gradients: each shard group combines its own, to the same bits.
        ranks = (
            collectives.all_gather_objects(mine, self.group) if self.group is not None else [mine]
        )
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

    def _local_grad(self, p: nn.Parameter, owner: Param | None) -> tuple[torch.Tensor, int, bool]:
        """This rank's gradient elements of ``p`` (flat, float32), where they start among the
        parameter's elements, and whether this rank counts them (a whole gradient held by every
        rank counts on rank 0 only)."""
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        flat = grad.reshape(-1).float()
        if owner is None:  # whole on every rank: NO_SHARD, a plain module, an ignored parameter
            return flat, 0, self.shard_rank == 0
        if owner.shard_dim != 0:
            raise NotImplementedError(
                f"Canonical.clip_grad_norm_: {owner.fqn!r} is sharded on dim {owner.shard_dim}; "
                "only dim-0 shards hold a contiguous range of the parameter's elements"
            )
        return flat, owner.rank * owner.shard_numel, True  # whole rows before this rank's
