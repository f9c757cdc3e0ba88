"""Optimizer steps on the local shards of fsdp_lite's DTensor parameters.

Note [Optimizer steps on local shards]: the user's optimizer holds DTensor parameters (torch
FSDP2's contract: ``model.parameters()``, state dicts and the optimizer state are DTensors). A
torch optimizer stepping them pays DTensor's dispatch on every op of every parameter: measured
(scripts/bench_host_overhead.py, torch's fake process group) it was most of fsdp_lite's host time
per unit, as it is torch FSDP2's. For an optimizer whose update is elementwise (each element's
new value depends only on that element of the parameter, its gradient and its state), the same
ops on each rank's local shard give the same bits: DTensor runs exactly those ops on exactly
those tensors. So, for the duration of ``optimizer.step()`` only, a global step pre-hook puts in
each param group, in place of every fsdp_lite parameter, its local tensor (``detach()``: the same
storage and version counter), with the gradient's local tensor as ``.grad``, and re-keys the
optimizer state to it with local tensors as values; the post-hook puts every parameter back and
re-keys its state, wrapping per-element state the step created as DTensors with the parameter's
spec (what ``zeros_like`` of the DTensor gives), and keeping the DTensors it had. The state's
order is kept, so ``state_dict()`` is laid out as torch's.

Only where that is exact and nobody can tell: no closure is passed (it would run forward and
backward inside the step, on the param groups' parameters), the optimizer's type is exactly one
of torch's elementwise optimizers (``ELEMENTWISE``: no subclass, whose step may read whole tensors), it has
no hooks of its own (they would see local tensors), the group is not ``differentiable``, the
gradient is a DTensor placed as its parameter, and the parameter is not on disk (disk.py's own
step hooks read the DTensors). A step that raises leaves the swap to the next step's pre-hook,
or to the optimizer's ``state_dict`` and ``load_state_dict`` pre-hooks registered at its first
swap, which undo it first.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["ELEMENTWISE", "restore", "track"]

ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)

# id of one of fsdp_lite's DTensor parameters -> its engine Param, weakly. Not the tensor itself:
# a weak reference to a tensor makes torch.utils.swap_tensors (nn.Module._apply on DTensors,
# model.to()) refuse it, and a strong one would keep it alive.
_TRACKED: dict[int, weakref.ref] = {}
_SWAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its swap
_HOOKS: list = []
_GUARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its hooks


def track(owner: Any) -> None:
    """Let optimizers step ``owner.sharded_param`` (an engine Param's parameter, while it is
    that) on its local shard, if it is a DTensor not on disk (disk.py's own step hooks read the
    DTensors)."""
    if not isinstance(owner.sharded_param, DTensor) or owner.disk_files is not None:
        return
    key = id(owner.sharded_param)

    def forget(ref: weakref.ref) -> None:  # the owner is gone; the id may be another's by now
        if _TRACKED.get(key) is ref:
            del _TRACKED[key]

    _TRACKED[key] = weakref.ref(owner, forget)
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _HOOKS.append(register_optimizer_step_post_hook(_after_step))


def _steps_locally(optim: torch.optim.Optimizer) -> bool:
    # torch's per-optimizer hook dicts are private (torch.optim.Optimizer, torch 2.4-2.13);
    # tests/test_local_step.py fails if they move.
    return (
        type(optim) in ELEMENTWISE
        and not optim._optimizer_step_pre_hooks
        and not optim._optimizer_step_post_hooks
    )


def _before_step(optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(optim)  # a step that raised left its swap behind
    if not _TRACKED or not _steps_locally(optim) or _closure(args, kwargs) is not None:
        return
    locals_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, local)
    for group in optim.param_groups:
        if group.get("differentiable"):
            continue
        params = group["params"]
        for i, p in enumerate(params):
            ref = _TRACKED.get(id(p))
            owner = ref() if ref is not None else None
            if owner is None or owner.sharded_param is not p:
                continue
            grad = p.grad
            if grad is not None and (
                not isinstance(grad, DTensor) or grad.placements != p.placements
            ):
                continue
            local = p._local_tensor.detach()
            if grad is not None:
                local.grad = grad._local_tensor
            params[i] = local
            locals_of[id(p)] = (p, local)
    if not locals_of:
        return
    # The DTensors of each parameter's state, kept for the way back.
    kept = {id(local): dict(optim.state[p]) for p, local in locals_of.values() if p in optim.state}
    _rekey(optim, {id(p): local for p, local in locals_of.values()}, _to_local)
    _SWAPPED[optim] = (list(locals_of.values()), kept)
    if optim not in _GUARDED:  # a step that raises must not leave the state keyed by the locals
        _GUARDED[optim] = (
            optim.register_state_dict_pre_hook(restore),
            optim.register_load_state_dict_pre_hook(lambda optim, state_dict: restore(optim)),
        )


def _closure(args: tuple, kwargs: dict) -> Any:
    """``step(closure)``'s closure: it runs forward and backward inside the step (Lightning
    does), reading the param groups' parameters and making their gradients, so a step with one
    keeps the DTensors."""
    # torch hands the hooks step's own args: the optimizer first, then the closure if any.
    return kwargs.get("closure", args[1] if len(args) > 1 else None)


def _after_step(optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(optim)


def restore(optim: torch.optim.Optimizer) -> None:
    """Put back the DTensor parameters ``_before_step`` swapped out of ``optim``, if any."""
    swap = _SWAPPED.pop(optim, None)
    if swap is None:
        return
    swapped, kept = swap
    back = {id(local): p for p, local in swapped}
    for group in optim.param_groups:
        params = group["params"]
        for i, local in enumerate(params):
            p = back.get(id(local))
            if p is not None:
                params[i] = p
    for _, local in swapped:
        local.grad = None
    _rekey(optim, back, lambda p, local, values: _to_dtensor(p, values, kept.get(id(local), {})))


def _rekey(optim: torch.optim.Optimizer, new_key: dict[int, torch.Tensor], convert) -> None:
    """Re-key ``optim.state`` by ``new_key`` (id of an old key -> the new key), each moved entry's
    values through ``convert(new key, old key, values)``, in the state's own order."""
    items = list(optim.state.items())
    optim.state.clear()
    for key, values in items:
        moved = new_key.get(id(key))
        if moved is None:
            optim.state[key] = values
        else:
            optim.state[moved] = convert(moved, key, values)


def _to_local(local: torch.Tensor, param: torch.Tensor, values: dict) -> dict:
    return {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in values.items()}


def _to_dtensor(param: torch.Tensor, values: dict, before: dict) -> dict:
    out = {}
    for k, v in values.items():
        old = before.get(k)
        if isinstance(old, DTensor) and old._local_tensor is v:
            out[k] = old  # updated in place through its local tensor
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == param._local_tensor.shape:
            # Per-element state the step created (or replaced): a DTensor as zeros_like(param)
            # would have made it.
            out[k] = DTensor.from_local(
                v,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            out[k] = v
    return out
