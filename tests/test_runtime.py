"""The schedule: which collectives each strategy issues per step, and when memory is freed."""

from __future__ import annotations

import pytest
import torch

from fsdp_lite import BackwardPrefetch, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.engine.unit import ShardedState
from fsdp_lite.trace import record_collectives
from tests.parity import POLICIES, build_model, loss_fn, rank_batch
from tests.ranks import run_ranks


def _schedule_rank(rank: int, world_size: int, strategy_name: str, prefetch_name: str) -> dict:
    strategy = ShardingStrategy[strategy_name]
    prefetch = (
        BackwardPrefetch[prefetch_name] if prefetch_name in BackwardPrefetch.__members__ else None
    )
    model = FSDP(
        build_model("lm"),
        sharding_strategy=strategy,
        auto_wrap_policy=POLICIES["lm"],
        backward_prefetch=prefetch,
        forward_prefetch=prefetch_name == "FORWARD",
    )
    wrappers = FSDP.fsdp_modules(model)
    units = [w._unit for w in wrappers]
    x, y = rank_batch("lm", 0, rank, world_size)
    loss_fn("lm", model(x), y).backward()  # first step records the order; trace the second
    with record_collectives(model) as trace:
        loss_fn("lm", model(x), y).backward()
    counts = {
        (r.kind, r.phase): sum(1 for s in trace.records if (s.kind, s.phase) == (r.kind, r.phase))
        for r in trace.records
    }
    per_unit = {}
    for r in trace.records:
        per_unit.setdefault((r.kind, r.phase, r.unit), 0)
        per_unit[(r.kind, r.phase, r.unit)] += 1
    backward_gathers = [r for r in trace.records if (r.kind, r.phase) == ("all_gather", "backward")]
    root_backward = next(s for s in trace.spans if (s.unit, s.phase) == ("", "backward"))
    return {
        "num_units": len(units),
        "block_names": [u.name for u in units if u.name],
        "counts": counts,
        "per_unit": per_unit,
        "reduce_dtypes": {r.dtype for r in trace.records if r.kind != "all_gather"},
        "backward_gather_order": [r.unit for r in backward_gathers],
        "first_backward_gather_before_root_backward": bool(backward_gathers)
        and backward_gathers[0].start < root_backward.start,
    }


@pytest.mark.parametrize("prefetch_name", ["BACKWARD_PRE", "BACKWARD_POST", "NONE", "FORWARD"])
def test_full_shard_gathers_once_per_unit_each_way_and_reduce_scatters_once(
    tmp_path, prefetch_name
):
    result = run_ranks(_schedule_rank, 2, tmp_path, args=("FULL_SHARD", prefetch_name))[0]
    num_units = result["num_units"]  # root + 2 blocks
    counts = result["counts"]
    assert counts[("all_gather", "forward")] == num_units, counts
    # The root keeps its parameters from forward into backward, as torch FSDP does.
    assert counts[("all_gather", "backward")] == num_units - 1, counts
    assert counts[("reduce_scatter", "backward")] == num_units, counts
    assert ("all_reduce", "backward") not in counts, counts
    assert all(n == 1 for n in result["per_unit"].values()), result["per_unit"]
    assert result["reduce_dtypes"] == {torch.float32}


def test_backward_pre_prefetches_the_last_block_from_the_root_before_its_backward(tmp_path):
    # Note [Backward order]: the root ends its forward last, so it is first in backward and the
    # last block comes next; its all-gather starts in the root's pre-backward, not blocking later.
    result = run_ranks(_schedule_rank, 2, tmp_path, args=("FULL_SHARD", "BACKWARD_PRE"))[0]
    assert result["backward_gather_order"] == sorted(result["block_names"], reverse=True)
    assert result["first_backward_gather_before_root_backward"]


def test_shard_grad_op_never_gathers_in_backward(tmp_path):
    result = run_ranks(_schedule_rank, 2, tmp_path, args=("SHARD_GRAD_OP", "BACKWARD_PRE"))[0]
    counts = result["counts"]
    assert counts[("all_gather", "forward")] == result["num_units"], counts
    assert ("all_gather", "backward") not in counts, counts
    assert counts[("reduce_scatter", "backward")] == result["num_units"], counts


def test_no_shard_only_all_reduces(tmp_path):
    result = run_ranks(_schedule_rank, 2, tmp_path, args=("NO_SHARD", "BACKWARD_PRE"))[0]
    assert set(result["counts"]) == {("all_reduce", "backward")}, result["counts"]
    assert result["counts"][("all_reduce", "backward")] == result["num_units"]


def _memory_after_forward_rank(rank: int, world_size: int, strategy_name: str) -> dict:
    model = FSDP(
        build_model("lm"),
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=POLICIES["lm"],
    )
    seen = {}

    def after_forward(wrapper, args, output):
        unit = wrapper._unit
        seen[unit.name] = (
            unit.state.name,
            sum(p.unsharded_flat.untyped_storage().nbytes() for p in unit.params),
            # what the wrapped modules hold right now: the shards, or the unsharded params
            all(m._parameters[n] is p.sharded_param for p in unit.params for m, n in p.locations),
        )

    for w in FSDP.fsdp_modules(model):
        w.register_forward_hook(after_forward)
    x, y = rank_batch("lm", 0, rank, world_size)
    loss = loss_fn("lm", model(x), y)
    after_backward_ready = dict(seen)
    loss.backward()
    at_rest = {
        w._unit.name: (
            w._unit.state.name,
            sum(p.unsharded_flat.untyped_storage().nbytes() for p in w._unit.params),
        )
        for w in FSDP.fsdp_modules(model)
    }
    return {"after_forward": after_backward_ready, "at_rest": at_rest}


def test_full_shard_frees_unsharded_params_after_forward(tmp_path):
    result = run_ranks(_memory_after_forward_rank, 2, tmp_path, args=("FULL_SHARD",))[0]
    for name, (state, nbytes, holds_shards) in result["after_forward"].items():
        if name == "":  # the root keeps its parameters for backward
            assert state == ShardedState.UNSHARDED.name, result
            continue
        assert (state, nbytes, holds_shards) == ("SHARDED", 0, True), (name, result)
    for name, (state, nbytes) in result["at_rest"].items():
        assert (state, nbytes) == ("SHARDED", 0), (name, result)


def test_shard_grad_op_keeps_unsharded_params_until_backward(tmp_path):
    result = run_ranks(_memory_after_forward_rank, 2, tmp_path, args=("SHARD_GRAD_OP",))[0]
    for name, (state, nbytes, holds_shards) in result["after_forward"].items():
        assert state == "UNSHARDED" and nbytes > 0 and not holds_shards, (name, result)
    for name, (state, nbytes) in result["at_rest"].items():
        assert (state, nbytes) == ("SHARDED", 0), (name, result)


def _profiler_labels_rank(rank: int, world_size: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    model = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"])
    x, y = rank_batch("lm", 0, rank, world_size)
    loss_fn("lm", model(x), y).backward()  # the first step records the order
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn("lm", model(x), y).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp_lite::")})


def test_torch_profiler_shows_each_stage_per_unit_in_the_glossarys_words(tmp_path):
    labels = run_ranks(_profiler_labels_rank, 2, tmp_path, timeout=120)[0]
    for unit in ("blocks.0", "blocks.1"):
        for stage in ("all_gather", "wait_for_unshard", "reduce_scatter", "finish_reduce"):
            assert f"fsdp_lite::{stage} {unit}" in labels, labels
    assert "fsdp_lite::reduce_scatter <root>" in labels, labels
