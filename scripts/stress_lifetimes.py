"""Stress the prefetch and teardown paths: build, train, prefetch a unit that never runs, drop.

    torchrun --nproc_per_node 2 scripts/stress_lifetimes.py [--iterations 30] [--json PATH]

Each iteration builds a small model on both fronts (FSDP1 with forward prefetch and BACKWARD_PRE;
fully_shard with an explicit forward-prefetch chain), trains one step, runs a forward under
no_grad that skips the last block (its all-gather was prefetched: it must land, not stay in
flight), checks that forward against a plain model holding the same full parameters, and drops
the model. Meant to run under glibc's heap checks, as tests/test_buffer_lifetimes.py runs it:
``MALLOC_CHECK_=3 MALLOC_PERTURB_=N MALLOC_MMAP_THRESHOLD_=33554432`` (every allocation on the
checked heap, freed memory filled with a pattern). Rank 0 prints a JSON summary: iterations, the
largest difference from the plain model, collectives whose result was dropped with its work
unfinished, and units still alive after the model was dropped (docs/engine.md, "Buffer lifetimes").
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_lite  # noqa: E402
from fsdp_lite.engine import collectives  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402


class Blocks(nn.Module):
    """An embedding, four MLP blocks and a head; ``upto`` runs only the first blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(61, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24)) for _ in range(4)
        )
        self.head = nn.Linear(24, 61)

    def forward(self, idx: torch.Tensor, upto: int = 4) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks[:upto]:
            h = h + block(h)
        return self.head(h)


def build(front: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Blocks()
    if front == "fsdp1":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = fsdp_lite.FullyShardedDataParallel(block, forward_prefetch=True)
        return fsdp_lite.FullyShardedDataParallel(model, forward_prefetch=True)
    for block in model.blocks:
        fsdp_lite.fully_shard(block)
    fsdp_lite.fully_shard(model)
    for current, following in zip(model.blocks, model.blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
    return model


class _DroppedUnfinished:
    """Counts collective results freed while a work of theirs was still pending."""

    def __init__(self) -> None:
        self.count = 0

    def install(self) -> None:
        counter = self

        def __del__(result) -> None:  # noqa: N807
            if any(not w.is_completed() for w in result.works):
                counter.count += 1

        collectives.AllGatherResult.__del__ = __del__
        collectives.ReduceResult.__del__ = __del__


def iteration(front: str, seed: int, rank: int, world_size: int) -> tuple[float, list]:
    """One build-train-prefetch-drop round; returns (largest difference, weakrefs to units)."""
    model = build(front, seed)
    units = [weakref.ref(m._unit) for m in model.modules() if "_unit" in m.__dict__]
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    idx = torch.randint(0, 61, (2, 9), generator=gen)
    target = torch.randint(0, 61, (2, 9), generator=gen)
    F.cross_entropy(model(idx).reshape(-1, 61), target.reshape(-1)).backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        partial = model(idx, upto=2)  # blocks.1 prefetches blocks.2, which never runs
    full = {k: v.detach().clone() for k, v in _full_state_dict(model, front).items()}
    plain = Blocks()
    plain.load_state_dict(full)
    with torch.no_grad():
        want = plain(idx, upto=2)
    diff = (partial - want).abs().max().item()
    del model, optim, partial
    return diff, units


def _full_state_dict(model: nn.Module, front: str) -> dict[str, torch.Tensor]:
    if front == "fsdp1":
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30, help="rounds per front")
    parser.add_argument("--json", help="write rank 0's summary here too")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dropped = _DroppedUnfinished()
    dropped.install()
    worst, alive, rounds = 0.0, 0, 0
    for i in range(args.iterations):
        for front in ("fsdp1", "fsdp2"):
            diff, units = iteration(front, seed=i, rank=rank, world_size=world_size)
            gc.collect()
            worst = max(worst, diff)
            alive += sum(ref() is not None for ref in units)
            rounds += 1
    dist.barrier()
    summary = {
        "rounds": rounds,
        "max_abs_diff_vs_plain_model": worst,
        "collectives_dropped_unfinished": dropped.count,
        "units_alive_after_drop": alive,
    }
    everyone = [None] * world_size
    dist.all_gather_object(everyone, summary)
    if rank == 0:
        total = {
            "rounds": rounds,
            "max_abs_diff_vs_plain_model": max(s["max_abs_diff_vs_plain_model"] for s in everyone),
            "collectives_dropped_unfinished": sum(
                s["collectives_dropped_unfinished"] for s in everyone
            ),
            "units_alive_after_drop": sum(s["units_alive_after_drop"] for s in everyone),
        }
        print(json.dumps(total), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(total, indent=1) + "\n")
    leave_together()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
