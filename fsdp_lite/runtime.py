"""The schedule of a training step: which unit unshards, reshards and reduces when.

One ``StepRuntime`` serves a root wrapper and all units under it. The wrapper's forward calls
``pre_forward`` and ``post_forward``; ``post_forward`` registers ``pre_backward`` on the outputs; the
grad hooks of each parameter call ``on_grad_ready``, which runs ``post_backward`` once a unit's
gradients are all in; the autograd engine's final callback runs ``finalize_backward``. The units do
the work (unit.py); this file only orders it.

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

Note [Frozen parameters in a unit]: once every trainable parameter of a unit has its gradient,
autograd may still read the unit's frozen ones: a frozen LayerNorm weight scales the gradient of
the LayerNorm's input, computed after every gradient of the weights behind it. A unit holding
frozen unsharded params therefore reduces at the gradient count but frees its unsharded params
only once the gradients of its forward inputs are in (an identity autograd Function on the
inputs, as FSDP2's post-backward), or at ``finalize_backward`` when no input needs a gradient.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_lite.api import BackwardPrefetch
from fsdp_lite.unit import ShardedUnit, TrainingState

__all__ = ["StepRuntime"]


class StepRuntime:
    """Per-step scheduling for one root and its units; built at the root's first forward."""

    def __init__(self, units: list[ShardedUnit]) -> None:
        self.units = units  # children before parents: the order ranks agree on at finalize
        self.forward_order: list[ShardedUnit] = []  # pre_forward order of the first step
        self._position: dict[ShardedUnit, int] = {}  # unit -> index in forward_order, for the hooks
        # post_forward order of the first step; backward needs units in its reverse (Note
        # [Backward order]).
        self.post_forward_order: list[ShardedUnit] = []
        self._post_position: dict[ShardedUnit, int] = {}
        self._recording_order = True
        self._callback_queued = False
        self._reducing: ShardedUnit | None = None  # the latest unit whose reduction is in flight
        self.sync_grads = True  # False inside no_sync(): keep unsharded grads, skip reduction

    # ---- forward -----------------------------------------------------------------------------

    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Unshard ``unit`` for its forward (prefetching the next); returns the inputs to use."""
        if unit.training_state == TrainingState.BACKWARD:
            # Activation checkpointing recomputes this unit's forward inside its backward: the
            # params are (or must again be) unsharded; nothing else about the step changes.
            unit.unshard("backward")
            unit.wait_for_unshard()
            return args, kwargs
        unit.assert_state(TrainingState.IDLE)
        self._record_order(self.forward_order, self._position, unit)
        unit.training_state = TrainingState.FORWARD
        unit.unshard("forward")
        unit.wait_for_unshard()
        if unit.forward_prefetch:
            self._prefetch(unit, step=+1, phase="forward")
        if unit.trace is not None:
            unit.trace.compute(unit, "forward", "begin")
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
        unit.input_grads_pending += 1
        return tree_unflatten(flat, spec)

    def _after_input_grads(self, unit: ShardedUnit) -> None:
        unit.input_grads_pending -= 1
        if unit.input_grads_pending == 0 and (unit.ran_post_backward or not unit.trainable):
            unit.reshard()

    def post_forward(self, unit: ShardedUnit, output):
        if unit.training_state == TrainingState.BACKWARD:
            return output  # a recompute (see pre_forward): backward goes on with these params
        unit.assert_state(TrainingState.FORWARD)
        if unit.trace is not None:
            unit.trace.compute(unit, "forward", "end")
        self._record_order(self.post_forward_order, self._post_position, unit)
        grad_enabled = torch.is_grad_enabled()
        # The root's params are needed first thing in backward, so it keeps them (as torch does).
        if not grad_enabled or (unit.rules.reshard_after_forward and not unit.is_root):
            unit.reshard()
        unit.training_state = TrainingState.IDLE
        if grad_enabled:
            self._register_pre_backward(unit, output)
        return output

    # ---- backward ----------------------------------------------------------------------------

    def _register_pre_backward(self, unit: ShardedUnit, output) -> None:
        tensors, _ = tree_flatten(output)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, unit=unit: self.pre_backward(unit))

    def pre_backward(self, unit: ShardedUnit) -> None:
        if unit.ran_pre_backward:  # another output of the same unit already triggered it
            return
        unit.assert_state(TrainingState.IDLE)
        unit.ran_pre_backward = True
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self.finalize_backward)
            self._callback_queued = True
        unit.training_state = TrainingState.BACKWARD
        unit.unshard("backward")
        unit.wait_for_unshard()
        if unit.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(unit, step=-1, phase="backward")
        if unit.trace is not None:
            unit.trace.compute(unit, "backward", "begin")

    def on_grad_ready(self, unit: ShardedUnit) -> None:
        """Called once per trainable parameter per backward; see Note [Post-backward by gradient count]."""
        unit.num_grads_ready += 1
        if unit.num_grads_ready == len(unit.trainable):
            self.post_backward(unit)

    def post_backward(self, unit: ShardedUnit) -> None:
        if unit.trace is not None:
            unit.trace.compute(unit, "backward", "end")
        if unit.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            self._prefetch(unit, step=-1, phase="backward")
        if self.sync_grads and unit.trainable:
            # A reduction in flight holds its unit's whole gradient buffer until it lands. The
            # previous one has had this unit's whole backward to finish: land it before packing
            # this one, so one such buffer is alive at a time, not the whole model's.
            if self._reducing is not None:
                self._reducing.finish_reduce()
            unit.reduce_grads()
            self._reducing = unit
        unit.ran_post_backward = True
        if unit.input_grads_pending == 0:  # else autograd may still read frozen params (Note
            unit.reshard()  # [Frozen parameters in a unit]); _after_input_grads reshards
        unit.training_state = TrainingState.IDLE

    def finalize_backward(self) -> None:
        """End of backward: reduce what the hooks could not, land every gradient, reshard all."""
        for unit in self.units:
            needs_reduce = unit.ran_pre_backward or unit.num_grads_ready > 0
            if self.sync_grads and needs_reduce and not unit.reduced:
                unit.reduce_grads()
        for unit in self.units:
            unit.finish_reduce()
            unit.reshard()
            unit.reset_backward()
        self._reducing = None
        self._callback_queued = False
        self._recording_order = False

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
        or in backward order, the reverse of post-forward order (step -1)."""
        order, position = (
            (self.forward_order, self._position)
            if phase == "forward"
            else (self.post_forward_order, self._post_position)
        )
        if unit not in position:
            return
        index = position[unit] + step
        if 0 <= index < len(order):
            target = order[index]
            if phase == "backward" and target.ran_pre_backward:
                return  # its backward already ran (BACKWARD_POST from the root, at the end)
            if target.needs_all_gather():
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
