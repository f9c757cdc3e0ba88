"""The tensors inside what modules take and return, found the way torch's FSDP finds them.

Forward inputs are cast and outputs get backward hooks through dicts, lists, tuples, NamedTuples
and dataclasses, nested. torch.utils._pytree sees a dataclass as one leaf, so a module passing a
dataclass of activations to the next would get no pre-backward hook and no cast (torch's
``_apply_to_tensors`` and ``collect_grad_tensors`` walk dataclasses; its tests pin it).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["grad_tensors", "map_tensors"]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor in it; containers rebuilt, others kept.

    Walks what torch's ``_apply_to_tensors`` walks: dataclasses (a copy), OrderedDicts and dicts,
    NamedTuples, lists, tuples and sets; a PackedSequence is kept as it is.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if _is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **{k: map_tensors(fn, v) for k, v in fields.items()})
    if isinstance(value, PackedSequence):
        return value
    if isinstance(value, OrderedDict):
        return type(value)((k, map_tensors(fn, v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if _is_namedtuple(value):
        return type(value)(*(map_tensors(fn, v) for v in value))
    if isinstance(value, (list, tuple, set)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def grad_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` that require a gradient: through dicts, lists, tuples,
    NamedTuples and dataclasses (not sets), as torch FSDP2 collects them for its backward hooks."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif _is_dataclass(item):
            stack.extend(reversed([getattr(item, f.name) for f in dataclasses.fields(item)]))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found
