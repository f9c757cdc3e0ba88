"""The canonical reduction mode: the same bits at any world size (docs/invariance.md).

``Canonical`` (mode.py) drives the engine's fixed-tree sums (engine/canonical.py) over a global
batch's micro-batches: schedule.py says which leaves each rank runs, tree.py sums a plain
module's gradients, clip.py clips by a norm summed in fixed trees. The engine knows nothing of
this package (tests/test_import_graph.py).
"""

from fsdp_lite.canonical.mode import SCHEDULES, Canonical

__all__ = ["SCHEDULES", "Canonical"]
