"""3-D parallelism: pipeline x data (fsdp_lite's fully_shard) x tensor parallel, on 8 ranks.

    torchrun --nproc_per_node 8 scripts/composition_3d.py

A (pp 2, dp 2, tp 2) mesh: the tiny Llama of conformance/tp_models.py gets torchtitan's TP plan on
mesh["tp"], is cut into two pipeline stages (embedding + block 0 | block 1 + norm + head), each
stage's blocks and root are sharded by ``fully_shard`` over mesh["dp"], and torch's ``Schedule1F1B``
runs 2 microbatches per data-parallel rank. Every rank compares its stage's parameters, after each
step, with a single-process model trained on the global batch; rank 0 prints the table, and the exit
status is 1 if any difference is above 1e-6. tests/test_composition_3d.py runs the same function.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_lite  # noqa: E402
from conformance.tp_models import TPBlock, batch, build_tplm, loss_fn, parallelize  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402

STEPS = 3
MICROBATCHES = 2
TOLERANCE = 1e-6


class _Stage(nn.Module):
    """Pieces of the model run in order: one pipeline stage."""

    def __init__(self, pieces: dict[str, nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleDict(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces.values():
            x = piece(x)
        return x


def _stage_of(model: nn.Module, pp_rank: int) -> _Stage:
    if pp_rank == 0:
        return _Stage({"tok": model.tok, "block0": model.blocks[0]})
    return _Stage({"block1": model.blocks[1], "norm": model.norm, "out": model.out})


def train_3d(rank: int, world_size: int) -> list[float]:
    """Train on a (pp 2, dp world/4, tp 2) mesh; this rank's largest parameter difference from
    the single-process model after each step."""
    mesh = init_device_mesh("cpu", (2, world_size // 4, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, dp = (
        mesh["pp"].get_local_rank(),
        mesh["dp"].get_local_rank(),
        mesh["dp"].size(),
    )
    reference = build_tplm()
    model = parallelize(copy.deepcopy(reference), mesh["tp"])
    stage_module = _stage_of(model, pp_rank)
    for piece in stage_module.pieces.values():
        if isinstance(piece, TPBlock):
            fsdp_lite.fully_shard(piece, mesh=mesh["dp"])
    fsdp_lite.fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(
        stage_module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optim = torch.optim.SGD(stage_module.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_stage = _stage_of(reference, pp_rank)
    diffs = []
    for step in range(STEPS):
        x, y = batch(step, dp_rank, dp)
        if pp_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optim.step()
        optim.zero_grad()
        x, y = batch(step, 0, 1)  # the global batch
        loss_fn(reference(x), y).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        diffs.append(
            max(
                (p.full_tensor() - q).abs().max().item()
                for p, q in zip(stage_module.parameters(), ref_stage.parameters())
            )
        )
    return diffs


def main() -> int:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size % 4:
        raise SystemExit(f"needs a multiple of 4 ranks (pp 2 x dp x tp 2), got {world_size}")
    diffs = train_3d(rank, world_size)
    table: list = [None] * world_size
    dist.all_gather_object(table, diffs)
    worst = max(max(d) for d in table)
    if rank == 0:
        print(f"pp 2 x dp {world_size // 4} x tp 2, Schedule1F1B, {MICROBATCHES} microbatches")
        print("largest parameter difference from the single-process model, per step")
        print("rank  " + "  ".join(f"step {s + 1:<7}" for s in range(STEPS)))
        for r, d in enumerate(table):
            print(f"{r:>4}  " + "  ".join(f"{v:<12.2e}" for v in d))
        print(
            f"{'PASS' if worst <= TOLERANCE else 'FAIL'}: worst {worst:.2e} (tolerance {TOLERANCE})"
        )
    leave_together()
    dist.destroy_process_group()
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
