"""torch's ``FSDPModule`` as a base of fsdp_lite's, so that client code sees our modules as FSDP.

Accelerate, HF Trainer, Lightning Fabric, torchtitan and torch's pipelining decide what to do with a
model by ``isinstance(module, FSDPModule)`` with torch's class. fsdp_lite's ``FSDPModule``
(fsdp2.py) derives from torch's class for that check alone: it defines every method torch's class
defines, so none of torch's FSDP code runs on our modules (tests/test_interop.py checks both). This
is the one file in fsdp_lite that names torch's FSDP, and it imports only the class.

One client reads further: torch's pipelining, having seen an ``FSDPModule``, ends a step's backward
with ``fully_shard.state(module)`` and calls three methods on what that returns (stage.py's
``perform_reduce_grad``). ``register_state`` files fsdp_lite's own object where that lookup looks,
found through the lookup function itself, so the calls reach fsdp_lite's code
(fsdp2._PipelineView); nothing of torch's FSDP state is built or run.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

__all__ = ["TorchFSDPModule", "register_state", "registered_state"]


def _state_slot() -> tuple[str, Any] | None:
    """(module attribute, key) where torch's ``fully_shard.state(module)`` finds a state: what its
    ``module.__dict__[STATE_KEY].get(func)`` reads. None where this torch looks elsewhere."""
    # torch's fully_shard is defined beside its FSDPModule class; only its lookup is read here.
    torch_fully_shard = getattr(sys.modules.get(TorchFSDPModule.__module__), "fully_shard", None)
    lookup = getattr(torch_fully_shard, "state", None)
    if lookup is None:
        return None
    names = inspect.getclosurevars(lookup)
    attr, key = names.globals.get("STATE_KEY"), names.nonlocals.get("func")
    return (attr, key) if isinstance(attr, str) and key is not None else None


_SLOT = _state_slot()


def register_state(module: nn.Module, state: object) -> None:
    """Make torch's ``fully_shard.state(module)`` return ``state`` (an fsdp_lite object)."""
    if _SLOT is not None:
        attr, key = _SLOT
        module.__dict__.setdefault(attr, {})[key] = state


def registered_state(module: nn.Module) -> object | None:
    """What ``register_state`` filed for ``module`` (what torch's lookup returns), or None."""
    if _SLOT is None:
        return None
    attr, key = _SLOT
    return module.__dict__.get(attr, {}).get(key)
