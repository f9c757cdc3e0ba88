"""Activation checkpointing with torch's checkpoint wrapper, applied before or after wrapping.

Recomputing a block in backward runs its forward again while the unit is in backward: the unit
must still hold (or gather again) its unsharded params and must not count that forward twice.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from conformance.models import Block
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks

CHECK_BLOCK = functools.partial(
    apply_activation_checkpointing, check_fn=lambda m: isinstance(m, Block)
)


def _ac_rank(rank: int, world_size: int, strategy_name: str, order: str) -> None:
    ddp_model = build_model("lm")
    CHECK_BLOCK(ddp_model)
    ddp = DDP(ddp_model)
    model = build_model("lm")
    if order == "before":
        CHECK_BLOCK(model)  # blocks become CheckpointWrapper(Block); the policy still finds Block
    fsdp = FSDP(
        model, sharding_strategy=ShardingStrategy[strategy_name], auto_wrap_policy=POLICIES["lm"]
    )
    if order == "after":
        CHECK_BLOCK(fsdp)  # the usual FSDP1 recipe: checkpoint inside each unit
    ref = {
        n.replace("_checkpoint_wrapped_module.", ""): p for n, p in ddp.module.named_parameters()
    }
    optims = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, fsdp)]
    for step in range(3):
        x, y = rank_batch("lm", step, rank, world_size)
        for m, optim in zip((ddp, fsdp), optims):
            loss_fn("lm", m(x), y).backward()
            optim.step()
            optim.zero_grad()
        for name, p in fsdp.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")
            want = ref[name].detach()
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            what = f"rank {rank} step {step} {name} ({strategy_name}, checkpoint {order})"
            assert_close(local(p).detach(), want, what=what, rtol=0, atol=0)


@pytest.mark.parametrize("order", ["after", "before"])
@pytest.mark.parametrize("strategy_name", ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM"])
def test_activation_checkpointing_trains_like_ddp(tmp_path, strategy_name, order):
    run_ranks(_ac_rank, 2, tmp_path, args=(strategy_name, order), timeout=120)
