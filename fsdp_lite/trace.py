"""Records the collectives each unit issues, so tests and people can see the schedule.

``record_collectives(model)`` attaches one ``CollectiveTrace`` to every unit of a wrapped model for
the duration of a ``with`` block; units append a ``CollectiveRecord`` each time they start a
collective. ``explain(model)`` returns the sharding plan as text. Timing and memory records are planned
(issue 7).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["CollectiveRecord", "CollectiveTrace", "explain", "record_collectives"]


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


def explain(model: nn.Module) -> str:
    """The sharding plan of a wrapped model, one block per unit, as a table.

    For each unit: its strategy, dtypes, and for each parameter its full shape, this rank's rows,
    the padded shard numel every rank sends, and the padding. Run it on any rank; the numbers
    are this rank's.
    """
    from fsdp_lite.module import FullyShardedModule

    wrappers = FullyShardedModule.fsdp_modules(model)
    lines = []
    for w in wrappers:
        w._lazy_init()
        unit = w._unit
        precision = unit.precision
        dtype = next((p.sharded_flat.dtype for p in unit.params), None)
        compute = precision.param_dtype or dtype
        reduce = precision.reduce_dtype or compute
        padding = sum(p.padded_numel - p.numel for p in unit.params)
        lines.append(
            f"unit {unit.name or '<root>'}: {w._config.strategy.name}, "
            f"rank {unit.rank} of {unit.world_size}, {len(unit.params)} params, "
            f"unit_shard_numel {unit.unit_shard_numel}, padding {padding}, "
            f"shard {_dtype_name(dtype)} / compute {_dtype_name(compute)} / reduce {_dtype_name(reduce)}"
        )
        for p in unit.params:
            shape = "x".join(map(str, p.orig_size)) or "scalar"
            lines.append(
                f"  {p.fqn:<28} {shape:>12}  rows {p.local_rows:>4}/{p.shard_rows:<4} "
                f"shard_numel {p.shard_numel:>7}  padding {p.padded_numel - p.numel}"
            )
    return "\n".join(lines)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"
