"""One unit: the parameters of one wrapped module, and their state machine.

A unit moves its parameters between the sharded and the unsharded copy (``unshard``,
``wait_for_unshard``, ``reshard``) and averages their gradients (``reduce_grads``,
``finish_reduce``), one flat collective each. It decides nothing about *when*: runtime.py calls it
from the hooks. Only ``_to_sharded`` and ``_to_unsharded`` change ``ShardedState``.

Note [Unused parameters]: a parameter unused in this forward has no gradient on this rank, but it
may have one on another. Every rank must join the same collective, so it contributes zeros, and
each rank also sends a 1 or 0 per parameter in the same buffer ("had a gradient"). After the
reduction a parameter gets a gradient if any rank had one, and keeps ``None`` only if no rank did:
what DDP with ``find_unused_parameters=True`` does, with no extra collective.

Note [ZeRO-1]: under SHARD_OPTIM the unsharded params are never freed and gradients are all-reduced,
so every rank holds whole params and whole averaged gradients, as in DDP. Between steps the modules
hold the 1/N ``sharded_param`` shards, as under every strategy, so an optimizer built on
``model.parameters()`` steps only this rank's rows with their rows of the gradient: 1/N of the
optimizer state. The step changes the shards in place, which bumps their version counters; the next
forward sees the counters moved and all-gathers into the kept unsharded params, or, if nothing
moved, points the modules back at them with no collective. Any in-place change to the shards (a
loaded state dict, a manual edit under no_grad) is picked up the same way, with no optimizer hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lite.api import BackwardPrefetch, Rules
from fsdp_lite.engine import collectives, offload
from fsdp_lite.engine.collectives import AllGatherResult, ReduceResult
from fsdp_lite.engine.mixed_precision import Precision
from fsdp_lite.engine.param import ShardedParam
from fsdp_lite.engine.streams import SideStreams
from fsdp_lite.tools import order
from fsdp_lite.tools.order import CollectiveError

__all__ = [
    "CollectiveError",
    "PendingReduce",
    "ShardedState",
    "ShardedUnit",
    "TrainingState",
    "owns_unit",
    "unit_owners",
]


def _grad_dtype(p: ShardedParam) -> torch.dtype:
    """The dtype autograd gives this parameter's gradient: that of the copy forward ran on."""
    return (p.unsharded_flat if p.unsharded_flat is not None else p.sharded_flat).dtype


def owns_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a wrapper, of either front: it holds a ``ShardedUnit`` as ``_unit``.

    Files below the fronts find wrappers this way, so that none of them imports a front.
    """
    return isinstance(module.__dict__.get("_unit"), ShardedUnit)


def unit_owners(module: nn.Module) -> list[nn.Module]:
    """Every wrapper in ``module``'s tree, ``module`` included, in pre-order."""
    return [m for m in module.modules() if owns_unit(m)]


@dataclass
class PendingReduce:
    """A unit's gradient reduction in flight, from ``reduce_grads`` until ``finish_reduce``.

    The runtime starts one in a unit's post-backward and lands it in the next unit's (or at the
    end of backward), so that the collective overlaps that unit's gradient computation.
    """

    result: ReduceResult  # the collective's output and work
    post_divide: float  # what the sum is divided by after the collective
    kind: str  # "reduce_scatter" | "all_reduce", for the trace and profiler labels
    had_every_grad: bool  # this rank had every gradient: no "had a gradient" count to read
    on_stall: Callable[[], None] | None = None  # the order check of its wait (order.py)


class ShardedState(Enum):
    """Which copy of a unit's parameters the module sees, and what is allocated."""

    SHARDED = auto()  # only the 1/N shards are allocated; modules hold sharded_param
    UNSHARDED = auto()  # unsharded params are allocated too; modules hold unsharded_param


class TrainingState(Enum):
    """Where in the step a unit is; hooks assert it so that one firing out of order names the unit."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()  # between this unit's pre_backward and its post_backward
    SUMMON = auto()  # inside summon_full_params


class ShardedUnit:
    """The sharded parameters of one wrapped module; lives as long as its wrapper."""

    name: str  # the wrapped module's path from the root, "" for the root; set at lazy init
    params: list[ShardedParam]  # all managed params, in registration order
    trainable: list[ShardedParam]  # the ones with requires_grad, in the same order
    unit_shard_numel: int  # sum of shard_numel over params: this rank's all_gather_input
    trace: object | None  # a trace.CollectiveTrace while one records, else None
    streams: SideStreams | None  # on accelerators, set by the root at lazy init (streams.py)
    # When runtime.py starts the next unit's all-gather from this unit's hooks (torch FSDP1 reads
    # these per unit too); construct.py sets them from the unit's config.
    forward_prefetch: bool
    backward_prefetch: BackwardPrefetch | None
    runtime: object | None  # the root's runtime.StepRuntime (which imports this file)

    def __init__(
        self,
        params: list[ShardedParam],
        group: dist.ProcessGroup,
        rules: Rules,
        precision: Precision | None = None,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.name = ""
        self.params = params
        self.trainable = [p for p in params if p.requires_grad]
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.rules = rules
        self.precision = precision or Precision()
        self.replicate_group = replicate_group  # HYBRID_SHARD: reduce across replicas too
        # Where collectives and compute run; shards may live elsewhere (see offload.py).
        self.compute_device = (
            params[0].unsharded_flat.device
            if params and params[0].unsharded_flat is not None
            else (params[0].sharded_flat.device if params else torch.device("cpu"))
        )
        self.buffer_dtypes: dict[tuple[object, str], torch.dtype] = {}  # (module, name) -> original
        self.is_root = False
        self.trace = None
        self.streams = None
        self.forward_prefetch = True
        self.backward_prefetch = BackwardPrefetch.BACKWARD_PRE
        self.runtime = None  # the root's runtime.StepRuntime, from runtime.lazy_init
        # False (no_sync, set_requires_gradient_sync): backward keeps the unsharded gradients,
        # to accumulate, and reduces nothing.
        self.requires_gradient_sync = True
        # False (FSDP2's set_is_last_backward): more backwards of this step follow, as between
        # pipelining's microbatches; the step counter waits for the last one.
        self.is_last_backward = True
        # A backward without gradient sync left gradients on the unsharded params, not reduced.
        self.grads_unreduced = False
        # False (FSDP2's set_requires_all_reduce, HSDP only): reduce-scatter within the shard
        # group but skip the all-reduce across replicas; the sum waits in _partial_reduce_output.
        self.requires_all_reduce = True
        # False (FSDP2's set_unshard_in_backward): backward needs none of these params (an
        # embedding's weight gradient reads only indices and output gradients): no gather.
        self.unshard_in_backward = True
        self._partial_reduce_output: torch.Tensor | None = None
        # As the root, keep the unsharded params after forward (backward starts with them);
        # FSDP2's explicit reshard_after_forward=True on the root frees them.
        self.root_keeps_params = True
        # None: average over the data-parallel ranks; else sum, then divide by this (FSDP2's
        # set_gradient_divide_factor; 1.0 when the loss is already normalized globally).
        self.gradient_divide_factor: float | None = None
        # An event the next forward's first all-gather waits for (FSDP2's set_post_optim_event).
        self.post_optim_event = None
        # Units to prefetch from this one's pre-forward / pre-backward, set explicitly (FSDP2's
        # set_modules_to_forward_prefetch); None: the next in the recorded order.
        self.forward_prefetch_units: list[ShardedUnit] | None = None
        self.backward_prefetch_units: list[ShardedUnit] | None = None
        # Modules this unit leaves out beyond its parent's (a policy's override): the parent
        # unit takes their params, as in torch FSDP1 (construct._ignored_by_nested).
        self.ignored_modules: frozenset = frozenset()
        # How the collectives move data: sends where measured faster (collectives.Transport),
        # chosen once here; scripts/bench.py sets collectives.BACKEND to compare.
        self.transport = collectives.Transport.choose(group, self.compute_device)
        self.shard_numels = [p.shard_numel for p in params]
        self.unit_shard_numel = sum(self.shard_numels)

        # Whether forward runs on a separate unsharded copy: a gathered one when sharded, a cast
        # one for NO_SHARD under mixed precision; otherwise modules always hold the params.
        self.uses_unsharded_copy = bool(params) and all(
            p.unsharded_param is not None for p in params
        )
        self.state = ShardedState.SHARDED if self.uses_unsharded_copy else ShardedState.UNSHARDED
        self.training_state = TrainingState.IDLE
        self._all_gather: AllGatherResult | None = None  # an unshard in flight
        self._gathering_on_side_stream = False  # that unshard runs on streams.all_gather
        self._gather_phase = "forward"  # that unshard's phase, for error messages
        self._gather_stalled = None  # what that unshard's wait calls when it stalls
        # Log every collective and compare the ranks' logs when a wait stalls (Note [Collective
        # order] in order.py); scripts/bench.py turns it off to measure its cost.
        self.order_check = True
        self._order_logs = {  # group -> its order.OrderLog
            g: order.log_for(g) for g in (group, replicate_group) if g is not None
        }
        # FSDP2's int reshard_after_forward (ZeRO++'s hpZ): see Note [Post-forward shards].
        self.post_forward_group: dist.ProcessGroup | None = None
        self._post_forward_transport: collectives.Transport | None = None
        self._post_forward_block: slice | None = None  # which of the N rows this rank keeps
        self._post_forward_rows: torch.Tensor | None = (
            None  # this rank's block, forward to backward
        )
        self._gathering_post_forward = False  # the unshard in flight gathers those blocks
        self._pending_reduce: PendingReduce | None = None  # a reduction in flight
        self._gathered_versions: list[tuple[int, int]] | None = None  # at the last gather
        # Frozen params whose unsharded copy backward may read after the last gradient is in
        # (see Note [Frozen parameters in a unit] in runtime.py).
        self.keeps_frozen_unsharded = (
            self.uses_unsharded_copy
            and rules.reshard_after_backward
            and len(self.trainable) < len(self.params)
        )
        # Per-backward bookkeeping, reset by reset_backward().
        self.num_grads_ready = 0
        self.ran_pre_backward = False
        self.ran_post_backward = False
        self.input_grads_pending = 0  # forwards whose inputs' gradients are not in yet
        self.inputs_hooked = False  # some forward's inputs carry a gradient hook this step
        self.reduced = False

    def __repr__(self) -> str:
        return f"ShardedUnit({self.name or '<root>'!r}, {len(self.params)} params)"

    def assert_state(self, *allowed: TrainingState) -> None:
        if self.training_state not in allowed:
            names = " or ".join(s.name for s in allowed)
            raise AssertionError(
                f"unit {self.name or '<root>'!r}: expected training state {names}, "
                f"got {self.training_state.name}"
            )

    def after_apply(self) -> None:
        """The shards were taken back after ``nn.Module._apply`` (param.reset_sharded_param):
        anything kept unsharded is stale (ZeRO-1), and the next forward gathers again."""
        self._gathered_versions = None

    # ---- unshard / reshard -------------------------------------------------------------------

    def needs_all_gather(self) -> bool:
        """Whether ``unshard`` would start an all-gather (or the NO_SHARD cast) now."""
        return (
            bool(self.params)
            and self._all_gather is None  # else prefetched: in flight or landed
            and self.state == ShardedState.SHARDED
            and not self._holds_fresh_copy()
        )

    def _holds_fresh_copy(self) -> bool:
        """ZeRO-1: the kept unsharded params still equal the shards (Note [ZeRO-1])."""
        return self._gathered_versions is not None and self._gathered_versions == self._versions()

    def _versions(self) -> list[tuple[int, int]]:
        # In-place ops on the DTensor (the optimizer's) bump its own version counter, not its
        # local tensor's; copies into sharded_flat (writeback, loads) bump only the flat's.
        return [(p.sharded_param._version, p.sharded_flat._version) for p in self.params]

    def unshard(self, phase: str, async_op: bool = False) -> None:
        """Start the all-gather of this unit's shards; ``wait_for_unshard`` finishes it."""
        if self.state == ShardedState.SHARDED and self._holds_fresh_copy():
            self._to_unsharded()  # ZeRO-1 between steps with unchanged shards: nothing to move
            return
        if not self.needs_all_gather():
            return
        if not self.rules.shard_params:
            self._cast_copy()
            return
        # A prefetch runs on the all-gather side stream where there is one; a gather the compute
        # needs right away stays on the compute stream (Note [Side-stream protocol]).
        side = self.streams.all_gather if self.streams is not None and async_op else None
        with self._queued_on(side), self._label("all_gather"):
            self._gathering_post_forward = self._post_forward_rows is not None
            if self._gathering_post_forward:  # Note [Post-forward shards]
                group, transport = self.post_forward_group, self._post_forward_transport
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
                if not self.rules.reshard_after_backward:
                    self._gathered_versions = self._versions()
                offload.after_copy_in(self.params, phase)
            self._gather_stalled = self._record("all_gather", phase, all_gather_input, group)
            with self._failing_names("all_gather", phase, group):
                self._all_gather = collectives.all_gather(
                    all_gather_input,
                    group,
                    async_op=async_op,
                    all_gather_output=all_gather_output,
                    transport=transport,
                    tag=collectives.p2p_tag(tag, self.name),
                    on_stall=self._gather_stalled,
                )
        self._gathering_on_side_stream = side is not None
        self._gather_phase = phase

    @contextlib.contextmanager
    def _failing_names(self, kind: str, phase: str, group: dist.ProcessGroup):
        """A collective that fails (a rank died, a timeout) re-raises as ``CollectiveError``,
        naming the collective, this unit, the phase, the step and the group's ranks."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            step = getattr(self.runtime, "step", 1)
            ranks = dist.get_process_group_ranks(group)
            raise CollectiveError(
                f"fsdp_lite: {kind.replace('_', '-')} of unit {self.name or '<root>'!r} in "
                f"{phase} of step {step} failed (group of ranks {ranks}): {e}"
            ) from e

    def _label(self, what: str) -> contextlib.AbstractContextManager:
        """``fsdp_lite::<what> <unit>`` in torch's profiler (the glossary's words); nothing when
        no profiler runs."""
        if not torch.autograd.profiler._is_profiler_enabled:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"fsdp_lite::{what} {self.name or '<root>'}")

    def _queued_on(self, side) -> contextlib.AbstractContextManager:
        """The block's device work queued on side stream ``side`` (after the compute stream's), or
        in program order where it is None (CPU, or a gather needed at once)."""
        return self.streams.enter(side) if side is not None else contextlib.nullcontext()

    def wait_for_unshard(self) -> None:
        result, self._all_gather = self._all_gather, None
        if result is None:
            return
        with self._label("wait_for_unshard"):
            self._wait_and_copy_out(result)
        if self._gathering_on_side_stream:
            self.streams.after_copy_out()
        self._to_unsharded()

    def _wait_and_copy_out(self, result: AllGatherResult) -> None:
        group = self.post_forward_group if self._gathering_post_forward else self.group
        with self._failing_names("all_gather", self._gather_phase, group):
            result.wait(self._gather_stalled)
        self._record_done("all_gather")
        if self._gathering_post_forward:
            self._post_forward_rows, self._gathering_post_forward = None, False
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
                result.all_gather_output, self.world_size, self.shard_numels, targets
            )
            for p, target in zip(self.params, targets):
                p.copy_out_gathered(target)

    def _cast_copy(self) -> None:
        """NO_SHARD under mixed precision: the unsharded copy is a local cast, no collective."""
        with contextlib.ExitStack() as stack, torch.no_grad():
            for p in self.params:  # see the version-counter comment in wait_for_unshard
                p.alloc_unsharded()
                stack.enter_context(
                    torch.autograd._unsafe_preserve_version_counter(p.unsharded_param)
                )
                p.unsharded_param.copy_(p.sharded_param)
        self._to_unsharded()

    def reshard(self, after_forward: bool = False) -> None:
        """Point the modules at the shards and free the unsharded params (ZeRO-1 keeps them).
        ``after_forward``: backward follows; with a post-forward group this rank keeps its
        block of the gathered rows first (Note [Post-forward shards])."""
        if self._all_gather is not None:  # a prefetch nobody used: finish it so buffers can go
            self.wait_for_unshard()
        if self.state == ShardedState.UNSHARDED and self.uses_unsharded_copy:
            if after_forward and self.post_forward_group is not None:
                self._keep_post_forward_rows()
            self._to_sharded()

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
        self.post_forward_group = group
        self._post_forward_transport = collectives.Transport.choose(group, self.compute_device)
        self._order_logs[group] = order.log_for(group)
        per = self.world_size // dist.get_world_size(group)
        first = dist.get_rank(group) * per
        self._post_forward_block = slice(first, first + per)  # this rank's rows to keep

    def _keep_post_forward_rows(self) -> None:
        with torch.no_grad():
            blocks = [
                p.gathered_rows(self._post_forward_block) for p in self.params
            ]  # each (N/k, shard_numel): those ranks' shards of one param
            self._post_forward_rows = torch.cat(blocks, dim=1).reshape(-1)

    def keep_current_copy(self) -> None:
        """reshard_after_backward just became False: unsharded params gathered before count as
        kept (Note [ZeRO-1]), so a later unshard with unchanged shards reuses them."""
        if self.state == ShardedState.UNSHARDED and self.uses_unsharded_copy:
            if self._gathered_versions is None:
                self._gathered_versions = self._versions()

    def drop_kept_copy(self) -> None:
        """Free unsharded params kept while the modules hold the shards (reshard_after_backward
        was False, Note [ZeRO-1]); the next unshard gathers again."""
        self._gathered_versions = None
        if self.state == ShardedState.SHARDED and self.uses_unsharded_copy:
            for p in self.params:
                p.free_unsharded()

    def _to_unsharded(self) -> None:
        for p in self.params:
            p.point_modules_to(p.unsharded_param)
        self.state = ShardedState.UNSHARDED

    def _to_sharded(self) -> None:
        for p in self.params:
            if self.rules.reshard_after_backward:
                p.free_unsharded()
            p.point_modules_to(p.sharded_param)
        self.state = ShardedState.SHARDED

    # ---- gradients ---------------------------------------------------------------------------

    def unsharded_grads(self) -> list[torch.Tensor | None]:
        """The gradient autograd left on each trainable parameter's unsharded (or only) copy."""
        if self.uses_unsharded_copy:
            return [p.local_grad(p.unsharded_param.grad) for p in self.trainable]
        return [p.sharded_param.grad for p in self.trainable]

    def reduce_grads(self) -> None:
        """Start averaging this backward's gradients over ranks; ``finish_reduce`` lands them.

        See Note [Unused parameters] for parameters without a gradient.
        """
        if not self.trainable:
            return
        grads = self.unsharded_grads()
        side = self.streams.reduce if self.streams is not None else None
        with self._queued_on(side), self._label(self.rules.grad_reduce):
            if side is not None:
                for g in grads:
                    if g is not None:  # read on the reduce stream, then dropped below
                        self.streams.hand_over(g, side)
            self._pending_reduce = self._start_reduce(grads)
        self.reduced = True
        self.grads_unreduced = False

    def _start_reduce(self, grads: list[torch.Tensor | None]) -> PendingReduce:
        """Pack, pre-divide and issue this unit's gradient collective; drop autograd's grads."""
        filled = [
            g
            if g is not None
            else torch.zeros(p.orig_size, dtype=_grad_dtype(p), device=self.compute_device)
            for g, p in zip(grads, self.trainable)
        ]
        reduce_dtype = self.precision.reduce_dtype or filled[0].dtype
        # One row per rank, so that after the reduction every rank holds the count of ranks that
        # had each gradient. See Note [Unused parameters].
        had_grad = torch.tensor([float(g is not None) for g in grads], dtype=filled[0].dtype)
        filled.append(had_grad.to(filled[0].device).expand(self.world_size, -1).contiguous())
        replicas = dist.get_world_size(self.replicate_group) if self.replicate_group else 1
        pre, post = collectives.grad_divide_factors(self.world_size * replicas)
        if self.gradient_divide_factor is not None:  # FSDP2's set_gradient_divide_factor
            pre, post = 1.0, self.gradient_divide_factor  # the plain sum, then one division
        if self.rules.grad_reduce == "reduce_scatter":
            numel = sum(p.shard_numel for p in self.trainable) + len(self.trainable)
            # The copy-in casts to reduce_dtype; dividing after the cast is what torch FSDP does.
            reduce_scatter_input = filled[0].new_empty(self.world_size * numel, dtype=reduce_dtype)
            rank_major = [p.rank_major_grad(g) for p, g in zip(self.trainable, filled)]
            rank_major.append(filled[-1])  # the had-grad row
            collectives.reduce_scatter_copy_in(rank_major, self.world_size, reduce_scatter_input)
            reduce_scatter_input.div_(pre)
            kind = "reduce_scatter"
            stalled = self._record(kind, "backward", reduce_scatter_input)
            with self._failing_names(kind, "backward", self.group):
                result = collectives.reduce_scatter(
                    reduce_scatter_input,
                    self.group,
                    async_op=True,
                    transport=self.transport,
                    tag=collectives.p2p_tag("reduce_scatter", self.name),
                )
            for p in self.trainable:
                p.unsharded_param.grad = None  # its data now lives in reduce_scatter_input
        else:
            filled[-1] = filled[-1][0]  # all-reduce: every rank keeps the whole buffer, one row
            flat_grads = torch.cat([g.reshape(-1).to(reduce_dtype) for g in filled]).div_(pre)
            if self.uses_unsharded_copy:
                for p in self.trainable:
                    p.unsharded_param.grad = None  # its data now lives in flat_grads
            kind = "all_reduce"
            stalled = self._record(kind, "backward", flat_grads)
            with self._failing_names(kind, "backward", self.group):
                result = collectives.all_reduce(flat_grads, self.group, async_op=True)
        return PendingReduce(result, post, kind, all(g is not None for g in grads), stalled)

    def finish_reduce(self) -> None:
        """Wait for the reduction and write each parameter's averaged gradient."""
        pending, self._pending_reduce = self._pending_reduce, None
        if pending is None:
            return
        with self._label("finish_reduce"):
            self._land(pending)

    def _land(self, pending: PendingReduce) -> None:
        result, post, kind = pending.result, pending.post_divide, pending.kind
        with self._failing_names(kind, "backward", self.group):
            output = result.wait(pending.on_stall)
        self._record_done(kind)
        if self.replicate_group is not None:
            if self._partial_reduce_output is not None:  # what backwards without it summed
                output.add_(self._partial_reduce_output)
                self._partial_reduce_output = None
            if not self.requires_all_reduce:
                # HSDP accumulation (FSDP2's set_requires_all_reduce(False)): keep this shard
                # group's sum, unscaled, for the next backward that all-reduces; no grad yet.
                self._partial_reduce_output = output
                return
            # HYBRID_SHARD: every replica holds the same 1/N slice; sum it across them.
            stalled = self._record("all_reduce", "backward", output, self.replicate_group)
            with self._failing_names("all_reduce", "backward", self.replicate_group):
                collectives.all_reduce(output, self.replicate_group, async_op=True).wait(stalled)
            self._record_done("all_reduce")
        if post != 1.0:
            output.div_(post)
        ranks_with_grad = output[-len(self.trainable) :]  # > 0 where any rank had one
        # Reading the counts waits for the device; when this rank had every gradient, every
        # count is at least 1 and the read, a host sync per unit on an accelerator, is skipped.
        used_counts = (
            [1.0] * len(self.trainable) if pending.had_every_grad else ranks_with_grad.tolist()
        )
        scattered = self.rules.grad_reduce == "reduce_scatter"
        offset = 0
        for p, used in zip(self.trainable, used_counts):
            numel = p.shard_numel if scattered else p.numel  # this rank's slice, or all of it
            piece = output[offset : offset + numel]
            if used > 0 and self.rules.shard_params:
                if not scattered:  # ZeRO-1: a view of this rank's rows of the whole gradient
                    piece = p.rows_of(piece)
                p.set_sharded_grad(piece, self.precision.keep_low_precision_grads)
            elif used > 0 and self.uses_unsharded_copy:  # NO_SHARD + mixed precision or offload
                grad = offload.to_device(piece.view(p.orig_size), p.sharded_flat.device)
                if not self.precision.keep_low_precision_grads:
                    grad = grad.to(p.sharded_param.dtype)
                elif grad.dtype != p.sharded_param.dtype:
                    p.sharded_param.grad_dtype = None  # torch refuses another dtype otherwise
                if p.sharded_param.grad is None:
                    p.sharded_param.grad = grad
                else:
                    p.sharded_param.grad += grad  # fresh copy grads each backward: accumulate
            elif used > 0 and p.sharded_param.grad is None:
                p.sharded_param.grad = piece.view(p.orig_size).to(p.sharded_param.dtype)
            elif used > 0:
                p.sharded_param.grad.copy_(piece.view(p.orig_size))
            offset += numel
        offload.after_grads(self.trainable)

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
        stalled = self._record("all_gather", phase, all_gather_input)
        with self._failing_names("all_gather", phase, self.group):
            # A tag apart from the step's gathers: this one is in full precision, theirs may not be.
            result = collectives.all_gather(
                all_gather_input,
                self.group,
                async_op=True,
                transport=self.transport,
                tag=collectives.p2p_tag("all_gather_full", self.name),
            )
            result.wait(stalled)
        self._record_done("all_gather")
        if not keep:
            return [None] * len(self.params)
        gathered = result.all_gather_output.view(self.world_size, -1)  # (N, unit_shard_numel)
        full, offset = [], 0
        for p in self.params:
            full.append(p.full_from_rows(gathered[:, offset : offset + p.shard_numel], device))
            offset += p.shard_numel
        return full

    def reset_backward(self) -> None:
        self._post_forward_rows = None  # a unit backward did not reach: its block goes now
        self.num_grads_ready = 0
        self.ran_pre_backward = False
        self.ran_post_backward = False
        self.input_grads_pending = 0
        self.inputs_hooked = False
        self.reduced = False
        self.training_state = TrainingState.IDLE

    def _record(
        self, kind: str, phase: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> Callable[[], None] | None:
        """Log a collective about to be issued on ``group`` (default: the shard group) for the
        trace and the order check; returns what its wait calls when it stalls (order.py)."""
        if self.trace is not None:
            self.trace.record(kind=kind, unit=self.name, phase=phase, tensor=tensor)
        if not self.order_check:
            return None
        log = self._order_logs[group or self.group]
        step = getattr(self.runtime, "step", 1)
        return log.issued(step, kind, self.name, phase, tensor.numel())

    def _record_done(self, kind: str) -> None:
        if self.trace is not None:  # this rank's wait returned; see Note [Trace times and memory]
            self.trace.collective_done(unit=self.name, kind=kind)
