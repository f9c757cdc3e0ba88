"""Pipeline parallel: torch's pipelining schedules over stages sharded by ``fully_shard``.

4 gloo ranks as pp 2 x dp 2: each stage's module is sharded over its data-parallel sub-mesh, and
torch's ``PipelineStage`` sees an ``FSDPModule``, so it keeps gradients unreduced across
microbatches (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``,
``set_is_last_backward(False)``) and reduces once per step through ``fully_shard.state(...)``
(fsdp_lite/fronts/interop.py). Each schedule trains to the single-process model on the global batch, and
to torch's FSDP2 under the same schedule; the trace shows one reduction per unit per step.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

import fsdp_lite
from conformance.models import Block
from fsdp_lite.trace import record_collectives
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

STEPS = 3
MICROBATCHES = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
TORCH_FSDP_DIR = str(Path(torch_fsdp.__file__).parent)


class Embed(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.tok, self.pos = lm.tok, lm.pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.size(1)]


class Head(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.head = lm.ln_f, lm.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class Stage(nn.Module):
    """Consecutive pieces of the 'lm_untied' model: one pipeline stage's module."""

    def __init__(self, pieces: list[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces:
            x = piece(x)
        return x


def _pieces(lm: nn.Module) -> list[nn.Module]:
    return [Embed(lm), lm.blocks[0], lm.blocks[1], Head(lm)]


def _stage_pieces(schedule: str, pp_rank: int) -> list[list[int]]:
    """The pieces of each stage this pp rank runs: two stages of two pieces, or (interleaved)
    four stages of one piece, stages pp_rank and pp_rank + 2."""
    if schedule == "interleaved_1f1b":
        return [[pp_rank], [pp_rank + 2]]
    return [[2 * pp_rank, 2 * pp_rank + 1]]


def _microbatched(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = rank_batch("lm", step, dp_rank, dp)
    return torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])  # 8 rows: 2 microbatches of 4


def _pipelined(schedule: str, fully_shard, mesh, ignore_pipelining_calls: bool = False) -> dict:
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    lm = build_model("lm_untied")
    reference = copy.deepcopy(lm)
    pieces = _pieces(lm)
    stage_ids = _stage_pieces(schedule, pp_rank)
    modules = [Stage([pieces[i] for i in ids]) for ids in stage_ids]
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, Block):
                fully_shard(sub, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    if ignore_pipelining_calls:  # what a stage not seen as FSDP would get: every microbatch syncs
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, fsdp_lite.FSDPModule):
                    for name in ("set_requires_gradient_sync", "set_reshard_after_backward"):
                        setattr(sub, name, lambda *args, **kwargs: None)
    num_stages = 4 if schedule == "interleaved_1f1b" else 2
    stage_index = [pp_rank, pp_rank + 2] if schedule == "interleaved_1f1b" else [pp_rank]
    stages = [
        PipelineStage(m, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        for m, i in zip(modules, stage_index)
    ]

    def loss(output, target):
        return loss_fn("lm", output, target)

    if schedule == "interleaved_1f1b":
        pipe = ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=loss)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        pipe = cls(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss)
    params = [p for m in modules for p in m.parameters()]
    optim = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(TORCH_FSDP_DIR):
            ran.add(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    ours = fully_shard is fsdp_lite.fully_shard
    traces = []
    for step in range(STEPS):
        x, y = _microbatched(step, dp_rank, dp)
        # pp rank 0 holds the first stage and pp rank 1 the last, under every schedule here.
        args = (x,) if pp_rank == 0 else ()
        kwargs = {"target": y} if pp_rank == 1 else {}
        with record_collectives(nn.ModuleList(modules)) if ours else contextlib.nullcontext() as t:
            sys.setprofile(profile if ours else None)
            try:
                pipe.step(*args, **kwargs)
            finally:
                sys.setprofile(None)
        traces.append(t)
        optim.step()
        optim.zero_grad()
    # The reference: the global batch on one process, the same optimizer.
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        parts = [_microbatched(step, r, dp) for r in range(dp)]
        out = reference(torch.cat([p[0] for p in parts]))
        loss_fn("lm", out, torch.cat([p[1] for p in parts])).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    ref_pieces = _pieces(reference)
    ref_params = [p for ids in stage_ids for i in ids for p in ref_pieces[i].parameters()]
    full = [p.full_tensor() for p in params]
    result = {
        "max_diff": max((a - b).abs().max().item() for a, b in zip(full, ref_params)),
        "params": [t.tolist() for t in full],
        "torch_fsdp_ran": sorted(ran),
    }
    if ours:
        last = traces[-1]
        result["collectives"] = {
            kind: (last.count(kind), sum(r.nbytes for r in last.records if r.kind == kind))
            for kind in ("all_gather", "reduce_scatter")
        }
    dist.barrier()
    return result


def _pipelining_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    results = {}
    for schedule in SCHEDULES:
        results[schedule] = _pipelined(schedule, fsdp_lite.fully_shard, mesh)
        results[schedule, "torch"] = _pipelined(schedule, torch_fully_shard, mesh)
    results["1f1b", "ignoring"] = _pipelined("1f1b", fsdp_lite.fully_shard, mesh, True)
    return results


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    return run_ranks(_pipelining_rank, 4, tmp_path_factory.mktemp("pp"), timeout=400)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelined_fully_shard_trains_to_the_single_process_model(schedule, pipelined):
    for rank, results in enumerate(pipelined):
        ours, torchs = results[schedule], results[schedule, "torch"]
        assert ours["max_diff"] <= 1e-6, f"rank {rank}: params off by {ours['max_diff']}"
        assert torchs["max_diff"] <= 1e-6, f"rank {rank}: torch's off by {torchs['max_diff']}"
        # The same sums in the same order as torch FSDP2: bitwise.
        for i, (a, b) in enumerate(zip(ours["params"], torchs["params"])):
            assert torch.equal(torch.tensor(a), torch.tensor(b)), f"rank {rank} param {i}"
        assert not ours["torch_fsdp_ran"], f"rank {rank}: torch FSDP ran {ours['torch_fsdp_ran']}"


def test_pipelining_calls_save_communication(pipelined):
    for rank, results in enumerate(pipelined):
        honoured, ignored = results["1f1b"]["collectives"], results["1f1b", "ignoring"]
        ignored = ignored["collectives"]
        # Honoured: one reduce-scatter per unit per step; ignored: one per microbatch.
        assert honoured["reduce_scatter"][0] * MICROBATCHES == ignored["reduce_scatter"][0]
        assert honoured["all_gather"][1] < ignored["all_gather"][1], (rank, honoured, ignored)


def _world_mesh_stage_rank(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    pieces = _pieces(build_model("lm_untied"))
    stage = Stage([pieces[i] for i in _stage_pieces("1f1b", mesh["pp"].get_local_rank())[0]])
    try:
        fsdp_lite.fully_shard(stage)  # the whole world as the shard group: stages differ across it
    except ValueError as e:
        return str(e)
    return "no error"


def test_stages_sharded_over_the_whole_world_fail_with_a_hint(tmp_path):
    for rank, message in enumerate(run_ranks(_world_mesh_stage_rank, 4, tmp_path, timeout=60)):
        assert "ranks built different models" in message, f"rank {rank}: {message}"
        assert "data-parallel sub-mesh" in message, f"rank {rank}: {message}"
