"""Records the collectives each unit issues, so tests and people can see the schedule.

``record_collectives(model)`` attaches one ``CollectiveTrace`` to every unit of a wrapped model for
the duration of a ``with`` block; units append a ``CollectiveRecord`` each time they start a
collective. Timing and memory records are planned (issue 7).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["CollectiveRecord", "CollectiveTrace", "record_collectives"]


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    unit: str  # the unit's module path from the root, "" for the root
    phase: str  # "forward" | "backward" | "summon" | ...
    dtype: torch.dtype
    numel: int  # of this rank's input

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class CollectiveTrace:
    records: list[CollectiveRecord] = field(default_factory=list)

    def record(self, kind: str, unit: str, phase: str, tensor: torch.Tensor) -> None:
        self.records.append(CollectiveRecord(kind, unit, phase, tensor.dtype, tensor.numel()))

    def count(self, kind: str, phase: str | None = None, unit: str | None = None) -> int:
        return sum(
            r.kind == kind and phase in (None, r.phase) and unit in (None, r.unit)
            for r in self.records
        )

    def clear(self) -> None:
        self.records.clear()


@contextlib.contextmanager
def record_collectives(model: nn.Module) -> Iterator[CollectiveTrace]:
    """Record every collective the units of ``model`` issue inside the block."""
    from fsdp_lite.module import FullyShardedModule  # module imports trace's users

    trace = CollectiveTrace()
    wrappers = FullyShardedModule.fsdp_modules(model)
    for w in wrappers:
        w._lazy_init()
        w._unit.trace = trace
    try:
        yield trace
    finally:
        for w in wrappers:
            w._unit.trace = None
