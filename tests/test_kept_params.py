"""SHARD_OPTIM keeps its unsharded params between steps, and the FSDP2 front under
set_reshard_after_backward(False) keeps them from backward to the next forward; both gather again
only when the shards changed (Notes [ZeRO-1] and [Unsharded after backward] in engine/unit.py). torch's foreach and fused optimizers change a DTensor in
place without moving a version counter; every optimizer implementation must still train bitwise as
DDP does at 2 ranks (3 steps).

The fused AdamW is compared with DDP whose optimizer steps every rank's shard of each parameter
as a parameter of its own: its CPU kernel rounds a vector body and a scalar tail differently
(measured with AVX512: a 7-element bias gets other last bits alone than as the head of a 13-element
one), so a shard's update depends on the shard's length, whichever FSDP shards it. The other
implementations are shard-invariant and are compared with plain DDP."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_lite
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from tests.parity import POLICIES, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_checks, run_ranks

OPTIMIZERS = {
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def _params_after_training(kind: str, make_optim, rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = build_model("mlp")
    if kind in ("ddp", "ddp_shards"):
        model = DDP(model)
    elif kind == "fully_shard_kept":  # FSDP2's keep: unsharded from backward to the next forward
        fsdp_lite.fully_shard(model)
        model.set_reshard_after_backward(False)
    else:
        model = FSDP(
            model,
            sharding_strategy=ShardingStrategy.SHARD_OPTIM,
            auto_wrap_policy=POLICIES["mlp"],
            use_orig_params=True,
        )
    params = list(model.parameters())
    # Leaves aliasing every rank's shard of each parameter (nn.Parameter shares the storage).
    pieces = [(p, r) for p in params for r in range(world_size)]
    shards = [torch.nn.Parameter(shard_of(p.detach(), r, world_size)) for p, r in pieces]
    optim = make_optim(shards if kind == "ddp_shards" else params)
    for step in range(3):
        x, y = rank_batch("mlp", step, rank, world_size)
        loss_fn("mlp", model(x), y).backward()
        if kind == "ddp_shards":
            for shard, (p, r) in zip(shards, pieces):
                shard.grad = shard_of(p.grad, r, world_size)
            for p in params:
                p.grad = None
        optim.step()
        optim.zero_grad()
    if kind in ("ddp", "ddp_shards"):
        return [shard_of(p.detach(), rank, world_size) for p in model.parameters()]
    if kind == "fully_shard_kept":
        model.reshard()  # the modules held the unsharded params since the last backward
    return [local(p).detach().clone() for p in model.parameters()]


def _check(name: str, kind: str = "fsdp"):
    def check(rank: int, world_size: int) -> None:
        reference = "ddp_shards" if name == "adamw_fused" else "ddp"
        ddp = _params_after_training(reference, OPTIMIZERS[name], rank, world_size)
        ours = _params_after_training(kind, OPTIMIZERS[name], rank, world_size)
        assert len(ours) == len(ddp)
        for i, (mine, ref) in enumerate(zip(ours, ddp)):
            torch.testing.assert_close(
                mine, ref, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}"
            )

    return check


CHECKS = {name: _check(name) for name in OPTIMIZERS}
CHECKS.update({f"{name}/fully_shard_kept": _check(name, "fully_shard_kept") for name in OPTIMIZERS})


def _rank(rank: int, world_size: int) -> dict[str, str]:
    return run_checks(CHECKS, list(CHECKS), rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("kept"), timeout=180)


@pytest.mark.parametrize("name", list(CHECKS))
def test_kept_params_with_every_optimizer_implementation_are_ddp(results, name):
    """SHARD_OPTIM, and fully_shard with set_reshard_after_backward(False)."""
    for rank, failures in enumerate(results):
        assert name not in failures, f"rank {rank}:\n{failures[name]}"
