"""Activation checkpointing with torch's checkpoint wrapper, applied before or after wrapping.

Recomputing a block in backward runs its forward again while the unit is in backward: the unit
must still hold (or gather again) its unsharded params and must not count that forward twice.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from conformance.models import Block
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy, StateDictType
from tests.parity import (
    POLICIES,
    assert_close,
    build_model,
    local,
    loss_fn,
    rank_batch,
    shard_of,
    train_lm,
)
from tests.ranks import run_ranks

CHECK_BLOCK = functools.partial(
    apply_activation_checkpointing, check_fn=lambda m: isinstance(m, Block)
)


def _checkpoint_inside_blocks(model: torch.nn.Module) -> None:
    """torch.utils.checkpoint called inside each Block's forward (Block.checkpoint)."""
    for m in model.modules():
        if isinstance(m, Block):
            m.checkpoint = True


def _ac_rank(rank: int, world_size: int, strategy_name: str, order: str) -> None:
    ddp_model = build_model("lm")
    CHECK_BLOCK(ddp_model)
    ddp = DDP(ddp_model)
    model = build_model("lm")
    if order == "inner":
        _checkpoint_inside_blocks(model)
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


# after / before: torch's checkpoint_wrapper around each unit's Block, applied after or before
# wrapping; inner: torch.utils.checkpoint inside the Block's forward.
CASES = [
    (strategy, order)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD")
    for order in ("after", "before", "inner")
    if order == "inner" or strategy != "NO_SHARD"
]


@pytest.mark.parametrize("strategy_name, order", CASES, ids=lambda v: str(v))
def test_activation_checkpointing_trains_like_ddp(tmp_path, strategy_name, order):
    run_ranks(_ac_rank, 2, tmp_path, args=(strategy_name, order), timeout=120)


def _activation_peak_rank(rank: int, world_size: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    peaks = {}
    for checkpoint in (False, True):
        model = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"])
        if checkpoint:
            _checkpoint_inside_blocks(model)
        x, y = rank_batch("lm", 0, rank, world_size)
        x = x.repeat(8, 1)  # a longer batch, so activations outweigh the tiny params
        y = y.repeat(8, 1)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss_fn("lm", model(x), y).backward()
        snapshot = tracker.get_tracker_snapshot("peak")
        peaks[checkpoint] = max(v.get(_MemRefType.ACT, 0) for v in snapshot.values())
    return peaks


def test_activation_checkpointing_lowers_the_activation_peak(tmp_path):
    for rank, peaks in enumerate(run_ranks(_activation_peak_rank, 2, tmp_path, timeout=120)):
        print(f"rank {rank}: activation peak {peaks[False]} B plain, {peaks[True]} B checkpointed")
        assert peaks[True] < 0.7 * peaks[False], peaks


# ---- wrappers applied after FSDP leave every state dict as without them ---------------------------


def _accelerate_style_ac(fsdp: torch.nn.Module) -> None:
    """What Accelerate and HF do after wrapping: torch's non-reentrant checkpoint_wrapper per Block."""
    apply_activation_checkpointing(
        fsdp,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, Block),
    )


def _state_dicts_rank(rank: int, world_size: int, strategy_name: str) -> None:
    seen = {}
    for wrapped_after in (False, True):
        fsdp = FSDP(
            build_model("lm"),
            sharding_strategy=ShardingStrategy[strategy_name],
            auto_wrap_policy=POLICIES["lm"],
        )
        if wrapped_after:
            _accelerate_style_ac(fsdp)
            assert any(isinstance(m, CheckpointWrapper) for m in fsdp.modules())
        optim = train_lm(fsdp, rank, world_size, steps=2, lr=0.05)
        got = {"names": [n for n, _ in fsdp.named_parameters()]}
        for kind in StateDictType:
            with FSDP.state_dict_type(fsdp, kind):
                got[kind.name] = fsdp.state_dict()
                got[f"optim {kind.name}"] = FSDP.optim_state_dict(fsdp, optim)["state"]
        with FSDP.summon_full_params(fsdp):
            got["summoned"] = {n: p.detach().clone() for n, p in fsdp.named_parameters()}
        seen[wrapped_after] = got
    plain, wrapped = seen[False], seen[True]
    assert wrapped["names"] == plain["names"]
    for what in ("summoned", *(k.name for k in StateDictType)):
        assert list(wrapped[what]) == list(plain[what]), f"{what}: keys differ"
        for key, value in wrapped[what].items():
            want = plain[what][key]
            assert type(value) is type(want), f"{what} {key}: {type(value).__name__}"
            assert_close(local(value), local(want), what=f"{what} {key}", rtol=0, atol=0)
    for kind in StateDictType:
        what = f"optim {kind.name}"
        assert list(wrapped[what]) == list(plain[what]), f"{what}: keys differ"
        for key, state in wrapped[what].items():
            for name, value in state.items():
                want = plain[what][key][name]
                assert_close(local(value), local(want), what=f"{what} {key}", rtol=0, atol=0)


@pytest.mark.parametrize("strategy_name", ["FULL_SHARD", "NO_SHARD"])
def test_checkpoint_wrapper_after_wrapping_leaves_state_dicts_and_names_unchanged(
    tmp_path, strategy_name
):
    run_ranks(_state_dicts_rank, 2, tmp_path, args=(strategy_name,), timeout=120)
