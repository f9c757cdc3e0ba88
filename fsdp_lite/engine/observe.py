"""What watches a unit: one interface for everything that observes its collectives and compute.

A unit tells its observers when it issues a collective (``issued``), when this rank's wait on it
returned (``waited``), and when its forward or backward begins or ends (``compute``). At issue an
observer may also take the wait over (``Collective.waiter``), as the collective-order check does
to compare the ranks' logs while a wait stalls. The trace (tools/trace.py) and the order check
(tools/order.py) are observers; the engine knows nothing else of either, and runs the same with
none attached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Collective", "Observer"]


@dataclass(eq=False)
class Collective:
    """One collective a unit issued, from its issue until this rank's wait returned."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all" (WholeMatrix)
    unit: str  # the unit's name, "" for the root, "<optimizer>" for an optimizer's exchange
    phase: str  # "forward" | "backward" | "summon" | "state_dict" | ... | "gather" | "scatter"
    step: int  # the runtime's training step (1-based); -1 outside the runtime (an optimizer)
    group: dist.ProcessGroup
    dtype: torch.dtype
    numel: int  # of this rank's input
    device: torch.device
    # Set by at most one observer at issue: blocks until the works are done, instead of waiting
    # on each in turn.
    waiter: Callable[[Sequence[dist.Work]], None] | None = None

    def where(self) -> str:
        """``all-gather of unit 'blocks.0' in forward of step 2``, for messages."""
        return (
            f"{self.kind.replace('_', '-')} of unit {self.unit or '<root>'!r} in {self.phase} "
            f"of step {self.step}"
        )


class Observer:
    """Base of what watches units; every hook does nothing unless overridden."""

    def issued(self, op: Collective) -> None:
        """``op`` is about to be issued on this rank."""

    def waited(self, op: Collective) -> None:
        """This rank's wait on ``op`` returned."""

    def compute(self, unit: str, phase: str, edge: str, step: int) -> None:
        """``unit``'s ``phase`` ("forward" | "backward") computation ``edge``s ("begin" | "end")."""
