"""Soak: 200 steps of FULL_SHARD with forward and backward prefetch hold nothing more at the end.

After a warm-up long enough for everything bounded to fill (the collective-order logs keep their
last 512 entries), the bytes of every live tensor and the count of live tensors are the same at
step 200 as at step 100, and the count of Python objects the garbage collector tracks has not
grown, on both fronts. A reference kept per step (a trace, a pending reduction, a work, a loop variable in a
helper thread) grows one of them.
"""

from __future__ import annotations

import gc

import pytest
import torch

import fsdp_lite
from fsdp_lite.api import BackwardPrefetch
from tests.parity import POLICIES, build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

STEPS = 200
MEASURE_AT = (100, STEPS)


def _live() -> dict[str, int]:
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = {}
    for t in tensors:
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return {
        "tensor_bytes": sum(storages.values()),
        "tensors": len(tensors),
        "objects": len(gc.get_objects()),
    }


def _soak_rank(rank: int, world_size: int, front: str) -> dict:
    model = build_model("lm")
    if front == "fully_shard":
        for block in model.blocks:
            fsdp_lite.fully_shard(block)
        fsdp_lite.fully_shard(model)
    else:
        model = fsdp_lite.FullyShardedDataParallel(
            model,
            auto_wrap_policy=POLICIES["lm"],
            forward_prefetch=True,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    for step in range(1, STEPS + 1):
        x, y = rank_batch("lm", step % 7, rank, world_size)
        loss_fn("lm", model(x), y).backward()
        optim.step()
        optim.zero_grad()
        if step in MEASURE_AT:
            seen[step] = _live()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("front", ["FullyShardedDataParallel", "fully_shard"])
def test_200_steps_leave_memory_tensors_and_objects_flat(tmp_path, front):
    for rank, seen in enumerate(run_ranks(_soak_rank, 2, tmp_path, args=(front,), timeout=240)):
        early, late = (seen[s] for s in MEASURE_AT)
        where = f"rank {rank}: step {MEASURE_AT[0]} {early}, step {STEPS} {late}"
        assert late["tensor_bytes"] == early["tensor_bytes"], where
        assert late["tensors"] == early["tensors"], where
        # Python's own caches move the object count by a few either way; one object kept per
        # step would add 100.
        assert late["objects"] - early["objects"] <= 10, where
