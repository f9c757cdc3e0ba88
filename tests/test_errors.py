"""A failing collective says what fsdp_lite was doing: which collective, unit, phase, step, group.

A rank that dies mid-step leaves its peers with gloo's bare "Connection closed by peer". Here rank 1
leaves at step 2 (its process exits, as a crashed rank's does); rank 0's error must name the
collective it was in, the unit, forward or backward, the step and the group's ranks, with gloo's
error chained.
"""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.engine.collectives import CollectiveError
from tests.parity import POLICIES, build_model, loss_fn, rank_batch
from tests.ranks import run_ranks


def _peer_leaves_rank(rank: int, world_size: int, leaves_before: str) -> dict | str:
    model = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"])
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in (1, 2):
        x, y = rank_batch("lm", step, rank, world_size)
        try:
            if rank == 1 and step == 2 and leaves_before == "forward":
                return "left"
            loss = loss_fn("lm", model(x), y)
            if rank == 1 and step == 2:
                return "left"
            loss.backward()
        except CollectiveError as e:
            return {"message": str(e), "cause": type(e.__cause__).__name__}
        optim.step()
        optim.zero_grad()
    return "no error"


@pytest.mark.parametrize("leaves_before", ["forward", "backward"])
def test_a_dead_peer_is_reported_with_the_unit_phase_step_and_group(tmp_path, leaves_before):
    results = run_ranks(
        _peer_leaves_rank, 2, tmp_path, args=(leaves_before,), timeout=120, in_step=False
    )
    assert results[1] == "left"
    seen = results[0]
    assert isinstance(seen, dict), f"rank 0 saw no collective error: {seen}"
    pattern = (
        rf"^fsdp_lite: (all-gather|reduce-scatter) of unit '[^']+' in {leaves_before} of step 2 "
        r"failed \(group of ranks \[0, 1\]\): "
    )
    print(seen["message"][:240])
    assert re.match(pattern, seen["message"]), seen["message"]
    assert seen["cause"] in ("RuntimeError", "DistBackendError", "DistNetworkError"), seen
