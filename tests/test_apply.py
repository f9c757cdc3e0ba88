"""``nn.Module._apply`` on a wrapped model: ``to``, ``cpu``, ``float``, ``double``, ``half``,
``bfloat16``, ``type``, ``to_empty`` on every strategy.

HF Trainer calls ``model.to(args.device)`` (``cpu:0`` under torchrun) after the model was wrapped.
Without an ``_apply`` of its own the call copied every shard, the optimizer stepped the copies and
forward and ``state_dict()`` read the old shards: the loss stayed where it was, silently. Each
check here compares against a run where the call changed nothing, bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_lite import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from tests.parity import POLICIES, build_model, global_batch, loss_fn, rank_batch
from tests.ranks import run_ranks

STEPS = 3

# Calls that move nothing: the run must be bitwise the run without them.
SAME = {
    "to(cpu:0)": lambda m: m.to(torch.device("cpu", 0)),
    "cpu()": lambda m: m.cpu(),
    "float()": lambda m: m.float(),
    "to(float32)": lambda m: m.to(torch.float32),
}
# Calls that change the dtype: right after wrapping (as Trainer does), the run must be bitwise the
# run of a model converted before wrapping.
DTYPE = {
    "double()": lambda m: m.double(),
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
    "type(float64)": lambda m: m.type(torch.float64),
    "to(float64)": lambda m: m.to(torch.float64),
}

CONFIGS = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
    "NO_SHARD": {"sharding_strategy": ShardingStrategy.NO_SHARD},
    "SHARD_OPTIM": {"sharding_strategy": ShardingStrategy.SHARD_OPTIM},
    "HYBRID_SHARD": {"sharding_strategy": ShardingStrategy.HYBRID_SHARD},
    "FULL_SHARD+cpu_offload": {"cpu_offload": CPUOffload(offload_params=True)},
    # NO_SHARD computes on a bf16 copy of the whole params here: a second copy to keep in step.
    "NO_SHARD+bf16": {
        "sharding_strategy": ShardingStrategy.NO_SHARD,
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16),
    },
}


def _train(rank, world_size, options, before=None, after_wrap=None, mid=None, momentum=0.9):
    """Losses and the full state dict of a wrapped 'mlp' after STEPS steps of SGD."""
    model = build_model("mlp")
    if before is not None:
        before(model)
    fsdp = FSDP(model, auto_wrap_policy=POLICIES["mlp"], **options)
    if after_wrap is not None:
        after_wrap(fsdp)
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.05, momentum=momentum)
    losses = []
    for step in range(STEPS):
        if step == 1 and mid is not None:
            mid(fsdp)
        x, y = rank_batch("mlp", step, rank, world_size)
        dtype = next(fsdp.parameters()).dtype
        loss = loss_fn("mlp", fsdp(x.to(dtype)).float(), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    optim_tensors = {id(p) for group in optim.param_groups for p in group["params"]}
    assert all(id(p) in optim_tensors for p in fsdp.parameters()), "optimizer lost the params"
    return losses, fsdp.state_dict()


def _assert_same(actual, expected, what):
    losses, state = actual
    want_losses, want_state = expected
    assert losses == want_losses, f"{what}: losses {losses} != {want_losses}"
    assert state.keys() == want_state.keys(), f"{what}: keys differ"
    for key, value in state.items():
        assert value.dtype == want_state[key].dtype, f"{what}: {key} dtype"
        torch.testing.assert_close(
            value, want_state[key], rtol=0, atol=0, msg=lambda m, k=key: f"{what}: {k}: {m}"
        )


def _apply_rank(rank: int, world_size: int, config: str) -> None:
    options = CONFIGS[config]
    untouched = _train(rank, world_size, options)
    for name, call in SAME.items():
        _assert_same(_train(rank, world_size, options, mid=call), untouched, f"{config} {name}")
    for name, call in DTYPE.items():
        _assert_same(
            _train(rank, world_size, options, after_wrap=call),
            _train(rank, world_size, options, before=call),
            f"{config} {name}",
        )
    # to_empty: new, uninitialized shards; a full state dict loaded into them restores the run.
    fresh = build_model("mlp").state_dict()

    def empty_then_load(m):
        m.to_empty(device=torch.device("cpu"))
        m.load_state_dict(fresh)

    _assert_same(
        _train(rank, world_size, options, after_wrap=empty_then_load),
        untouched,
        f"{config} to_empty",
    )


@pytest.mark.parametrize("config", list(CONFIGS))
def test_apply_methods_keep_one_set_of_tensors(tmp_path, config):
    run_ranks(_apply_rank, 2, tmp_path, args=(config,), timeout=240)


def _mid_training_double_rank(rank: int, world_size: int) -> None:
    """double() after a step trains on in float64 like one process doing the same."""
    losses, state = _train(rank, world_size, {}, mid=lambda m: m.double(), momentum=0.0)
    single = build_model("mlp")
    optim = torch.optim.SGD(single.parameters(), lr=0.05)
    for step in range(STEPS):
        if step == 1:
            single.double()
        x, y = global_batch("mlp", step, world_size)
        loss = loss_fn("mlp", single(x.to(next(single.parameters()).dtype)).float(), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
    mean = torch.tensor(losses[-1], dtype=torch.float64)
    dist.all_reduce(mean)
    # A mean over 8 samples against two means over 4, averaged: the sums run in other orders.
    assert mean.item() / world_size == pytest.approx(loss.item(), rel=1e-6)
    for key, value in single.state_dict().items():
        assert state[key].dtype == torch.float64, f"{key} is {state[key].dtype}"
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)


def test_double_mid_training_trains_in_float64_like_one_process(tmp_path):
    run_ranks(_mid_training_double_rank, 2, tmp_path, timeout=120)


def _refusal_rank(rank: int, world_size: int, tmp: str) -> None:
    fsdp = FSDP(build_model("mlp"), auto_wrap_policy=POLICIES["mlp"])
    before = {k: v.clone() for k, v in fsdp.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"moving a wrapped model's shards from cpu to meta"):
        fsdp.to("meta")
    after = fsdp.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused call changed shards"
    disk = FSDP(build_model("mlp"), cpu_offload=CPUOffload(offload_params=True, offload_dir=tmp))
    with pytest.raises(RuntimeError, match=r"dtype of disk-offloaded shards"):
        disk.double()


def test_apply_refuses_a_device_move_and_a_disk_dtype_change_before_changing_anything(tmp_path):
    run_ranks(_refusal_rank, 2, tmp_path, args=(str(tmp_path),), timeout=120)
