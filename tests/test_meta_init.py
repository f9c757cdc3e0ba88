"""Meta-device init: a model built on the meta device is materialized one unit at a time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from conformance.models import TinyLM
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from fsdp_lite.wrap import ModuleWrapPolicy
from tests.parity import POLICIES, assert_close, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks


def _init_lm(module: nn.Module) -> None:
    """param_init_fn for TinyLM: its own ``pos`` has no reset_parameters."""
    if isinstance(module, TinyLM):
        nn.init.normal_(module.pos, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _meta_rank(rank: int, world_size: int, strategy_name: str) -> None:
    torch.manual_seed(rank)  # different on purpose: sync_module_states must make them agree
    with torch.device("meta"):
        model = TinyLM()
    fsdp = FSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=POLICIES["lm"],
        param_init_fn=_init_lm,
        sync_module_states=True,
        device_id=torch.device("cpu"),
    )
    assert fsdp.tok.weight is fsdp.head.weight, "the tie survives materialization"
    full = fsdp.state_dict()
    assert all(v.device.type == "cpu" for v in full.values())
    first = [full] if rank == 0 else [None]
    dist.broadcast_object_list(first, src=0)
    for key, value in full.items():
        assert_close(value, first[0][key], what=f"rank {rank} {key} vs rank 0", rtol=0, atol=0)
    assert full["pos"].abs().max() > 0, "param_init_fn ran"
    # Parity: DDP built from the same values trains to the same numbers.
    plain = TinyLM()
    plain.load_state_dict(full)
    ddp = DDP(plain)
    ref = dict(ddp.module.named_parameters())
    optims = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, fsdp)]
    for step in range(2):
        x, y = rank_batch("lm", step, rank, world_size)
        for model, optim in zip((ddp, fsdp), optims):
            loss_fn("lm", model(x), y).backward()
            optim.step()
            optim.zero_grad()
        for name, p in fsdp.named_parameters():
            want = ref[name].detach()
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p).detach(), want, what=f"step {step} {name}", rtol=0, atol=0)


@pytest.mark.parametrize("strategy_name", ["FULL_SHARD", "NO_SHARD"])
def test_meta_model_materializes_syncs_and_trains_like_ddp(tmp_path, strategy_name):
    run_ranks(_meta_rank, 2, tmp_path, args=(strategy_name,), timeout=120)


def _meta_peak_rank(rank: int, world_size: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    num_units, width = 8, 128
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(num_units)])
    tracker = MemTracker()
    with tracker:
        fsdp = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu")
        )
    # Every device's peak; on this machine only the CPU's is non-zero.
    peak_total = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    unit_nbytes = (width * width + width) * 4
    shards_nbytes = sum(local(p).nbytes for p in fsdp.parameters())
    return {
        "peak": peak_total,
        "unit": unit_nbytes,
        "shards": shards_nbytes,
        "model": num_units * unit_nbytes,
    }


def test_meta_init_peak_is_the_shards_plus_one_unit_not_the_model(tmp_path):
    for rank, m in enumerate(run_ranks(_meta_peak_rank, 2, tmp_path, timeout=120)):
        # Beyond the shards, the peak is one unit materialized whole, inside the unsharded buffer
        # it is sharded from: 1 unit, against 8 for the whole model.
        extra = m["peak"] - m["shards"]
        print(
            f"rank {rank}: peak {m['peak']} B = shards {m['shards']} B + {extra} B; "
            f"one unit {m['unit']} B, whole model {m['model']} B"
        )
        assert extra <= m["unit"], f"rank {rank}: {extra} bytes beyond the shards: {m}"


def _to_empty_then_reset(module: nn.Module) -> None:
    """The param_init_fn torch's meta-device examples use: allocate with ``to_empty`` (new
    storage in each parameter), then initialize, with a fixed seed so both wrappers agree."""
    if any(t.is_meta for t in (*module.parameters(False), *module.buffers(False))):
        module.to_empty(device=torch.device("cpu"), recurse=False)
        torch.manual_seed(sum(p.numel() for p in module.parameters(False)))
        module.reset_parameters()


def _reallocating_init_rank(rank: int, world_size: int, strategy_name: str) -> None:
    """An init function that re-allocates (to_empty): fsdp_lite kept uninitialized memory in
    its buffers (torch's test_simple_model_with_meta_device_reset_params found it); the full
    parameters after wrapping and after two SGD steps must be bitwise torch FSDP1's."""
    import torch.distributed.fsdp as native

    results = []
    for cls, strategy in (
        (FSDP, ShardingStrategy[strategy_name]),
        (native.FullyShardedDataParallel, native.ShardingStrategy[strategy_name]),
    ):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
        wrapped = cls(
            model,
            sharding_strategy=strategy,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            param_init_fn=_to_empty_then_reset,
            device_id=torch.device("cpu"),
        )
        optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        torch.manual_seed(1 + rank)
        seen = []
        for step in range(3):
            with cls.summon_full_params(wrapped):
                seen.append([p.detach().clone() for p in wrapped.parameters()])
            if step < 2:
                wrapped(torch.randn(4, 6)).square().sum().backward()
                optim.step()
                optim.zero_grad()
        results.append(seen)
    ours, theirs = results
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {step}: {(x - y).abs().max():.3e} off torch FSDP1"


@pytest.mark.parametrize("strategy_name", ["FULL_SHARD", "NO_SHARD"])
def test_reallocating_param_init_fn_as_torch_fsdp1(tmp_path, strategy_name):
    run_ranks(_reallocating_init_rank, 2, tmp_path, args=(strategy_name,), timeout=120)
