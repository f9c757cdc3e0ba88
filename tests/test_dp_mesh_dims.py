"""``fully_shard(dp_mesh_dims=...)`` (torch 2.13's SPMD mode, param.py Note [SPMD mesh parameters]):
parameters are DTensors on the whole mesh, replicated on its data-parallel dims, inputs DTensors
sharded on the batch. Each case trains 3 SGD-with-momentum steps with fsdp_lite and with torch
FSDP2 in one launch: gradients, parameters and their placements bitwise equal.

- shard only, 2 ranks, fp32 and bf16 params / fp32 reduce;
- shard + replicate (HSDP) on a 2 x 2 mesh, 4 ranks;
- shard + tensor parallel on a (dp, tp) 2 x 2 mesh (colwise then rowwise Linear), 4 ranks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

import fsdp_lite
from tests.ranks import run_checks, run_ranks

APIS = {"torch": torch_fsdp, "fsdp_lite": fsdp_lite}
DIM = 8


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    # One object per shape and names: DTensor hands back the first equal mesh it saw, and
    # fully_shard (torch's and ours) wants the very mesh the parameters are on.
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM), nn.Linear(DIM, 5)
    )


def _train(api, mesh, dims: dict, batch_placements, tp_dim: int | None, bf16: bool):
    model = _model()

    def placements(name, module, device_mesh):  # Replicate on dp dims; TP on tp_dim
        for pname, param in list(module.named_parameters(recurse=False)):
            pl = [Replicate()] * device_mesh.ndim
            if tp_dim is not None and module is model[0]:
                pl[tp_dim] = Shard(0)  # colwise
            if tp_dim is not None and module is model[2] and pname == "weight":
                pl[tp_dim] = Shard(1)  # rowwise
            module.register_parameter(
                pname, nn.Parameter(distribute_tensor(param, device_mesh, pl))
            )

    distribute_module(model, mesh, placements)
    mp = api.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None
    )
    dp_dims = api.DataParallelMeshDims(**dims)
    for block in (model[0], model[2]):
        api.fully_shard(block, mesh=mesh, dp_mesh_dims=dp_dims, mp_policy=mp)
    api.fully_shard(model, mesh=mesh, dp_mesh_dims=dp_dims, mp_policy=mp)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, DIM, generator=g)  # the global batch, sharded by batch_placements
        out = model(distribute_tensor(x, mesh, batch_placements))
        out.float().pow(2).mean().backward()
        grads = {n: (p.grad.placements, p.grad.full_tensor()) for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        params = {n: (p.placements, p.full_tensor()) for n, p in model.named_parameters()}
        record.append((grads, params))
    return record


def _check(mesh, dims, batch_placements, tp_dim, bf16):
    runs = {
        name: _train(api, mesh, dims, batch_placements, tp_dim, bf16) for name, api in APIS.items()
    }
    for step, (ours, theirs) in enumerate(zip(runs["fsdp_lite"], runs["torch"])):
        for kind, mine, ref in zip(("grad", "param"), ours, theirs):
            assert mine.keys() == ref.keys()
            for name in ref:
                assert mine[name][0] == ref[name][0], f"step {step} {kind} {name} placements"
                torch.testing.assert_close(
                    mine[name][1], ref[name][1], rtol=0, atol=0,
                    msg=lambda m, n=name, k=kind, s=step: f"step {s} {k} {n}: {m}",
                )  # fmt: skip


def _shard_only(bf16: bool):
    def check(rank: int, world_size: int) -> None:
        mesh = _mesh((world_size,), ("dp",))
        _check(mesh, {"shard": "dp"}, [Shard(0)], None, bf16)

    return check


CHECKS_2 = {"shard_fp32": _shard_only(False), "shard_bf16_fp32": _shard_only(True)}


def _hsdp(rank: int, world_size: int) -> None:
    mesh = _mesh((2, 2), ("rep", "shard"))
    _check(mesh, {"shard": "shard", "replicate": "rep"}, [Shard(0), Shard(0)], None, False)


def _with_tp(rank: int, world_size: int) -> None:
    mesh = _mesh((2, 2), ("dp", "tp"))
    _check(mesh, {"shard": "dp"}, [Shard(0), Replicate()], 1, False)


CHECKS_4 = {"shard_replicate": _hsdp, "shard_tp": _with_tp}
CHECKS = {2: CHECKS_2, 4: CHECKS_4}  # world size -> its checks, one launch each


def _rank(rank: int, world_size: int) -> dict[str, str]:
    return run_checks(CHECKS[world_size], list(CHECKS[world_size]), rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    launched: dict[int, list] = {}

    def of(world_size: int) -> list:
        if world_size not in launched:
            where = tmp_path_factory.mktemp(f"dp_mesh_dims_{world_size}")
            launched[world_size] = run_ranks(_rank, world_size, where, timeout=300)
        return launched[world_size]

    return of


@pytest.mark.parametrize(
    ("world_size", "check"), [(ws, name) for ws, checks in CHECKS.items() for name in checks]
)
def test_dp_mesh_dims_is_torchs_bitwise(results, world_size, check):
    for rank, failures in enumerate(results(world_size)):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"
