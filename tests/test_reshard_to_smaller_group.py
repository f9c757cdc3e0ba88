"""``fully_shard(reshard_after_forward=k)``: after forward keep 1/k, gather backward's within k.

At 4 ranks with k = 2 (unit.py, Note [Post-forward shards]): training is bitwise torch FSDP2's
with the same int, and bitwise ``reshard_after_forward=True`` (an all-gather only moves data);
forward's all-gathers span the 4 ranks, backward's the 2 of this rank's group, each rank sending
its 2 rows; bad sizes fail as torch's do.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import fsdp_lite
from fsdp_lite.tools import order
from fsdp_lite.trace import record_collectives
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_ranks


def _train(fully_shard, reshard_after_forward, mp_policy=None, trace_step=None):
    model = build_model("lm_untied")
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank, world_size, losses, records = dist.get_rank(), dist.get_world_size(), [], None
    for step in range(3):
        x, y = rank_batch("lm", step, rank, world_size)
        if step == trace_step:
            with record_collectives(model) as trace:
                loss = loss_fn("lm", model(x), y)
                loss.backward()
            records = trace.records
        else:
            loss = loss_fn("lm", model(x), y)
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return losses, state, records, model


def _same(a, b) -> bool:
    return (
        a[0] == b[0]
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


def _hpz_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    mine = _train(fsdp_lite.fully_shard, 2, trace_step=1)
    out["torch"] = _same(mine, _train(torch_fully_shard, 2))
    out["true"] = _same(mine, _train(fsdp_lite.fully_shard, True))
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["torch_bf16"] = _same(
        _train(fsdp_lite.fully_shard, 2, fsdp_lite.MixedPrecisionPolicy(**bf16)),
        _train(torch_fully_shard, 2, TorchPolicy(**bf16)),
    )
    records, model = mine[2], mine[3]
    block = model.blocks[0]._unit
    out["gathers"] = sorted(
        {
            (r.phase, r.numel // block.unit_shard_numel)
            for r in records
            if r.unit == "blocks.0" and r.kind == "all_gather"
        }
    )
    group = block.post_forward_group
    out["group"] = dist.get_process_group_ranks(group)
    out["logged_on_group"] = order.log_for(group).count > 0
    # torch's rules for the int
    for size, what in ((3, "not_a_factor"), (1, "one")):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fsdp_lite.fully_shard(torch.nn.Linear(4, 4), reshard_after_forward=size)
            out[what] = [str(w.message) for w in caught]
        except ValueError as e:
            out[what] = f"ValueError: {e}"
    try:
        fsdp_lite.fully_shard(
            torch.nn.Linear(4, 4),
            reshard_after_forward=2,
            offload_policy=fsdp_lite.CPUOffloadPolicy(),
        )
    except NotImplementedError as e:
        out["offload"] = f"NotImplementedError: {e}"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_hpz_rank, 4, tmp_path_factory.mktemp("hpz"), timeout=180)


def test_trains_bitwise_like_torch_fsdp2_and_like_resharding_to_all(results):
    for rank, r in enumerate(results):
        assert r["torch"] and r["torch_bf16"] and r["true"], f"rank {rank}: {r}"


def test_backward_gathers_two_rows_within_the_group_of_two(results):
    for rank, r in enumerate(results):
        # forward: this rank's 1 row over 4 ranks; backward: its 2 rows over its 2-rank group
        assert r["gathers"] == [("backward", 2), ("forward", 1)], f"rank {rank}: {r['gathers']}"
        assert r["group"] == ([0, 1] if rank < 2 else [2, 3]), f"rank {rank}: {r['group']}"
        assert r["logged_on_group"], f"rank {rank}: the order check does not log the group"


def test_sizes_follow_torchs_rules(results):
    r = results[0]
    assert r["not_a_factor"] == (
        "ValueError: If passing reshard_after_forward as an int, it should be a factor of 4, not 3"
    )
    assert any("reshard_after_forward=1 (int)" in w for w in r["one"]), r["one"]
    assert r["offload"] == (
        "NotImplementedError: reshard_after_forward as an int with CPUOffloadPolicy"
    )
