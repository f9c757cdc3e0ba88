"""Which of a global batch's V micro-batches (leaves) each rank runs, and values put back in leaf
order.

Rank r of N runs V / N leaves per optimizer step; its k-th micro-batch is leaf
``SCHEDULES[schedule](k, r, N, V / N)``. Both schedules sum the same tree, so both give the same
bits (docs/invariance.md); they differ in when gradients are reduced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_lite.engine import canonical

__all__ = ["SCHEDULES", "micro_batches", "tree_mean"]

SCHEDULES = {
    # leaves r, r + N, r + 2N, ...: one reduction per micro-batch; no gradient kept unsharded
    "interleaved": lambda k, r, n, per_rank: k * n + r,
    # leaves [r V/N, (r+1) V/N): summed locally, unsharded (up to log2(V/N) + 1 buffers), then
    # one reduction per step, as gradient accumulation under no_sync
    "local": lambda k, r, n, per_rank: r * per_rank + k,
}


def micro_batches(
    tensors: Sequence[torch.Tensor], virtual_batches: int, schedule: str, rank: int, world: int
) -> list:
    """Rank ``rank``'s micro-batches of a global batch, in order: its leaves of the V equal cuts
    of each tensor's dim 0 (one tensor: a list of tensors; several: a list of tuples)."""
    size = tensors[0].size(0)
    if any(t.size(0) != size for t in tensors) or size % virtual_batches:
        raise ValueError(
            f"the global batch's dim 0 ({[t.size(0) for t in tensors]}) must be one size, "
            f"a multiple of virtual_batches ({virtual_batches})"
        )
    cut, per_rank = size // virtual_batches, virtual_batches // world
    leaf_of = SCHEDULES[schedule]
    out = []
    for k in range(per_rank):
        leaf = leaf_of(k, rank, world, per_rank)
        piece = tuple(t[leaf * cut : (leaf + 1) * cut] for t in tensors)
        out.append(piece[0] if len(tensors) == 1 else piece)
    return out


def _leaf_values(ranks: Sequence[Sequence[float]], virtual_batches: int, schedule: str) -> list:
    """Every rank's per-micro-batch values (rank r's in its micro-batch order) as V tensors in
    leaf order."""
    world = len(ranks)
    leaf_of = SCHEDULES[schedule]
    by_leaf = {
        leaf_of(k, r, world, virtual_batches // world): value
        for r, values in enumerate(ranks)
        for k, value in enumerate(values)
    }
    return [torch.tensor(by_leaf[leaf]) for leaf in range(virtual_batches)]


def tree_mean(ranks: Sequence[Sequence[float]], virtual_batches: int, schedule: str):
    """The tree sum over all V leaves, / V: the global batch's mean of a per-micro-batch value."""
    return canonical.tree_sum(_leaf_values(ranks, virtual_batches, schedule)) / virtual_batches
