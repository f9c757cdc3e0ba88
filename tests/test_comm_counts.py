"""torch's ``CommDebugMode`` counts fsdp_lite's collectives as it counts torch FSDP2's.

On gloo fsdp_lite gathers (and at 2 ranks reduce-scatters) by point-to-point sends, which the mode
does not count; under the mode they go by the backend's own collectives (the same bytes and sums,
collectives.py ``_counted_by_comm_debug_mode``), so a user counting collectives, as torch's
``test_gradient_accumulation`` does, counts what torch FSDP2 issues. At world size 1 no gradient
reduction is issued at all, as in torch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_lite
from tests.ranks import run_ranks


def _model(fully_shard) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _step(model: nn.Module, rank: int, counting: bool):
    """Two forward/backwards (the second gathers again), counted if ``counting``; the counts by
    op name, and every parameter's full gradient. One mode per forward/backward: torch 2.13's
    CommDebugMode fails a forward after a backward in the same mode (IndexError in its module
    tracker, a plain module too)."""
    counts: dict[str, int] = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        mode = CommDebugMode()
        with mode if counting else contextlib.nullcontext():
            model(x).sum().backward()
        for op, n in mode.get_comm_counts().items():
            if n:
                counts[str(op)] = counts.get(str(op), 0) + n
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return counts, grads


def _counts_rank(rank: int, world_size: int) -> dict:
    ours, theirs = _model(fsdp_lite.fully_shard), _model(torch_fully_shard)
    ours_counts, ours_grads = _step(ours, rank, counting=True)
    theirs_counts, theirs_grads = _step(theirs, rank, counting=True)
    _, uncounted_grads = _step(_model(fsdp_lite.fully_shard), rank, counting=False)
    for name, grad in theirs_grads.items():
        assert torch.equal(ours_grads[name], grad), f"{name}: gradient differs from torch's"
        assert torch.equal(uncounted_grads[name], grad), f"{name}: differs outside the mode"
    assert all(isinstance(p, DTensor) for p in ours.parameters())
    return {"ours": ours_counts, "torch": theirs_counts}


@pytest.mark.parametrize("world_size", [1, 2])
def test_comm_debug_mode_counts_what_torch_fsdp2_issues(tmp_path, world_size):
    results = run_ranks(_counts_rank, world_size, tmp_path, timeout=90)
    for rank, counts in enumerate(results):
        assert counts["ours"] == counts["torch"], f"rank {rank}: {counts}"
        if world_size == 1:  # torch reduces nothing in a group of one; neither do we
            assert not any("reduce_scatter" in op for op in counts["ours"]), counts
        else:
            assert any("reduce_scatter" in op for op in counts["ours"]), counts
