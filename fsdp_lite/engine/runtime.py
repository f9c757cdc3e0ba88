"""The schedule of a training step: which unit unshards, reshards and reduces when.

One ``StepRuntime`` serves a root wrapper and all units under it; ``lazy_init`` builds it when the
root first runs (root election, unit names, side streams). The wrapper's forward calls
``pre_forward`` and ``post_forward``; ``post_forward`` registers ``pre_backward`` on the outputs; the
grad hooks ``register_grad_hooks`` puts on each parameter call ``on_grad_ready``, which runs
``post_backward`` once a unit's gradients are all in; the autograd engine's final callback runs
``finalize_backward``. ``check_apply`` / ``take_back_after_apply`` keep the hooks and shards right
across ``nn.Module._apply``. The units do the work (unit.py); this file only orders it, and knows
no front: a wrapper of either is a module that owns a unit (unit.owns_unit).

Note [Post-backward by gradient count]: a unit reduces as soon as every trainable parameter's
gradient has been accumulated (``register_post_accumulate_grad_hook`` fires once per backward even
for a parameter used twice, because autograd sums into one AccumulateGrad call). Parameters unused in
this forward never fire; ``finalize_backward`` reduces their units at the end, in unit order, so
every rank issues the same collectives in the same order.

Note [Backward order]: backward needs units in the reverse of the order their forwards *ended*,
not began. A root, or any parent unit, begins its forward first but ends it last, so it is first
in backward; then comes the last child. Reverse pre-forward order would put the parent last, and
the unit after it in backward (the last block, under a root) would never be prefetched: its
all-gather would block. Torch FSDP2 prefetches the same way.

Note [Forward states]: a unit's forward begins in its pre-forward and ends in its post-forward,
with two exceptions, both as in torch FSDP2. A ``fully_shard([a, b])`` group whose pass ran only
some of its modules is left in FORWARD (torchtitan's chunked loss: the model's forward runs the final
norm, and the head runs later, once per chunk, with a backward each): the root's post-forward
finishes such units (reshards them, hooks their backward on the root's output), and a later partial
pass outside the root's forward hooks its backward on its own output, and that backward begins from
FORWARD. Every backward ends in ``finalize_backward``, which reduces what it touched, once. And a
step that raised inside a forward or backward leaves units in FORWARD or BACKWARD with collectives
in flight: the next root forward (or an explicit ``reset_iter_state``) lands them and puts every
unit back at rest, dropping that step's unreduced gradients.

Note [Frozen parameters in a unit]: once every trainable parameter of a unit has its gradient,
autograd may still read the unit's frozen ones: a frozen LayerNorm weight scales the gradient of
the LayerNorm's input, computed after every gradient of the weights behind it. A unit holding
frozen unsharded params therefore reduces at the gradient count but frees its unsharded params
only once the gradients of its forward inputs are in (an identity autograd Function on the
inputs, as FSDP2's post-backward), or at ``finalize_backward`` when no input needs a gradient: a
root's tokens carry none, yet the gradients of the nested units inside it still flow back through
its ops, and so through its frozen weights (found by tests/test_properties.py).

Note [Replaced parameters]: code that loads weights into an already wrapped model may replace a
parameter with ``setattr(module, name, nn.Parameter(new))`` instead of copying into it
(transformers' load-time sharding does, after ``fully_shard`` and before the first forward). The
modules then hold a parameter the unit does not know, while the collectives read the old shard
buffer. So before a unit gathers (its pre-forward, a prefetch, ``to_rest``) it looks at what its
modules hold (the root's pre-forward looks at every unit's, so that a refusal comes before the
step's first collective): a replacement laid out as the parameter (param.py ``_check_replacement``: a DTensor
on the same mesh and placements for a sharded one) becomes ``sharded_param``, its values copied
into the shard buffer, exactly as torch FSDP2's lazy init takes one (``reset_sharded_param``);
anything else raises, naming the parameter and the layout it needs, before any collective. torch
takes a replacement only at its lazy init and silently puts the old parameter back after a later
one; fsdp_lite takes it at any forward, and after the unit's first forward it logs a warning: an
optimizer built before still holds the old parameter, which no longer trains.

Note [requires_grad after wrapping]: freezing (or unfreezing) a wrapped parameter sets
``requires_grad`` on its ``sharded_param``, the parameter the model shows; forward runs on another
tensor (the unsharded copy), whose flag autograd reads. So where a unit looks for replaced
parameters it also copies each ``sharded_param``'s flag onto the copy and recounts its trainable
params (``ShardedUnit.follow_requires_grad``): a frozen parameter gets no gradient and is not
reduced or stepped; one trained again gets its gradient hook. torch FSDP1 follows the flag too: it
recomputes its flat parameter's ``requires_grad`` before each forward and sets a frozen parameter's
gradient to None after backward (its ``FlatParamHandle._reset_flat_param_grad_info_if_needed``
and ``_use_sharded_grad_views``); torch's test_freezing_weights freezes after wrapping. As in torch, every rank must set the same
flags: the reduction of a unit is as large as its trainable params.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_lite.api import BackwardPrefetch
from fsdp_lite.engine import collectives
from fsdp_lite.engine.param import Param
from fsdp_lite.engine.streams import SideStreams, side_streams
from fsdp_lite.engine.structures import grad_tensors
from fsdp_lite.engine.unit import (
    PendingReduce,
    ShardedState,
    ShardedUnit,
    TrainingState,
    owns_unit,
    unit_owners,
)
from fsdp_lite.names import clean_name

logger = logging.getLogger("fsdp_lite")

__all__ = [
    "StepRuntime",
    "eager",
    "check_apply",
    "lazy_init",
    "prepare_apply",
    "register_grad_hooks",
    "take_back_after_apply",
    "take_replaced_params",
    "to_rest",
]


def eager(fn: Callable) -> Callable:
    """Run ``fn`` outside torch.compile's graphs (dynamo leaves it and everything it calls alone).

    Note [Hooks under torch.compile]: the stages of a step swap module parameters, resize storage
    and issue collectives; traced, they break graphs or fail to lower (inductor's "TODO: dynamic
    shapes"). So a compiled module's forward is one graph between two eager hooks, as torch FSDP2
    does with its own hooks. Each unit boundary costs one graph break on each side.

    torch's lazy form of ``torch._dynamo.disable`` (torch.optim's): dynamo is imported at the
    first call, not with fsdp_lite, whose import it made ~0.7 s slower than native FSDP's. dynamo
    never traces into the wrapper itself (it lives in torch), so a compiled caller breaks its graph
    there just as at a ``disable``'d function (tests/test_compile.py counts the breaks).
    """
    return torch._disable_dynamo(fn, recursive=True)


@eager
def lazy_init(root: nn.Module) -> StepRuntime:
    """The runtime of ``root``'s unit and every unit under it, built the first time one runs.

    The first wrapper to run is the root: it keeps its params after forward, names the units by
    their path from it, and shares one runtime and one pair of side streams with all of them.
    """
    if root._unit.runtime is not None:
        return root._unit.runtime
    owners = [(name, m) for name, m in root.named_modules() if owns_unit(m)]
    for _, owner in owners:
        group = owner._unit.group
        if collectives.is_stand_in(group):
            raise RuntimeError(
                f"this model was wrapped on process_group {type(group).__name__}, a stand-in "
                "with rank() and size() but no collectives: it can be inspected, not run "
                "(forward, state dicts, summon_full_params, clip_grad_norm_); wrap it on a "
                "torch.distributed ProcessGroup to run it"
            )
    # A unit owned by several modules (FSDP2's list groups) is named by the first of them, in
    # pre-order; units are listed children before parents, each once.
    names = {owner._unit: clean_name(name) for name, owner in reversed(owners)}
    units = list(dict.fromkeys(owner._unit for _, owner in reversed(owners)))
    runtime = StepRuntime(units, root._unit, side_streams(root._unit.compute_device))
    for unit in units:
        unit.attach(runtime, names[unit])
    return runtime


def register_grad_hooks(unit: ShardedUnit, params: Sequence[Param]) -> None:
    """Count each trainable param's gradient where autograd leaves it (Note [Post-backward by
    gradient count]); a hook before the runtime exists does nothing."""
    for p in params:
        # Autograd leaves the gradient on the copy forward ran on; one hook per copy (a param
        # frozen and trained again keeps the hook it had).
        if p.requires_grad and p.hooked_copy is not p.unsharded_param:
            p.hooked_copy = p.unsharded_param
            # Weakly: torch keeps the hook where Python's collector cannot see the cycle back
            # to the unit, so a strong reference would keep every dropped model alive.
            hook = functools.partial(_grad_ready, weakref.ref(unit))
            p.unsharded_param.register_post_accumulate_grad_hook(hook)


def _grad_ready(unit_ref: weakref.ref[ShardedUnit], _param: torch.Tensor) -> None:
    unit = unit_ref()
    if unit is not None and unit.runtime is not None:
        unit.runtime.on_grad_ready(unit)


def take_replaced_params(unit: ShardedUnit, warn: bool = False) -> None:
    """Shard the parameters replaced in the unit's modules since it last looked, or raise before
    any collective (Note [Replaced parameters]); ``warn``: log it (an optimizer may hold the old)."""
    # requires_grad set after wrapping (Note [requires_grad after wrapping]); the hooks count
    # the gradients of the params that train from now on.
    register_grad_hooks(unit, unit.follow_requires_grad())
    replaced = unit.replaced_params()
    if not replaced:
        return
    if warn:
        logger.warning(
            "fsdp_lite: %s replaced since the last forward; the new parameters train from now "
            "on (an optimizer built before holds the old ones)",
            ", ".join(repr(unit.qualified(p)) for p, _ in replaced),
        )
    before = [p.unsharded_param for p, _ in replaced]
    unit.take_replaced(replaced)
    # A new copy forward runs on (NO_SHARD runs on the replacement itself, or a new dtype's
    # copy) needs the gradient hook the old one had.
    register_grad_hooks(
        unit, [p for (p, _), old in zip(replaced, before) if p.unsharded_param is not old]
    )


def prepare_apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Before ``nn.Module._apply`` on a wrapper of either front: check every unit in its tree
    first (so that a refusal leaves the model as it was), then point each at its shards."""
    owners = unit_owners(module)
    for owner in owners:
        check_apply(owner._unit, fn)
    for owner in owners:
        to_rest(owner)


def to_rest(wrapper: nn.Module) -> None:
    """Make the module attributes of this wrapper's unit hold ``sharded_param`` again.

    Between steps they already do, except the root's after a forward without backward (it keeps
    its unsharded params for the backward that never came); the next backward would gather again.
    """
    unit: ShardedUnit = wrapper._unit
    if unit.training_state != TrainingState.IDLE:
        raise RuntimeError(
            f"unit {unit.name or '<root>'!r}: state dicts are taken between steps, not inside "
            f"forward, backward or summon_full_params (state {unit.training_state.name})"
        )
    take_replaced_params(unit)
    if unit.state == ShardedState.UNSHARDED:
        unit.reshard()


def check_apply(unit: ShardedUnit, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Refuse an ``nn.Module._apply`` the unit cannot take, judged by its effect on an empty
    tensor, before anything changes."""
    if unit.training_state != TrainingState.IDLE:
        raise RuntimeError(
            f"unit {unit.name or '<root>'!r}: .to()/.double()/... (nn.Module._apply) on a wrapped "
            f"model runs between steps, not in state {unit.training_state.name}"
        )
    for p in unit.params[:1]:
        before = p.sharded_flat
        after = fn(torch.empty(0, dtype=before.dtype, device=before.device))
        here = {_device_key(before.device), _device_key(unit.compute_device)}
        if _device_key(after.device) not in here:
            raise RuntimeError(
                f"unit {unit.name or '<root>'!r}: moving a wrapped model's shards from "
                f"{before.device} to {after.device} is not supported; move the model before "
                "wrapping it, or pass device_id"
            )
        if after.dtype != before.dtype and p.disk_files is not None:
            raise RuntimeError(
                f"unit {unit.name or '<root>'!r}: changing the dtype of disk-offloaded shards "
                f"({before.dtype} -> {after.dtype}) is not supported; change it before wrapping"
            )


def _device_key(device: torch.device) -> tuple[str, int | None]:
    # "cpu" and "cpu:0" are one device (tensors report "cpu" for both); "cuda" means the current.
    if device.type == "cpu":
        return ("cpu", None)
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return (device.type, index)


def take_back_after_apply(unit: ShardedUnit, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """After ``nn.Module._apply`` changed the unit's modules: shards back into their buffers
    (param.reset_sharded_param), hooks on new unsharded params, buffers in their dtypes."""
    precision = unit.precision
    replaced = [p for p in unit.params if p.reset_sharded_param(precision.param_dtype)]
    register_grad_hooks(unit, replaced)
    unit.after_apply(fn)


@dataclass
class _BackwardRecord:
    """What one backward has done with one unit; the runtime's, dropped at the end of backward."""

    num_grads_ready: int = 0  # trainable params whose gradient is in (Note [Post-backward by ...])
    ran_pre_backward: bool = False
    ran_post_backward: bool = False
    input_grads_pending: int = 0  # forwards whose inputs' gradients are not in yet
    inputs_hooked: bool = False  # some forward's inputs carry a gradient hook this backward
    reduced: bool = False  # its reduction was started


class StepRuntime:
    """Per-step scheduling for one root and its units; built at the root's first forward. It
    owns what happens in a step: the order units ran in, the per-backward records, the gradient
    reductions in flight, and the step counter."""

    def __init__(
        self, units: list[ShardedUnit], root: ShardedUnit, streams: SideStreams | None
    ) -> None:
        self.units = units  # children before parents: the order ranks agree on at finalize
        self.root = root
        self.streams = streams  # on accelerators: the all-gather and reduce side streams
        self.step = 1  # the training step (1-based) a collective belongs to, for error messages
        self.forward_order: list[ShardedUnit] = []  # pre_forward order of the first step
        self._position: dict[ShardedUnit, int] = {}  # unit -> index in forward_order, for the hooks
        # post_forward order of the first step; backward needs units in its reverse (Note
        # [Backward order]).
        self.post_forward_order: list[ShardedUnit] = []
        self._post_position: dict[ShardedUnit, int] = {}
        self._recording_order = True
        self._callback_queued = False
        self._backward: dict[ShardedUnit, _BackwardRecord] = {}  # this backward's, per unit
        # Reductions in flight, oldest first: each advances at the next landing (post_backward
        # of another unit, or finalize), so it overlaps that unit's gradient computation.
        self._in_flight: list[PendingReduce] = []
        self._keep_in_flight: int | None = None  # this backward's max reductions in flight - 1
        # Units whose backwards left gradients unreduced (no gradient sync), for
        # reduce_after_backward.
        self._unreduced: set[ShardedUnit] = set()
        # Units whose forward ran with grad and whose backward has not run since: a backward
        # that skips them (a chunked loss's head) leaves their unsynced gradients alone.
        self._backward_to_come: set[ShardedUnit] = set()

    def record(self, unit: ShardedUnit) -> _BackwardRecord:
        """``unit``'s record of the current backward (a fresh one before it begins)."""
        rec = self._backward.get(unit)
        if rec is None:
            rec = self._backward[unit] = _BackwardRecord()
        return rec

    def buffers_in_flight(self, unit: ShardedUnit) -> list[torch.Tensor]:
        """The buffers of ``unit``'s reductions in flight, for the trace's memory accounting."""
        return [
            t
            for pending in self._in_flight
            if pending.unit is unit
            for t in (pending.result.input, pending.result.output)
        ]

    # ---- forward -----------------------------------------------------------------------------

    @eager
    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Unshard ``unit`` for its forward (prefetching the next); returns the inputs to use."""
        if unit.training_state == TrainingState.BACKWARD:
            # Activation checkpointing recomputes this unit's forward inside its backward: the
            # params are (or must again be) unsharded; nothing else about the step changes.
            unit.unshard("backward")
            unit.wait_for_unshard()
            return args, kwargs
        if unit.is_root and unit.training_state != TrainingState.IDLE:
            # The last step stopped inside a forward or backward (an exception the loop caught):
            # start this one from a clean state, as torch FSDP2 goes on (Note [Forward states]).
            logger.warning(
                "fsdp_lite: the root's forward begins in state %s, left by a step that raised; "
                "resetting every unit (reset_iter_state) and dropping that step's gradients",
                unit.training_state.name,
            )
            self.reset_iter_state()
        unit.assert_state(TrainingState.IDLE)
        # The root looks at every unit before its own gather, so that a refusal comes before
        # any collective (Note [Replaced parameters]); a unit run on its own looks at itself.
        for other in self.units if unit.is_root else (unit,):
            if other.training_state == TrainingState.IDLE:
                take_replaced_params(other, warn=other in self._position)
        self._record_order(self.forward_order, self._position, unit)
        event = unit.settings.take_post_optim_event()
        if event is not None:
            # Queue the gather after the optimizer step that recorded it, not after everything.
            event.wait()
        unit.enter(TrainingState.FORWARD)
        unit.unshard("forward")
        unit.wait_for_unshard()
        if unit.settings.forward_prefetch or unit.settings.forward_prefetch_units is not None:
            self._prefetch(unit, step=+1, phase="forward")
        unit.computes("forward", "begin")
        if unit.keeps_frozen_unsharded and torch.is_grad_enabled():
            args, kwargs = self._hook_input_grads(unit, args, kwargs)
        return args, kwargs

    def _hook_input_grads(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs needing a gradient through ``_InputGradsReady`` (Note [Frozen
        parameters in a unit])."""
        flat, spec = tree_flatten((args, kwargs))
        slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return args, kwargs
        done = functools.partial(self._after_input_grads, unit)
        for i, t in zip(slots, _InputGradsReady.apply(done, *(flat[i] for i in slots))):
            flat[i] = t
        rec = self.record(unit)
        rec.input_grads_pending += 1
        rec.inputs_hooked = True
        return tree_unflatten(flat, spec)

    def _after_input_grads(self, unit: ShardedUnit) -> None:
        rec = self.record(unit)
        rec.input_grads_pending -= 1
        if rec.input_grads_pending == 0 and (rec.ran_post_backward or not unit.trainable):
            unit.reshard_after_backward()

    @eager
    def post_forward(self, unit: ShardedUnit, output):
        if unit.training_state == TrainingState.BACKWARD:
            return output  # a recompute (see pre_forward): backward goes on with these params
        unit.assert_state(TrainingState.FORWARD)
        self._finish_forward(unit, output)
        if unit.is_root:
            # Units whose forward is left open (a fully_shard([a, b]) group only some of whose
            # modules ran) finish with the root's, their backward hooked on its output, as torch
            # FSDP2 does; an all-gather prefetched for a unit whose forward did not come lands:
            # nothing stays in flight past the root's forward (Note [Forward states]).
            for other in self.units:
                if other is not unit and other.training_state == TrainingState.FORWARD:
                    self._finish_forward(other, output)
                other.land_unused_prefetch()
        return output

    def _finish_forward(self, unit: ShardedUnit, output) -> None:
        """What ends a unit's forward: reshard unless kept, IDLE, backward hooked on ``output``."""
        unit.computes("forward", "end")
        self._record_order(self.post_forward_order, self._post_position, unit)
        grad_enabled = torch.is_grad_enabled()
        # The root's params are needed first thing in backward, so it keeps them (as torch does).
        keeps = unit.is_root and unit.settings.root_keeps_params
        if not grad_enabled or (unit.rules.reshard_after_forward and not keeps):
            unit.reshard(after_forward=grad_enabled)
        unit.enter(TrainingState.IDLE)
        if grad_enabled:
            self._backward_to_come.add(unit)
            self.register_pre_backward(unit, output)

    # ---- backward ----------------------------------------------------------------------------

    def register_pre_backward(self, unit: ShardedUnit, output) -> None:
        """Run ``pre_backward(unit)`` when the first gradient of ``output``'s tensors arrives."""
        for t in grad_tensors(output):  # dataclasses too, as torch FSDP2 (structures.py)
            t.register_hook(lambda grad, unit=unit: self.pre_backward(unit))

    def pre_backward(self, unit: ShardedUnit) -> None:
        rec = self.record(unit)
        if rec.ran_pre_backward:  # another output of the same unit already triggered it
            return
        # FORWARD: a group only some of whose modules ran, called outside the root's forward
        # (a chunked loss's head): its backward begins from there (Note [Forward states]).
        unit.assert_state(TrainingState.IDLE, TrainingState.FORWARD)
        rec.ran_pre_backward = True
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self.finalize_backward)
            self._callback_queued = True
        unit.enter(TrainingState.BACKWARD)
        settings = unit.settings
        if settings.unshard_in_backward:  # FSDP2's set_unshard_in_backward(False): an embedding
            unit.unshard("backward")
            unit.wait_for_unshard()
        if (
            settings.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
            or settings.backward_prefetch_units
        ):
            self._prefetch(unit, step=-1, phase="backward")
        unit.computes("backward", "begin")

    def on_grad_ready(self, unit: ShardedUnit) -> None:
        """Called once per trainable parameter per backward; see Note [Post-backward by gradient count]."""
        rec = self.record(unit)
        rec.num_grads_ready += 1
        if rec.num_grads_ready == len(unit.trainable):
            self.post_backward(unit)

    def post_backward(self, unit: ShardedUnit) -> None:
        rec = self.record(unit)
        unit.computes("backward", "end")
        if unit.settings.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            self._prefetch(unit, step=-1, phase="backward")
        if unit.settings.requires_gradient_sync and unit.trainable:
            self._reduce(unit)
        rec.ran_post_backward = True
        # Frozen unsharded params (Note [Frozen parameters in a unit]): free them once the
        # inputs' gradients are in (_after_input_grads), or, if no input carries a gradient, only
        # at the end of backward: nested units' gradients still flow through this unit's ops.
        waits = rec.input_grads_pending > 0 or (
            unit.keeps_frozen_unsharded and not rec.inputs_hooked
        )
        if not waits:
            unit.reshard_after_backward()
        unit.enter(TrainingState.IDLE)

    def _reduce(self, unit: ShardedUnit) -> None:
        """Start ``unit``'s gradient reduction, after advancing those in flight.

        A reduction in flight holds its unit's whole gradient buffer until it lands. The previous
        one has had this unit's whole backward to finish: advance it before packing this one, so
        one such buffer is alive at a time, not the whole model's; or, with
        ``UnitSettings.reductions_in_flight`` at K, leave the newest K - 1 in flight (more memory,
        a collective that may take longer than a unit's backward no longer waited on there).
        """
        if self._keep_in_flight is None:  # once per backward: the units' settings are fixed
            self._keep_in_flight = max(u.settings.reductions_in_flight for u in self.units) - 1
        self._advance_in_flight(self._keep_in_flight)
        self._start_reduce(unit)

    def _start_reduce(self, unit: ShardedUnit) -> None:
        pending = unit.start_reduce()
        if pending is not None:
            self._in_flight.append(pending)
        self.record(unit).reduced = True
        self._unreduced.discard(unit)

    def _advance_in_flight(self, keep: int = 0) -> None:
        """Advance every reduction in flight one collective, oldest first (unit.advance_reduce),
        but the newest ``keep``, which stay as they are."""
        cut = max(len(self._in_flight) - keep, 0)
        in_flight, kept = self._in_flight[:cut], self._in_flight[cut:]
        self._in_flight = []
        for pending in in_flight:
            following = pending.unit.advance_reduce(pending)
            if following is not None:
                self._in_flight.append(following)
        self._in_flight.extend(kept)

    def finalize_backward(self) -> None:
        """End of backward: reduce what the hooks could not, land every gradient, reshard all."""
        for unit in self.units:
            rec = self.record(unit)
            needs_reduce = rec.ran_pre_backward or rec.num_grads_ready > 0
            if needs_reduce:
                self._backward_to_come.discard(unit)
            # A unit this backward did not reach, and whose forward has not run since its last
            # backward, still reduces what backwards without sync left it, as torch FSDP2's final
            # callback does: else the step would miss it. One whose backward is still to come (a
            # chunked loss's head backward first) waits for it, as torch's does.
            unsynced = unit in self._unreduced and unit not in self._backward_to_come
            if (
                unit.settings.requires_gradient_sync
                and (needs_reduce or unsynced)
                and not rec.reduced
            ):
                self._start_reduce(unit)
            elif needs_reduce and unit.trainable and not unit.settings.requires_gradient_sync:
                unit.keep_unsynced_grads()
                self._unreduced.add(unit)
        while self._in_flight:
            self._advance_in_flight()
        for unit in self.units:
            unit.reshard_after_backward()
            unit.end_of_backward()
        self._keep_in_flight = None
        self._backward.clear()
        self._callback_queued = False
        if all(unit.settings.is_last_backward for unit in self.units):
            self._recording_order = False
            self.step += 1

    def reduce_after_backward(self, unit: ShardedUnit) -> None:
        """Reduce the gradients ``unit``'s backwards left unreduced, outside autograd; a no-op
        for a unit with none (every backward synced). torch's pipelining calls this (as FSDP2's
        ``post_backward``) once a step's microbatch backwards ran without gradient sync;
        ``finalize_backward`` lands the reductions. Ranks call it for units in the same order."""
        if (
            unit.settings.requires_gradient_sync
            and unit in self._unreduced
            and not self.record(unit).reduced
        ):
            self._reduce(unit)
        unit.reshard_after_backward()

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: land every collective in flight, then put
        every unit back at rest (sharded, IDLE) and forget this step's backward; the gradients
        the failed step had not landed are dropped, as torch FSDP2's ``reset_iter_state`` does.
        No collective is issued, so ranks that failed alike stay in step."""
        in_flight, self._in_flight = self._in_flight, []
        self._keep_in_flight = None
        for pending in in_flight:
            pending.unit.drop_reduce(pending)
        for unit in self.units:
            unit.reset()
        self._backward.clear()
        self._unreduced.clear()
        self._backward_to_come.clear()
        self._callback_queued = False

    # ---- prefetch ----------------------------------------------------------------------------

    def _record_order(
        self, order: list[ShardedUnit], position: dict[ShardedUnit, int], unit: ShardedUnit
    ) -> None:
        """On the first step, append ``unit`` to ``order`` the first time it gets there."""
        if self._recording_order and unit not in position:
            position[unit] = len(order)
            order.append(unit)

    def _prefetch(self, unit: ShardedUnit, step: int, phase: str) -> None:
        """Start the all-gather of the unit that runs next: the next in forward order (step +1),
        or in backward order, the reverse of post-forward order (step -1); or of the units set
        explicitly (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch)."""
        settings = unit.settings
        explicit = settings.forward_prefetch_units if step > 0 else settings.backward_prefetch_units
        if explicit is not None:
            targets = explicit
        else:
            order, position = (
                (self.forward_order, self._position)
                if phase == "forward"
                else (self.post_forward_order, self._post_position)
            )
            index = position[unit] + step if unit in position else -1
            targets = [order[index]] if 0 <= index < len(order) else []
        for target in targets:
            if phase == "backward" and (
                self.record(target).ran_pre_backward or not target.settings.unshard_in_backward
            ):
                continue  # its backward already ran (BACKWARD_POST from the root, at the end)
            if phase == "forward" and target.training_state == TrainingState.IDLE:
                # before its gather reads the shard buffer (Note [Replaced parameters])
                take_replaced_params(target, warn=target in self._position)
            if target.needs_unshard():
                target.unshard(phase, async_op=True)


class _InputGradsReady(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once autograd has their gradients,
    that is, after everything in the unit's backward (Note [Frozen parameters in a unit])."""

    @staticmethod
    def forward(ctx, done, *inputs: torch.Tensor):
        ctx.done = done
        return tuple(t.view_as(t) for t in inputs)  # views: autograd refuses to return an input

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.done()
        return (None, *grads)
