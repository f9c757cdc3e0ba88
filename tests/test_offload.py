"""CPU offload (ZeRO-Offload): shards, grads and optimizer state in CPU memory, same numbers.

On this CPU-only machine the compute device is the CPU too, so the device copies in offload.py are
skipped and these tests check the bookkeeping and the parity; the GPU test checks the copies.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks


def _offload_rank(rank: int, world_size: int, strategy_name: str) -> None:
    ddp = DDP(build_model("lm"))
    fsdp = FSDP(
        build_model("lm"),
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=POLICIES["lm"],
        cpu_offload=CPUOffload(offload_params=True),
    )
    ref = dict(ddp.module.named_parameters())
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, fsdp)]
    for step in range(3):
        x, y = rank_batch("lm", step, rank, world_size)
        for model, optim in zip((ddp, fsdp), optims):
            loss_fn("lm", model(x), y).backward()
            optim.step()
        for name, p in fsdp.named_parameters():
            what = f"rank {rank} step {step} {name} ({strategy_name})"
            assert local(p).device.type == "cpu" and local(p.grad).device.type == "cpu", what
            want = ref[name].detach()
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p).detach(), want, what=what, rtol=0.0, atol=0.0)
        for optim in optims:
            optim.zero_grad()
    states = optims[1].state.values()
    assert all(local(s["exp_avg"]).device.type == "cpu" for s in states), "optimizer state on CPU"


@pytest.mark.parametrize(
    "strategy_name", ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD"]
)
def test_cpu_offload_trains_like_ddp_with_shards_in_cpu_memory(tmp_path, strategy_name):
    run_ranks(_offload_rank, 2, tmp_path, args=(strategy_name,), timeout=120)


def _offload_gpu_rank(rank: int, world_size: int, strategy_name: str) -> None:
    device = torch.device("cuda", 0)
    models = {}
    for offload in (False, True):
        models[offload] = FSDP(
            build_model("lm"),
            sharding_strategy=ShardingStrategy[strategy_name],
            auto_wrap_policy=POLICIES["lm"],
            device_id=device,
            cpu_offload=CPUOffload(offload_params=offload),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )
    for p in models[True].parameters():
        assert local(p).device.type == "cpu" and local(p).is_pinned(), "pinned CPU shards"
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    for step in range(3):
        x, y = (t.to(device) for t in rank_batch("lm", step, rank, world_size))
        losses = {}
        for k, model in models.items():
            losses[k] = loss_fn("lm", model(x), y)
            losses[k].backward()
            optims[k].step()
            optims[k].zero_grad()
        # The same arithmetic on the GPU, only the optimizer step runs on the CPU: equal to
        # the float32 elementwise rounding of the two devices' kernels.
        assert_close(losses[True], losses[False], what=f"step {step} loss", rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy_name", ["FULL_SHARD", "NO_SHARD"])
def test_cpu_offload_on_gpu_keeps_pinned_cpu_shards_and_matches_no_offload(tmp_path, strategy_name):
    run_ranks(_offload_gpu_rank, 1, tmp_path, args=(strategy_name,), timeout=120)
