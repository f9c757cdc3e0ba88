"""One unit: the parameters of one wrapped module, which copy of them the modules see, and the
collectives that move them.

A unit moves its parameters between the states of Note [Sharded states] (``unshard``,
``wait_for_unshard``, ``reshard``) and averages their gradients (``start_reduce``, then
``advance_reduce`` until it lands), one flat collective each. It decides nothing about *when*:
runtime.py calls it from the hooks and holds what one backward has in flight. The unit owns what
its shards are; only this file assigns a unit's fields. What differs between strategies is chosen
once, when the unit is built: the kind of each parameter (param.py Note [Parameter kinds]), how
the unsharded copies are made (``_fill_unsharded``) and how gradients are reduced (``Reduction``).

Note [Sharded states]: which copy of the parameters the modules hold, and what is allocated.

  SHARDED               the 1/N shards only; modules hold sharded_param
  UNSHARDED             the unsharded params too; modules hold unsharded_param
  SHARDED_POST_FORWARD  hpZ between forward and backward: modules hold sharded_param, and this
                        rank also keeps its block of N/k gathered rows (Note [Post-forward shards])

  SHARDED --unshard + wait_for_unshard--> UNSHARDED --reshard--> SHARDED
  UNSHARDED --reshard(after_forward) with a post-forward group--> SHARDED_POST_FORWARD
  SHARDED_POST_FORWARD --unshard (gathers the blocks within k ranks)--> UNSHARDED
  SHARDED_POST_FORWARD --reshard / end of backward (drops the block)--> SHARDED

Only ``_to_sharded``, ``_to_unsharded`` and ``_to_sharded_post_forward`` change the state. A
NO_SHARD unit goes through the same states; its "unsharded" copy is the parameter itself (or a
local cast of it), so the transitions move nothing.

Note [Unused parameters]: a parameter unused in this forward has no gradient on this rank, but it
may have one on another. Every rank must join the same collective, so it contributes zeros, and
each rank also sends a 1 or 0 per parameter in the same buffer ("had a gradient"). After the
reduction a parameter gets a gradient if any rank had one, and keeps ``None`` only if no rank did:
what DDP with ``find_unused_parameters=True`` does, with no extra collective. torch FSDP2 leaves
out the parameters without a gradient on this rank (ranks that differ then mismatch) unless
``set_reduce_scatter_unused_params(True)``, which reduces zeros for them and gives even a
parameter no rank used a zero gradient; ``UnitSettings.lands_unused_grads`` is that last part.

Note [ZeRO-1]: under SHARD_OPTIM the unsharded params are never freed and gradients are all-reduced,
so every rank holds whole params and whole averaged gradients, as in DDP. Between steps the modules
hold the 1/N ``sharded_param`` shards, as under every strategy, so an optimizer built on
``model.parameters()`` steps only this rank's rows with their rows of the gradient: 1/N of the
optimizer state. The step changes the shards in place, which bumps their version counters; the next
forward sees the counters moved and all-gathers into the kept unsharded params, or, if nothing
moved, points the modules back at them with no collective. Any in-place change to the shards (a
loaded state dict, a manual edit under no_grad) is picked up the same way. An optimizer step is
not: torch 2.13's foreach and fused optimizers update a DTensor in place without moving any
version counter (measured: AdamW(foreach=True), the default on accelerators, left both counters
at 0 and trained on stale params), so every optimizer step also marks the kept copies stale, through
torch's global step hook (``_forget_kept_copies``).

Note [Unsharded after backward]: torch FSDP2's ``set_reshard_after_backward(False)`` leaves a
unit UNSHARDED after its backward: the modules hold the unsharded params, whose ``.grad`` is the
gradient kept unreduced (no gradient sync) until a backward syncs, and the next forward gathers
nothing. torch's pipelining relies on it: a zero-bubble schedule's weight backward
(``stage_backward_weight``) finds the params its input backward saw. Under the FSDP2 front
(``UnitSettings.unsharded_after_backward``) a unit does the same; under the FSDP1 front the modules
go back to the shards after backward, as ZeRO-1 needs (Note [ZeRO-1]). One difference from torch,
an extension: if the shards changed since the gather (an optimizer step), the next forward gathers
again; torch would run it on the stale unsharded params.

Note [Unsynced accumulation]: backwards without gradient sync (``no_sync``,
``set_requires_gradient_sync(False)``) leave their gradients on the unsharded params, and the next
backward that syncs reduces the sum. Under a ``param_dtype`` (bf16) with a wider ``reduce_dtype``
(fp32), torch FSDP2 keeps that sum in the reduce dtype: at the end of the first unsynced backward
the gradient moves into an fp32 ``unsharded_accumulated_grad`` and later ones are added to it.
torch FSDP1 sums in the param dtype (measured: its unsharded gradient stays bf16 under
``no_sync``). Each front does as its torch counterpart (``UnitSettings.unsynced_grads_in_reduce_
dtype``). The cost under the FSDP2 front: the reduce dtype's bytes for each parameter of a unit
with unsynced gradients, unsharded: 4 bytes per parameter in fp32, where the bf16 gradient it
replaces held 2.

Note [HSDP across replicas]: under HYBRID_SHARD a gradient is reduce-scattered within the shard
group, then its 1/N slice is all-reduced across the replicas. That all-reduce is issued when the
reduce-scatter lands and waited only at the next landing (the next unit's post-backward, or the
end of backward), so it overlaps a unit's gradient computation as the reduce-scatter does, instead
of blocking the host at the landing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_lite.api import BackwardPrefetch, Rules
from fsdp_lite.engine import canonical, collectives, offload
from fsdp_lite.engine.collectives import AllGatherResult, ReduceResult
from fsdp_lite.engine.mixed_precision import Precision
from fsdp_lite.engine.observe import Collective, Observer
from fsdp_lite.engine.param import Param, refuse_all_gather_extension
from fsdp_lite.engine.streams import SideStreams

__all__ = [
    "AllReduce",
    "HybridReduceScatter",
    "PendingReduce",
    "ReduceScatter",
    "Reduction",
    "ShardedState",
    "ShardedUnit",
    "TrainingState",
    "UnitRuntime",
    "UnitSettings",
    "owns_unit",
    "unit_owners",
]


def outside_functorch(method: Callable) -> Callable:
    """Run ``method`` with torch.func's transforms set aside, when any is active.

    A unit's first forward may run inside ``torch.func.jvp`` (or vmap, grad): its buffers and
    collectives are plain tensors the transforms must not wrap (a wrapped buffer has no storage
    for the collectives to write). torch FSDP2 sets them aside around the same three steps.
    """

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return run


def owns_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a wrapper, of either front: it holds a ``ShardedUnit`` as ``_unit``.

    Files below the fronts find wrappers this way, so that none of them imports a front.
    """
    return isinstance(module.__dict__.get("_unit"), ShardedUnit)


def unit_owners(module: nn.Module) -> list[nn.Module]:
    """Every wrapper in ``module``'s tree, ``module`` included, in pre-order."""
    return [m for m in module.modules() if owns_unit(m)]


class UnitRuntime(Protocol):
    """What a unit reads of the runtime it joined (runtime.StepRuntime, which builds on this
    file; hence a protocol, not an import)."""

    step: int  # the training step, for the collectives' logs and messages
    root: ShardedUnit
    streams: SideStreams | None  # on accelerators: the all-gather and reduce side streams

    def buffers_in_flight(self, unit: ShardedUnit) -> list[torch.Tensor]: ...


class ShardedState(Enum):
    """Which copy of a unit's parameters the modules hold, and what is allocated (Note [Sharded
    states])."""

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


class TrainingState(Enum):
    """Where in the step a unit is; hooks assert it so that one firing out of order names the unit."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()  # between this unit's pre_backward and its post_backward
    SUMMON = auto()  # inside summon_full_params


@dataclass
class UnitSettings:
    """The knobs a front sets on a unit when building it and between steps (FSDP1's arguments,
    FSDP2's ``set_*`` methods). The front owns them; the engine only reads them."""

    # When the runtime starts another unit's all-gather from this unit's hooks; the units set
    # explicitly (FSDP2's set_modules_to_*_prefetch), or None for the next in the recorded order.
    forward_prefetch: bool = True
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch_units: list[ShardedUnit] | None = None
    backward_prefetch_units: list[ShardedUnit] | None = None
    # False (no_sync, set_requires_gradient_sync): backward keeps the unsharded gradients, to
    # accumulate, and reduces nothing.
    requires_gradient_sync: bool = True
    # False (FSDP2's set_is_last_backward): more backwards of this step follow, as between
    # pipelining's microbatches; the step counter waits for the last one.
    is_last_backward: bool = True
    # False (FSDP2's set_requires_all_reduce, HSDP only): reduce-scatter within the shard group but
    # skip the all-reduce across replicas; the sum waits for the next backward that all-reduces.
    requires_all_reduce: bool = True
    # False (FSDP2's set_unshard_in_backward): backward needs none of these params (an embedding's
    # weight gradient reads only indices and output gradients): no gather.
    unshard_in_backward: bool = True
    # As the root, keep the unsharded params after forward (backward starts with them); FSDP2's
    # explicit reshard_after_forward on the root frees them.
    root_keeps_params: bool = True
    # None: average over the data-parallel ranks; else sum, then divide by this (FSDP2's
    # set_gradient_divide_factor; 1.0 when the loss is already normalized globally).
    gradient_divide_factor: float | None = None
    # What the next forward's first all-gather waits for (FSDP2's set_post_optim_event).
    post_optim_event: Any = None
    # Backwards without gradient sync sum their gradients in the reduce dtype (torch FSDP2)
    # rather than in the compute dtype (torch FSDP1): Note [Unsynced accumulation].
    unsynced_grads_in_reduce_dtype: bool = False
    # Under reshard_after_backward=False, the modules keep the unsharded params after backward
    # (torch FSDP2) rather than going back to the shards (FSDP1): Note [Unsharded after backward].
    unsharded_after_backward: bool = False
    # Run the sharded params' post-accumulate-grad hooks once their reduced gradient lands
    # (torch FSDP2; torch FSDP1 does not).
    runs_sharded_grad_hooks: bool = False
    # True (FSDP2's set_reduce_scatter_unused_params): a parameter no rank used still gets its
    # reduced zeros as a gradient, where by default it keeps None (Note [Unused parameters]).
    lands_unused_grads: bool = False
    # How many gradient reductions may be in flight at once, each holding its unit's whole
    # gradient buffer (FSDP2's set_reduce_scatter_max_input_buffers; the runtime takes the
    # largest any unit asks for, as torch's shared communication context does). 1: a unit's
    # reduction is advanced when the next unit's starts.
    reductions_in_flight: int = 1

    def take_post_optim_event(self) -> Any:
        """The event to wait for, once: the next forward's gathers wait for it, the later ones
        do not (as torch FSDP2 clears it)."""
        event, self.post_optim_event = self.post_optim_event, None
        return event


@dataclass
class _PendingGather:
    """A unit's all-gather in flight, from ``unshard`` until ``wait_for_unshard``."""

    result: AllGatherResult
    op: Collective
    on_side_stream: bool  # queued on the all-gather stream (a prefetch on an accelerator)
    from_post_forward: bool  # gathers hpZ's blocks within the post-forward group


@dataclass
class _PostForward:
    """FSDP2's int ``reshard_after_forward`` (ZeRO++'s hpZ): see Note [Post-forward shards]."""

    group: dist.ProcessGroup  # this rank's k consecutive ranks
    transport: collectives.Transport
    block: slice  # which of the N gathered rows this rank keeps


@dataclass
class PendingReduce:
    """A unit's gradient reduction in flight, from ``start_reduce`` until ``advance_reduce``
    lands it. The runtime holds it (one owner): it starts one in a unit's post-backward and
    advances it in the next unit's (or at the end of backward), so that the collective overlaps
    that unit's gradient computation."""

    unit: ShardedUnit
    result: ReduceResult  # the collective's output and work
    op: Collective
    post_divide: float  # what the sum is divided by after the collective
    had_every_grad: bool  # this rank had every gradient: no "had a gradient" count to read
    across_replicas: bool = False  # HSDP's second collective (Note [HSDP across replicas])


class Reduction:
    """How a unit's gradients are averaged over the shard group: the collective, the buffer it
    takes, and which method lands each parameter's piece. Chosen once from the strategy."""

    kind: str  # the collective: "reduce_scatter" | "all_reduce"

    def piece_numel(self, p: Param) -> int:
        raise NotImplementedError

    def pack(
        self,
        unit: ShardedUnit,
        grads: list[torch.Tensor],
        had_grad: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        raise NotImplementedError

    def issue(self, unit: ShardedUnit, buffer: torch.Tensor) -> ReduceResult:
        raise NotImplementedError

    def land(self, p: Param, piece: torch.Tensor, keep_dtype: bool) -> None:
        raise NotImplementedError

    def finish(
        self, unit: ShardedUnit, pending: PendingReduce, output: torch.Tensor
    ) -> PendingReduce | None:
        """``pending``'s collective is done: land the gradients (None), or return the next
        collective of this reduction."""
        unit._land(output, pending)
        return None

    def divide_factors(self, unit: ShardedUnit) -> tuple[float, float]:
        """What the gradients are divided by before the collective and after it."""
        if unit.settings.gradient_divide_factor is not None:  # set_gradient_divide_factor
            return 1.0, unit.settings.gradient_divide_factor  # the plain sum, one division
        return unit._divide_factors


class ReduceScatter(Reduction):
    """Sharded gradients: each rank gets the sum of its rows (ZeRO-2, ZeRO-3)."""

    kind = "reduce_scatter"

    def piece_numel(self, p: Param) -> int:
        return p.shard_numel

    def pack(self, unit, grads, had_grad, dtype):
        # The copy-in casts to the reduce dtype; dividing after the cast is what torch FSDP does.
        numel = sum(p.shard_numel for p in unit.trainable) + len(unit.trainable)
        reduce_scatter_input = grads[0].new_empty(unit.world_size * numel, dtype=dtype)
        rank_major = [p.rank_major_grad(g) for p, g in zip(unit.trainable, grads)]
        # One "had a gradient" row per rank (Note [Unused parameters]).
        rank_major.append(had_grad.expand(unit.world_size, -1).contiguous())
        collectives.reduce_scatter_copy_in(rank_major, unit.world_size, reduce_scatter_input)
        return reduce_scatter_input

    def issue(self, unit, buffer):
        return collectives.reduce_scatter(
            buffer,
            unit.group,
            async_op=True,
            transport=unit.transport,
            tag=collectives.p2p_tag("reduce_scatter", unit.name),
        )

    def land(self, p, piece, keep_dtype):
        p.land_shard(piece, keep_dtype)


class HybridReduceScatter(ReduceScatter):
    """HYBRID_SHARD: reduce-scatter within the shard group, then all-reduce that slice across
    the replicas (Note [HSDP across replicas])."""

    def finish(self, unit, pending, output):
        if pending.across_replicas:
            unit._land(output, pending)
            return None
        return unit._across_replicas(pending, output)


class AllReduce(Reduction):
    """Whole gradients on every rank: NO_SHARD (DDP) and ZeRO-1, whose parameters take their rows."""

    kind = "all_reduce"

    def piece_numel(self, p: Param) -> int:
        return p.numel

    def pack(self, unit, grads, had_grad, dtype):
        return torch.cat([g.reshape(-1).to(dtype) for g in (*grads, had_grad)])

    def issue(self, unit, buffer):
        return collectives.all_reduce(buffer, unit.group, async_op=True)

    def land(self, p, piece, keep_dtype):
        p.land_whole(piece, keep_dtype)


class CanonicalReduction(Reduction):
    """The world-size-invariant mode (engine/canonical.py, docs/invariance.md): each rank gets
    the N ranks' rows of its piece unsummed (an all-to-all, the bytes of a reduce-scatter) and
    sums them in rank order as a subtree of the fixed tree; the step's V/N block sums climb the
    same tree (``TreeSum``); the root, divided by V (exact: a power of two), lands once the
    step's last micro-batch is in. ``base`` says which piece each rank keeps: its rows
    (``ReduceScatter``) or, through an all-gather of the summed chunks, everything
    (``AllReduce``: NO_SHARD, ZeRO-1)."""

    kind = "all_to_all"

    def __init__(
        self,
        base: Reduction,
        virtual_batches: int,
        world_size: int,
        replicas: int = 1,
        local: bool = False,
    ) -> None:
        self.base = base
        self.virtual_batches = virtual_batches
        self.world_size = world_size  # the shard group's
        self.replicas = replicas  # HYBRID_SHARD: the shard group's blocks meet across replicas
        per_rank = virtual_batches // (world_size * replicas)  # micro-batches per rank and step
        # The "local" schedule: a rank's micro-batches are adjacent leaves, summed here, unsharded,
        # and reduced once per step; else each one is reduced and its block sums climb ``tree``.
        self.local = canonical.TreeSum(per_rank) if local else None
        self._local_had: list[bool] | None = None  # which params had a gradient in any leaf
        self.tree = canonical.TreeSum(1 if local else per_rank)
        # Gradients landed on parameters autograd accumulates into (plain NO_SHARD's): a
        # backward must not find one there (Note [Canonical leaves]).
        # By id, checked by identity (a tensor's == is elementwise).
        self.landed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def piece_numel(self, p: Param) -> int:
        return self.base.piece_numel(p)

    def leaf(
        self, unit: ShardedUnit, grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None] | None:
        """One backward's gradients, the unit's leaf: what to reduce now, or None while the
        local schedule's sum of this rank's leaves is not complete.

        Note [Canonical leaves]: each backward's gradient must be one leaf. Where autograd
        accumulates into the parameter itself (plain NO_SHARD: forward runs on it), the gradient
        is taken off the parameter, or the next micro-batch's would add to it; and one landed
        last step and not zeroed would be summed into this step's first leaf.
        """
        for p in unit.trainable:
            grad = p.sharded_param.grad
            if p.unsharded_param is p.sharded_param and grad is not None:
                if self.landed.get(id(grad)) is grad:
                    raise RuntimeError(
                        f"unit {unit.name or '<root>'!r}: {p.fqn!r} still holds the last step's "
                        "gradient; in the canonical reduction mode call optimizer.zero_grad() "
                        "(set_to_none, its default) between steps"
                    )
        if self.local is None:
            return grads  # pack copies them before the whole ones are taken off
        dtype = unit.precision.reduce_dtype or next(
            (g.dtype for g in grads if g is not None), torch.float32
        )
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros(p.orig_size, device=unit.compute_device))
                .reshape(-1)
                .to(dtype)
                for g, p in zip(grads, unit.trainable)
            ]
        )
        self._take_whole_off(unit)
        had = [g is not None for g in grads]
        self._local_had = (
            had if self._local_had is None else [a or b for a, b in zip(self._local_had, had)]
        )
        total = self.local.push(flat)
        if total is None:
            return None
        pieces = total.split([p.numel for p in unit.trainable])
        had, self._local_had = self._local_had, None
        return [
            piece.view(p.orig_size) if used else None
            for piece, p, used in zip(pieces, unit.trainable, had)
        ]

    def clear(self) -> None:
        """Drop the partial sums (a step that raised)."""
        self.tree.clear()
        if self.local is not None:
            self.local.clear()
        self._local_had = None

    @staticmethod
    def _take_whole_off(unit: ShardedUnit) -> None:
        for p in unit.trainable:
            if p.unsharded_param is p.sharded_param:
                p.sharded_param.grad = None

    def pack(self, unit, grads, had_grad, dtype):
        buffer = self.base.pack(unit, grads, had_grad, dtype)
        self._take_whole_off(unit)
        pad = -buffer.numel() % self.world_size  # AllReduce's buffer: N equal chunks
        return torch.cat([buffer, buffer.new_zeros(pad)]) if pad else buffer

    def issue(self, unit, buffer):
        return collectives.all_to_all(buffer, unit.group, async_op=True)

    def land(self, p, piece, keep_dtype):
        self.base.land(p, piece, keep_dtype)
        if p.unsharded_param is p.sharded_param:
            grad = p.sharded_param.grad
            self.landed[id(grad)] = grad

    def divide_factors(self, unit: ShardedUnit) -> tuple[float, float]:
        post = unit.settings.gradient_divide_factor
        return 1.0, float(self.virtual_batches) if post is None else post

    def finish(self, unit, pending, output):
        block = canonical.tree_sum(output.view(self.world_size, -1).unbind(0))
        if isinstance(self.base, AllReduce):
            block = self._gather_chunks(unit, block, pending)
        if self.replicas > 1:
            if not unit.settings.requires_all_reduce:
                raise RuntimeError(
                    f"unit {unit.name or '<root>'!r}: set_requires_all_reduce(False) in the "
                    "canonical reduction mode would add micro-batches outside its fixed tree"
                )
            block = self._across_replicas(unit, block)
        step_sum = self.tree.push(block)  # a new tensor, or (N = 1) the packed buffer: ours
        if step_sum is not None:
            # Some leaves may lack a gradient this rank's did not: read the counts.
            unit._land(step_sum, dataclasses.replace(pending, had_every_grad=False))
        return None

    def _across_replicas(self, unit, block) -> torch.Tensor:
        """HYBRID_SHARD: replica i's shard group summed the leaves [i S, (i+1) S) of this
        micro-step (rank (i, j) runs leaf i S + j); the R block sums meet in replica order, the
        next levels of the same tree."""
        op = unit._issue("all_gather", "backward", block, unit.replicate_group)
        with collectives.failing_as(op):
            result = collectives.all_gather(block, unit.replicate_group, async_op=True)
        rows = unit._wait(op, result).view(self.replicas, -1)
        return canonical.tree_sum(rows.unbind(0))

    def _gather_chunks(self, unit, chunk, pending) -> torch.Tensor:
        """AllReduce's base: every rank's summed chunk, concatenated, without the padding."""
        if self.world_size == 1:
            return chunk
        op = unit._issue("all_gather", "backward", chunk)
        with collectives.failing_as(op):
            result = collectives.all_gather(chunk, unit.group, async_op=True)
        numel = sum(p.numel for p in unit.trainable) + len(unit.trainable)  # AllReduce.pack's
        return unit._wait(op, result)[:numel]


def _reduction(rules: Rules, replicate_group: dist.ProcessGroup | None) -> Reduction:
    """The reduction the strategy calls for; chosen once, when the unit is built."""
    if rules.grad_reduce == "all_reduce":
        return AllReduce()
    return HybridReduceScatter() if replicate_group is not None else ReduceScatter()


# What a unit's ``_gathered_versions`` becomes when an optimizer step came after its gather: kept
# unsharded params that no version counter can vouch for.
STALE: list[tuple[int, int]] = []
# Units holding kept unsharded params (Note [ZeRO-1]); any optimizer step makes them stale.
_KEEPING: weakref.WeakSet[ShardedUnit] = weakref.WeakSet()
_STEP_HOOK: list = []  # the one global hook, registered with the first unit that keeps a copy


def _forget_kept_copies(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's optimizer step post-hook: the next unshard of every keeping unit gathers again."""
    for unit in list(_KEEPING):
        unit._gathered_versions = STALE
    _KEEPING.clear()


class ShardedUnit:
    """The parameters of one wrapped module (or of one ``fully_shard([...])`` group); lives as
    long as its wrapper."""

    name: str  # the wrapped module's path from the root, "" for the root; set at lazy init
    params: list[Param]  # all managed params, in registration order
    trainable: list[Param]  # the ones with requires_grad, in the same order
    unit_shard_numel: int  # sum of shard_numel over params: this rank's all_gather_input
    runtime: UnitRuntime | None  # the root's, from its first forward (runtime.lazy_init)
    observers: tuple[Observer, ...]  # what watches its collectives and compute (observe.py)

    def __init__(
        self,
        params: list[Param],
        group: dist.ProcessGroup,
        rules: Rules,
        precision: Precision | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        settings: UnitSettings | None = None,
        buffer_dtypes: dict[tuple[nn.Module, str], torch.dtype] | None = None,
    ) -> None:
        self.name = ""
        self.params = params
        self.trainable = [p for p in params if p.requires_grad]
        self.group = group
        self.rank = group.rank()  # a stand-in's too (construct.py Note [Stand-in process groups])
        self.world_size = group.size()
        self.replicate_group = replicate_group  # HYBRID_SHARD: reduce across replicas too
        self.precision = precision or Precision()
        self.settings = settings or UnitSettings()
        # (module, buffer name) -> its full-precision dtype, which state dicts hand back.
        self.buffer_dtypes = dict(buffer_dtypes or {})
        # Where collectives and compute run; shards may live elsewhere (see offload.py).
        self.compute_device = params[0].unsharded_param.device if params else torch.device("cpu")
        self.runtime = None
        self.observers = ()
        # How the collectives move data: sends where measured faster (collectives.Transport),
        # chosen once here; scripts/bench.py sets collectives.BACKEND to compare.
        self.transport = collectives.Transport.choose(group, self.compute_device)
        self.shard_numels = [p.shard_numel for p in params]
        self.unit_shard_numel = sum(self.shard_numels)
        sharded = bool(params) and params[0].is_sharded
        # Forward runs on copies that are not what the optimizer steps (all but plain NO_SHARD).
        copies = bool(params) and all(p.unsharded_param is not p.sharded_param for p in params)
        # How the modules get unsharded params: one all-gather of the unit, or (NO_SHARD) each
        # parameter's own local copy, nothing to move for most (param.py Note [Parameter kinds]).
        self._fill_unsharded = self._all_gather if sharded else self._fill_locally
        self.reduction = _reduction(rules, replicate_group)
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        # Torch FSDP1's split of the data-parallel world size (collectives.grad_divide_factors).
        self._divide_factors = collectives.grad_divide_factors(self.world_size * replicas)
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self._gather: _PendingGather | None = None
        self._post_forward: _PostForward | None = None
        self._post_forward_rows: torch.Tensor | None = None  # hpZ's block, forward to backward
        self._gathered_versions: list[tuple[int, int]] | None = None  # at the last gather
        self._partial_reduce_output: torch.Tensor | None = None  # set_requires_all_reduce(False)
        self._frozen_beside_trainable = copies and len(self.trainable) < len(params)
        self.rules = rules
        self.keeps_frozen_unsharded = False
        self.set_rules(rules)

    def __repr__(self) -> str:
        return f"ShardedUnit({self.name or '<root>'!r}, {len(self.params)} params)"

    # ---- configuration --------------------------------------------------------------------------

    def attach(self, runtime: UnitRuntime, name: str) -> None:
        """Join ``runtime`` (the root's, runtime.lazy_init) under ``name``, its path from the root."""
        self.runtime = runtime
        self.name = name

    @property
    def post_forward_group(self) -> dist.ProcessGroup | None:
        """The group backward gathers within after hpZ's forward (Note [Post-forward shards])."""
        return None if self._post_forward is None else self._post_forward.group

    @property
    def is_root(self) -> bool:
        return self.runtime is not None and self.runtime.root is self

    def watch(self, observer: Observer) -> None:
        """Tell ``observer`` of this unit's collectives and compute from now on."""
        if not any(o is observer for o in self.observers):
            self.observers = (*self.observers, observer)

    def unwatch(self, observer: Observer) -> None:
        self.observers = tuple(o for o in self.observers if o is not observer)

    def set_rules(self, rules: Rules) -> None:
        """What the unit keeps after forward and backward (FSDP2's ``set_reshard_after_*``): the
        one place the choices that depend on it are made again."""
        self.rules = rules
        # Frozen params whose unsharded copy backward may read after the last gradient is in
        # (see Note [Frozen parameters in a unit] in runtime.py).
        self.keeps_frozen_unsharded = self._frozen_beside_trainable and rules.reshard_after_backward
        if rules.reshard_after_backward:
            # What keeping them between backwards kept (Note [ZeRO-1]) goes; the next unshard
            # gathers again. Unsharded params in use stay until their next reshard, which frees
            # them; until then a forward still knows whether they are stale (Note [Unsharded
            # after backward]).
            if self.state == ShardedState.SHARDED:
                self._gathered_versions = None
                for p in self.params:
                    p.free_unsharded()
        elif self.state == ShardedState.UNSHARDED and self._gathered_versions is None:
            # Unsharded params gathered before count as kept: a later unshard with unchanged
            # shards reuses them.
            self._remember_versions()

    def reshard_to_smaller_group(self, group: dist.ProcessGroup) -> None:
        """After forward, keep 1/len(group) of the gathered params instead of 1/N, and gather
        backward's within ``group`` (FSDP2's int ``reshard_after_forward``, ZeRO++'s hpZ).

        Note [Post-forward shards]: the shard group's N ranks are cut into groups of k
        consecutive ranks (``DeviceMesh(mesh.view(-1, k))``, as torch builds it); the rank at
        position j of its group keeps rows [j N/k, (j+1) N/k) of the forward's all-gather
        output, each row one rank's shards of every param. Gathering those blocks over the k
        ranks gives back all N rows in order, the layout the usual copy-out reads. The cost:
        N/k rows per unit from forward to backward; the gain: backward's all-gather spans k
        ranks (one node), not N. The reduce-scatter stays over all N.
        """
        per = self.world_size // dist.get_world_size(group)
        first = dist.get_rank(group) * per
        self._post_forward = _PostForward(
            group,
            collectives.Transport.choose(group, self.compute_device),
            slice(first, first + per),  # this rank's rows to keep
        )

    def use_canonical(self, virtual_batches: int, local: bool = False) -> None:
        """Reduce in the world-size-invariant tree of ``virtual_batches`` leaves per step
        (``CanonicalReduction``; ``local``: its local schedule); called before the first
        backward, on every rank."""
        base = (
            self.reduction.base
            if isinstance(self.reduction, CanonicalReduction)
            else self.reduction
        )
        replicas = dist.get_world_size(self.replicate_group) if self.replicate_group else 1
        self.reduction = CanonicalReduction(base, virtual_batches, self.world_size, replicas, local)

    def after_apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``nn.Module._apply(fn)`` ran and the shards were taken back
        (param.reset_sharded_param): anything kept unsharded is stale (ZeRO-1), so the next
        forward gathers again; buffers were cast by ``fn`` too, so their full-precision dtype
        follows it, and under ``MixedPrecision.buffer_dtype`` they compute in that dtype again."""
        self._gathered_versions = None
        buffer_dtype = self.precision.buffer_dtype
        for (m, name), dtype in list(self.buffer_dtypes.items()):
            self.buffer_dtypes[(m, name)] = fn(torch.empty(0, dtype=dtype)).dtype
            buf = m._buffers.get(name)
            if buf is not None and buffer_dtype is not None and buf.is_floating_point():
                m._buffers[name] = buf.to(buffer_dtype)

    def replaced_params(self) -> list[tuple[Param, nn.Parameter]]:
        """Each parameter whose modules hold another than the one this unit left there (a
        ``setattr`` after wrapping), with what they hold, checked before anything changes
        (Note [Replaced parameters] in runtime.py). Local: no collective."""
        unsharded = self.state == ShardedState.UNSHARDED
        found = []
        for p in self.params:
            held = p.unsharded_param if unsharded else p.sharded_param
            new = p.replacement(held, self.qualified(p))
            if new is not None:
                found.append((p, new))
        return found

    def follow_requires_grad(self) -> list[Param]:
        """Take ``requires_grad`` as set on each ``sharded_param`` since the last look (Note
        [requires_grad after wrapping]); returns the params that train from now on.

        Raises:
            ValueError: a disk-offloaded parameter wrapped frozen has no gradient file to train
                with; before any collective.
        """
        changed = [p for p in self.params if p.sharded_param.requires_grad != p.requires_grad]
        if not changed:
            return []
        for p in changed:
            if (
                p.sharded_param.requires_grad
                and p.disk_files is not None
                and not p.disk_files.grads
            ):
                raise ValueError(
                    f"parameter {self.qualified(p)!r} is disk-offloaded and was wrapped with "
                    "requires_grad=False, so no gradient file was reserved for it; set "
                    "requires_grad=True before wrapping to train it"
                )
        for p in changed:
            p.requires_grad = p.sharded_param.requires_grad
            # The copy forward runs on (the shard itself for plain NO_SHARD) decides whether
            # autograd computes a gradient for it.
            p.unsharded_param.requires_grad_(p.requires_grad)
            if not p.requires_grad:
                # Unsynced gradients kept from earlier backwards would never be reduced now;
                # torch FSDP1 gives a frozen parameter no gradient either.
                p.unsharded_accumulated_grad = None
        self.trainable = [p for p in self.params if p.requires_grad]
        copies = all(p.unsharded_param is not p.sharded_param for p in self.params)
        self._frozen_beside_trainable = copies and len(self.trainable) < len(self.params)
        self.keeps_frozen_unsharded = (
            self._frozen_beside_trainable and self.rules.reshard_after_backward
        )
        return [p for p in changed if p.requires_grad]

    def qualified(self, p: Param) -> str:
        """``p``'s name from the root (the unit's path, then its own)."""
        return f"{self.name}.{p.fqn}" if self.name else p.fqn

    def take_replaced(self, replaced: list[tuple[Param, nn.Parameter]]) -> None:
        """Make each replacement its parameter's ``sharded_param``, its values copied into the
        shard buffer the collectives read; anything kept unsharded is stale from now on."""
        self.reshard()  # the modules hold the (old) shards, so state and modules agree again
        for p, new in replaced:
            p.point_modules_to(new)
            p.reset_sharded_param(self.precision.param_dtype)
        self._gathered_versions = None

    def assert_state(self, *allowed: TrainingState) -> None:
        if self.training_state not in allowed:
            names = " or ".join(s.name for s in allowed)
            raise AssertionError(
                f"unit {self.name or '<root>'!r}: expected training state {names}, "
                f"got {self.training_state.name}"
            )

    def enter(self, state: TrainingState) -> None:
        """Move to training state ``state`` (the runtime's hooks, summon_full_params)."""
        self.training_state = state

    def computes(self, phase: str, edge: str) -> None:
        """Tell the observers that this unit's ``phase`` computation ``edge``s."""
        for o in self.observers:
            o.compute(self.name, phase, edge, self._step())

    # ---- unshard / reshard ----------------------------------------------------------------------

    def needs_unshard(self) -> bool:
        """Whether ``unshard`` would start filling the unsharded params now."""
        return (
            bool(self.params)
            and self._gather is None  # else prefetched: in flight or landed
            and self.state != ShardedState.UNSHARDED
            and not self._holds_fresh_copy()
        )

    def _holds_fresh_copy(self) -> bool:
        """ZeRO-1: the kept unsharded params still equal the shards (Note [ZeRO-1])."""
        if self._gathered_versions is STALE:  # a step that may have moved no version counter
            return False
        return self._gathered_versions is not None and self._gathered_versions == self._versions()

    def _remember_versions(self) -> None:
        self._gathered_versions = self._versions()
        _KEEPING.add(self)
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_post_hook(_forget_kept_copies))

    def _versions(self) -> list[tuple[int, int]]:
        # In-place ops on the DTensor (the optimizer's) bump its own version counter, not its
        # local tensor's; copies into sharded_flat (writeback, loads) bump only the flat's.
        return [(p.sharded_param._version, p.sharded_flat._version) for p in self.params]

    @outside_functorch
    def unshard(self, phase: str, async_op: bool = False) -> None:
        """Start filling the unsharded params (one all-gather; NO_SHARD: local copies);
        ``wait_for_unshard`` finishes it. ``async_op``: a prefetch, queued on the all-gather
        side stream where there is one (Note [Side-stream protocol]); a gather needed at once
        stays on the compute stream."""
        if (
            phase == "forward"
            and self.state == ShardedState.UNSHARDED
            and self._gathered_versions is not None
            and not self._holds_fresh_copy()
        ):
            # Kept unsharded after backward, then the shards changed (an optimizer step): the
            # copy is stale; gather again into it (Note [Unsharded after backward]).
            self._to_sharded()
        if self.state == ShardedState.SHARDED and self._holds_fresh_copy():
            self._to_unsharded()  # ZeRO-1 between steps with unchanged shards: nothing to move
        elif self.needs_unshard():
            for p in self.params:  # torch looks for it at each all-gather (set after wrapping)
                refuse_all_gather_extension(p.sharded_param, p.fqn)
            self._fill_unsharded(phase, async_op)

    def _fill_locally(self, phase: str, async_op: bool) -> None:
        """NO_SHARD: each parameter fills its own copy (a cast, or nothing); no collective."""
        for p in self.params:
            p.fill_unsharded()
        self._to_unsharded()

    def _all_gather(self, phase: str, async_op: bool) -> None:
        streams = self.runtime.streams if self.runtime is not None else None
        side = streams.all_gather if streams is not None and async_op else None
        from_post_forward = self.state == ShardedState.SHARDED_POST_FORWARD
        with self._queued_on(side), self._label("all_gather"):
            if from_post_forward:  # Note [Post-forward shards]
                group, transport = self._post_forward.group, self._post_forward.transport
                tag = "all_gather_post_forward"
                all_gather_input = self._post_forward_rows
                all_gather_output = all_gather_input.new_empty(
                    self.world_size * self.unit_shard_numel
                )
            else:
                group, transport, tag = self.group, self.transport, "all_gather"
                all_gather_input, all_gather_output = collectives.all_gather_buffers(
                    self.unit_shard_numel,
                    self.group,
                    dtype=self.params[0].unsharded_flat.dtype,  # param_dtype: cast once, on 1/N
                    device=self.compute_device,
                )  # 1D: unit_shard_numel, this rank's slot of N * unit_shard_numel
                shards = [
                    offload.to_device(p.sharded_flat, self.compute_device) for p in self.params
                ]
                collectives.all_gather_copy_in(shards, all_gather_input)
                self._remember_versions()  # what a kept copy will equal
                offload.after_copy_in(self.params, phase)
            op = self._issue("all_gather", phase, all_gather_input, group)
            with collectives.failing_as(op):
                result = collectives.all_gather(
                    all_gather_input,
                    group,
                    async_op=True,
                    all_gather_output=all_gather_output,
                    transport=transport,
                    tag=collectives.p2p_tag(tag, self.name),
                )
        self._gather = _PendingGather(result, op, side is not None, from_post_forward)

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Land the all-gather in flight, if any: copy out the unsharded params, point the
        modules at them."""
        pending, self._gather = self._gather, None
        if pending is None:
            return
        with self._label("wait_for_unshard"):
            self._wait(pending.op, pending.result)
            self._copy_out(pending.result.all_gather_output)
        if pending.on_side_stream:
            self.runtime.streams.after_copy_out()
        self._to_unsharded()

    def _copy_out(self, all_gather_output: torch.Tensor) -> None:
        with contextlib.ExitStack() as stack, torch.no_grad():
            # The copy writes into tensors autograd saved in forward; their contents are the same
            # values again, so keep the version counters that would otherwise fail the backward.
            for p in self.params:
                # Allocated only now, not when the all-gather started: a prefetched unit in
                # flight holds its all_gather_output alone.
                p.alloc_unsharded()
                stack.enter_context(
                    torch.autograd._unsafe_preserve_version_counter(p.unsharded_param)
                )
            targets = [p.gather_target() for p in self.params]  # param.py Note [Shard dim]
            collectives.all_gather_copy_out(
                all_gather_output, self.world_size, self.shard_numels, targets
            )
            for p, target in zip(self.params, targets):
                p.copy_out_gathered(target)

    @outside_functorch
    def reshard(self, after_forward: bool = False) -> None:
        """Point the modules at the shards and free the unsharded params (ZeRO-1 keeps them).
        ``after_forward``: backward follows; with a post-forward group this rank keeps its
        block of the gathered rows (Note [Post-forward shards])."""
        if self._gather is not None:  # a prefetch nobody used: land it, so nothing is in flight
            self.wait_for_unshard()
        if self.state == ShardedState.UNSHARDED:
            if after_forward and self._post_forward is not None:
                self._to_sharded_post_forward()
            else:
                self._to_sharded()
        elif self.state == ShardedState.SHARDED_POST_FORWARD and not after_forward:
            self._to_sharded()

    def reshard_after_backward(self) -> None:
        """This unit's backward is over: reshard, unless it stays unsharded (Note [Unsharded
        after backward])."""
        if (
            self.settings.unsharded_after_backward
            and not self.rules.reshard_after_backward
            and self.state == ShardedState.UNSHARDED
            and self._gather is None
            and self._gathered_versions is not None  # a gathered copy, whose staleness is known
        ):
            return
        self.reshard()

    def keep_unsynced_grads(self) -> None:
        """A backward without gradient sync ended (Note [Unsynced accumulation])."""
        if isinstance(self.reduction, CanonicalReduction):
            raise RuntimeError(
                f"unit {self.name or '<root>'!r}: a backward without gradient sync (no_sync, "
                "set_requires_gradient_sync(False)) in the canonical reduction mode would add "
                "micro-batches outside its fixed tree; run every micro-batch's backward with "
                "gradient sync"
            )
        reduce_dtype = self.precision.reduce_dtype
        if self.settings.unsynced_grads_in_reduce_dtype and reduce_dtype is not None:
            for p in self.trainable:
                p.keep_unsynced_grad(reduce_dtype)

    def reset(self) -> None:
        """Back to rest after a step that raised (runtime.reset_iter_state): the gather in
        flight lands, the modules hold the shards, and gradients not yet reduced are dropped."""
        if self._gather is not None:
            self.wait_for_unshard()
        for p in self.trainable:
            p.drop_unsharded_grad()
        self._partial_reduce_output = None
        if isinstance(self.reduction, CanonicalReduction):
            self.reduction.clear()
        self._to_sharded()
        self.training_state = TrainingState.IDLE

    def drop_reduce(self, pending: PendingReduce) -> None:
        """Wait for ``pending``'s collective and drop its result (runtime.reset_iter_state)."""
        self._wait(pending.op, pending.result)

    def land_unused_prefetch(self) -> None:
        """An all-gather in flight for a forward that did not come: land it and reshard."""
        if self._gather is not None:
            self.reshard()

    def end_of_backward(self) -> None:
        """Back to IDLE; a post-forward block backward did not reach goes now."""
        if self.state == ShardedState.SHARDED_POST_FORWARD:
            self._to_sharded()
        self.training_state = TrainingState.IDLE

    def _to_unsharded(self) -> None:
        for p in self.params:
            p.point_modules_to(p.unsharded_param)
        self._post_forward_rows = None
        self.state = ShardedState.UNSHARDED

    def _to_sharded(self) -> None:
        frees = self.rules.reshard_after_backward  # else kept (Note [ZeRO-1])
        if frees:
            self._gathered_versions = None
        for p in self.params:
            if frees:
                p.free_unsharded()
            p.point_modules_to(p.sharded_param)
        self._post_forward_rows = None
        self.state = ShardedState.SHARDED

    def _to_sharded_post_forward(self) -> None:
        with torch.no_grad():
            blocks = [
                p.gathered_rows(self._post_forward.block) for p in self.params
            ]  # each (N/k, shard_numel): those ranks' shards of one param
            rows = torch.cat(blocks, dim=1).reshape(-1)
        self._to_sharded()
        self._post_forward_rows = rows
        self.state = ShardedState.SHARDED_POST_FORWARD

    def buffers_in_flight(self) -> list[torch.Tensor]:
        """The all-gather output of an unshard in flight, for the trace's memory accounting."""
        return [] if self._gather is None else [self._gather.result.all_gather_output]

    # ---- gradients ------------------------------------------------------------------------------

    def start_reduce(self) -> PendingReduce | None:
        """Pack this backward's gradients (dropping autograd's), pre-divide, and issue the
        reduction over the shard group; None for a unit with nothing to reduce.

        See Note [Unused parameters] for parameters without a gradient.
        """
        if not self.trainable:
            return None
        grads = [p.take_unsharded_grad() for p in self.trainable]
        if isinstance(self.reduction, CanonicalReduction):
            grads = self.reduction.leaf(self, grads)
            if grads is None:  # the local schedule: more of this rank's leaves to come
                return None
        streams = self.runtime.streams if self.runtime is not None else None
        side = streams.reduce if streams is not None else None
        with self._queued_on(side), self._label(self.reduction.kind):
            if side is not None:
                for g in grads:
                    if g is not None:  # read on the reduce stream, then dropped
                        streams.hand_over(g, side)
            return self._issue_reduce(grads)

    def _issue_reduce(self, grads: list[torch.Tensor | None]) -> PendingReduce:
        filled = [
            g
            if g is not None
            else torch.zeros(p.orig_size, dtype=p.unsharded_param.dtype, device=self.compute_device)
            for g, p in zip(grads, self.trainable)
        ]
        reduce_dtype = self.precision.reduce_dtype or filled[0].dtype
        if len({g.dtype for g in filled}) > 1:  # an unsynced fp32 sum beside bf16 gradients
            filled = [g.to(reduce_dtype) for g in filled]  # the copy-in's cast, done first
        had_grad = torch.tensor([float(g is not None) for g in grads], dtype=filled[0].dtype)
        had_grad = had_grad.to(filled[0].device)
        pre, post = self.reduction.divide_factors(self)
        buffer = self.reduction.pack(self, filled, had_grad, reduce_dtype).div_(pre)
        op = self._issue(self.reduction.kind, "backward", buffer)
        with collectives.failing_as(op):
            result = self.reduction.issue(self, buffer)
        return PendingReduce(self, result, op, post, all(g is not None for g in grads))

    def advance_reduce(self, pending: PendingReduce) -> PendingReduce | None:
        """Wait for ``pending``'s collective; then land the averaged gradients on each
        parameter's ``sharded_param.grad`` and return None, or, under HSDP, issue the all-reduce
        across replicas and return it, to land at the next call (Note [HSDP across replicas])."""
        with self._label("finish_reduce"):
            output = self._wait(pending.op, pending.result)
            return self.reduction.finish(self, pending, output)

    def _across_replicas(
        self, pending: PendingReduce, output: torch.Tensor
    ) -> PendingReduce | None:
        """HSDP: the shard group's sum ``output`` is in; all-reduce it across the replicas (or,
        under FSDP2's ``set_requires_all_reduce(False)``, keep it for a later backward)."""
        if self._partial_reduce_output is not None:  # what backwards without it summed
            output.add_(self._partial_reduce_output)
            self._partial_reduce_output = None
        if not self.settings.requires_all_reduce:
            # HSDP accumulation: keep this shard group's sum, unscaled, for the next backward
            # that all-reduces; no grad yet.
            self._partial_reduce_output = output
            return None
        streams = self.runtime.streams if self.runtime is not None else None
        with self._queued_on(streams.reduce if streams is not None else None):
            op = self._issue("all_reduce", "backward", output, self.replicate_group)
            with collectives.failing_as(op):
                result = collectives.all_reduce(output, self.replicate_group, async_op=True)
        return dataclasses.replace(pending, result=result, op=op, across_replicas=True)

    def _land(self, output: torch.Tensor, pending: PendingReduce) -> None:
        if pending.post_divide != 1.0:
            output.div_(pending.post_divide)
        ranks_with_grad = output[-len(self.trainable) :]  # > 0 where any rank had one
        # Reading the counts waits for the device; when this rank had every gradient, every
        # count is at least 1 and the read, a host sync per unit on an accelerator, is skipped.
        used_counts = (
            [1.0] * len(self.trainable) if pending.had_every_grad else ranks_with_grad.tolist()
        )
        keep_dtype = self.precision.keep_low_precision_grads
        offset = 0
        landed = []
        for p, used in zip(self.trainable, used_counts):
            numel = self.reduction.piece_numel(p)
            if used > 0 or self.settings.lands_unused_grads:
                self.reduction.land(p, output[offset : offset + numel], keep_dtype)
                landed.append(p)
            offset += numel
        offload.after_grads(self.trainable)
        if self.settings.runs_sharded_grad_hooks:
            for p in landed:
                p.run_grad_hooks()

    def gather_full(
        self,
        sharded_flats: list[torch.Tensor],
        phase: str,
        keep: bool = True,
        device: torch.device | None = None,
    ) -> list[torch.Tensor | None]:
        """All-gather one padded 1D shard per parameter into fresh, exact-size full tensors.

        For summon_full_params and state dicts: unlike ``unshard`` it keeps the inputs' dtype
        (full precision) and leaves the step's unsharded params alone. With ``keep`` False this
        rank only takes part (rank0_only on the other ranks); ``device`` defaults to the shards'.
        """
        all_gather_input = offload.to_device(torch.cat(sharded_flats), self.compute_device)
        op = self._issue("all_gather", phase, all_gather_input)
        with collectives.failing_as(op):
            # A tag apart from the step's gathers: this one is in full precision, theirs may not be.
            result = collectives.all_gather(
                all_gather_input,
                self.group,
                async_op=True,
                transport=self.transport,
                tag=collectives.p2p_tag("all_gather_full", self.name),
            )
        self._wait(op, result)
        if not keep:
            return [None] * len(self.params)
        gathered = result.all_gather_output.view(self.world_size, -1)  # (N, unit_shard_numel)
        full, offset = [], 0
        for p in self.params:
            full.append(p.full_from_rows(gathered[:, offset : offset + p.shard_numel], device))
            offset += p.shard_numel
        return full

    # ---- collectives, observed ------------------------------------------------------------------

    def _step(self) -> int:
        return self.runtime.step if self.runtime is not None else 1

    def _issue(
        self, kind: str, phase: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> Collective:
        """Describe a collective about to be issued on ``group`` (default: the shard group) with
        ``tensor`` as this rank's input, and tell the observers."""
        op = Collective(
            kind,
            self.name,
            phase,
            self._step(),
            group or self.group,
            tensor.dtype,
            tensor.numel(),
            tensor.device,
        )
        for o in self.observers:
            o.issued(op)
        return op

    def _wait(self, op: Collective, result: AllGatherResult | ReduceResult) -> torch.Tensor:
        """Block until ``op`` is done (through the waiter an observer set, if any), then tell the
        observers; a failure names ``op`` (``CollectiveError``)."""
        with collectives.failing_as(op):
            output = result.wait(op.waiter)
        for o in self.observers:
            o.waited(op)
        return output

    def _label(self, what: str) -> contextlib.AbstractContextManager:
        """``fsdp_lite::<what> <unit>`` in torch's profiler (the glossary's words); nothing when
        no profiler runs."""
        if not torch.autograd.profiler._is_profiler_enabled:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"fsdp_lite::{what} {self.name or '<root>'}")

    def _queued_on(self, side) -> contextlib.AbstractContextManager:
        """The block's device work queued on side stream ``side`` (after the compute stream's), or
        in program order where it is None (CPU, or a gather needed at once)."""
        if side is None:
            return contextlib.nullcontext()
        return self.runtime.streams.enter(side)
