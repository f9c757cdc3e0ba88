"""Casting rules for mixed precision: which dtype each tensor of a step is in.

Sharded params, their grads and the optimizer state stay in full precision. The all-gather and the
unsharded params use ``param_dtype``; gradients are reduced in ``reduce_dtype`` (``param_dtype`` when
only that is set, as in torch FSDP1) and land on the shard in full precision again. This file turns a
``MixedPrecision`` into those dtypes and owns the input and buffer casts; unit.py applies the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_lite.api import MixedPrecision
from fsdp_lite.engine.structures import map_tensors

__all__ = ["Precision", "cast_floating", "cast_buffers", "keep_in_full_precision", "resolve"]


@dataclass(frozen=True)
class Precision:
    """The dtypes one unit computes and communicates in; ``None`` means "as the parameter"."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = False


def resolve(mixed_precision: MixedPrecision | None) -> Precision:
    if mixed_precision is None:
        return Precision()
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = getattr(mixed_precision, field)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(f"MixedPrecision.{field} must be a floating torch.dtype, got {value!r}")
    return Precision(
        param_dtype=mixed_precision.param_dtype,
        # torch FSDP1: reduce in param_dtype unless told otherwise
        reduce_dtype=mixed_precision.reduce_dtype or mixed_precision.param_dtype,
        buffer_dtype=mixed_precision.buffer_dtype,
        keep_low_precision_grads=mixed_precision.keep_low_precision_grads,
        cast_forward_inputs=mixed_precision.cast_forward_inputs,
        cast_root_forward_inputs=mixed_precision.cast_root_forward_inputs,
    )


def cast_floating(dtype: torch.dtype | None, value):
    """Cast every floating-point tensor in a (nested) structure to ``dtype``; others untouched."""
    if dtype is None:
        return value

    def cast(x):
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return map_tensors(cast, value)


def cast_buffers(
    module: nn.Module, dtype: torch.dtype | None, skip: tuple[type, ...], recurse: bool = True
) -> None:
    """Cast the floating buffers of ``module`` (and its tree, but not ``skip`` modules) to ``dtype``."""
    if dtype is None:
        return
    for m in module.modules() if recurse else [module]:
        if isinstance(m, skip):
            continue
        for name, buf in m._buffers.items():
            if buf is not None and torch.is_floating_point(buf):
                m._buffers[name] = buf.to(dtype)


def keep_in_full_precision(module: nn.Module) -> None:
    """Run ``module`` (e.g. BatchNorm) on float32 inputs and hand its output back in the input dtype.

    torch FSDP1 gives modules in ``MixedPrecision._module_classes_to_ignore`` a unit of their own
    without mixed precision and these two hooks, so their neighbours still see low precision.
    """
    seen_dtype: dict[str, torch.dtype] = {}

    def before(mod, args):
        floats = [a for a in args if isinstance(a, torch.Tensor) and torch.is_floating_point(a)]
        if floats:
            seen_dtype["input"] = floats[0].dtype
        return cast_floating(torch.float32, args)

    def after(mod, args, output):
        return cast_floating(seen_dtype.pop("input", None), output)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
