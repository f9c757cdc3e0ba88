"""Collective-order checks (fsdp_lite/tools/order.py): ranks that run different units are named quickly.

Ranks here are plain processes (tests/ranks.py), not under torchrun's agent, which would kill the
survivors; the process group's timeout is 30 s. Rank 1 skips the last block in its second forward:
without the check both ranks sat in gloo until the timeout ("Timed out waiting 20000ms for send
operation to complete" at 20 s); with it, both raise ``CollectiveOrderError`` within seconds,
naming the units, phase, step and ranks of the first collective they disagree on.
"""

from __future__ import annotations

import time

import pytest
import torch

import fsdp_lite
from fsdp_lite.tools.order import SCHEDULES, CollectiveOrderError, Issued, OrderLog, diverged
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_ranks


def _skipping_forward(model, skip: bool):
    def forward(idx):
        x = model.tok(idx) + model.pos[: idx.size(1)]
        for block in model.blocks[:-1] if skip else model.blocks:
            x = block(x)
        return model.head(model.ln_f(x))

    return forward


def _diverging_rank(
    rank: int, world_size: int, front: str, slow_only: bool, late_step: int = 2
) -> dict:
    model = build_model("lm_untied")
    if front == "fully_shard":
        for block in model.blocks:
            fsdp_lite.fully_shard(block)
        fsdp_lite.fully_shard(model)
        inner = model  # the module whose forward loops over the blocks
    else:
        model = fsdp_lite.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({type(model.blocks[0])})
        )
        inner = model.module
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    watched = []  # (step, watched?) per collective: Note [Watched and direct waits]
    issued = OrderLog.issued

    def logging_issued(log, step, *args):
        stall = issued(log, step, *args)
        watched.append((step, stall.watch))
        return stall

    OrderLog.issued = logging_issued
    start = time.monotonic()
    try:
        for step in range(1, late_step + 2):
            x, y = rank_batch("lm", step, rank, world_size)
            late = rank == 1 and step == late_step
            if late and slow_only:
                time.sleep(2.5)  # a slow rank, not a divergent one: no error
            if late and not slow_only:
                inner.forward = _skipping_forward(inner, skip=True)  # the hooks still run
            loss_fn("lm", model(x), y).backward()
            inner.__dict__.pop("forward", None)
            optim.step()
            optim.zero_grad()
    except CollectiveOrderError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "watched": watched}
    finally:
        OrderLog.issued = issued
    return {"error": None, "seconds": time.monotonic() - start, "watched": watched}


# Step 2: the first steps are watched on every rank. Step 4: rank 0 repeats a sequence it
# completed and waits directly; rank 1, skipping a block, runs a new one and watches, finds the
# divergence against the log rank 0's watchdog published, and exits; rank 0's wait then fails and
# names it from rank 1's log (Note [Watched and direct waits]).
@pytest.mark.parametrize("late_step", [2, 4])
@pytest.mark.parametrize("front", ["fully_shard", "FullyShardedDataParallel"])
def test_a_unit_skipped_on_one_rank_is_named_on_every_rank_within_seconds(
    tmp_path, front, late_step
):
    results = run_ranks(
        _diverging_rank, 2, tmp_path, args=(front, False, late_step), timeout=30, in_step=False
    )
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} saw no order error"
        assert r["seconds"] < 10, f"rank {rank} took {r['seconds']:.1f} s"
        assert r["error"].startswith("fsdp_lite: ranks diverged at collective"), r["error"]
        # Both ranks gather blocks.1 and blocks.0 in backward (rank 1's forward prefetch of the
        # block it skipped landed at the end of its forward), so the first collective they
        # disagree on is the first reduce-scatter.
        for who, unit in ((0, "blocks.1"), (1, "blocks.0")):
            expected = f"rank {who} reduce-scattered unit '{unit}' in backward of step {late_step}"
            assert expected in r["error"], r["error"]
    assert results[0]["error"] == results[1]["error"]
    if late_step == 4:
        for rank, r in enumerate(results):
            late = [watch for step, watch in r["watched"] if step == late_step]
            assert not any(watch for step, watch in r["watched"] if 2 < step < late_step), rank
            assert any(late) == (rank == 1), f"rank {rank} watched {late}"


@pytest.mark.parametrize("late_step", [2, 4])
def test_a_slow_rank_is_not_a_divergence(tmp_path, late_step):
    results = run_ranks(
        _diverging_rank, 2, tmp_path, args=("fully_shard", True, late_step), timeout=60
    )
    assert [r["error"] for r in results] == [None, None]


def test_only_collectives_at_new_positions_are_watched():
    log = OrderLog((0, 1))
    step_of = [("all_gather", "a", "forward"), ("all_gather", "b", "forward")]

    def run(step, entries):
        return [log.issued(step, kind, unit, phase, 8).watch for kind, unit, phase in entries]

    assert run(1, step_of) == [True, True], "nothing completed yet"
    assert run(2, step_of) == [False, False], "step 1's sequence again"
    skipping = [step_of[1], step_of[0]]
    assert run(3, skipping) == [True, True], "a new sequence from its first collective"
    assert run(4, step_of) == [False, False]
    assert run(5, skipping) == [False, False], "step 3's sequence, completed, is remembered"
    assert run(6, step_of[:1]) == [False], "a prefix of one remembered"
    for step in range(7, 7 + SCHEDULES):  # as many new sequences as are remembered
        run(step, [("all_gather", f"new{step}", "forward")])
    assert run(20, skipping) == [True, True], "forgotten after SCHEDULES newer sequences"


def _log(*entries: tuple, waiting_on: int) -> dict:
    issued = [
        Issued(seq, step, kind, unit, phase, 8)
        for seq, (step, kind, unit, phase) in enumerate(entries)
    ]
    return {"waiting_on": waiting_on, "entries": [vars(e) for e in issued]}


def test_diverged_names_the_first_collective_the_logs_disagree_on():
    logs = {
        0: _log(
            (1, "all_gather", "blocks.0", "forward"),
            (1, "all_gather", "blocks.1", "forward"),
            waiting_on=1,
        ),
        1: _log(
            (1, "all_gather", "blocks.0", "forward"),
            (1, "reduce_scatter", "", "backward"),
            waiting_on=1,
        ),
    }
    message = diverged([0, 1], logs)
    assert message.startswith(
        "fsdp_lite: ranks diverged at collective 1 of group [0, 1]: rank 0 all-gathered unit "
        "'blocks.1' in forward of step 1 (8 elements); rank 1 reduce-scattered unit '<root>' in "
        "backward of step 1 (8 elements). Every rank must run the same units"
    ), message


def test_diverged_is_none_for_logs_that_agree_as_far_as_they_go():
    first = (1, "all_gather", "blocks.0", "forward")
    logs = {0: _log(first, first, waiting_on=1), 1: _log(first, waiting_on=0)}
    assert diverged([0, 1, 2], logs) is None  # rank 2 has not published: maybe just slow


def test_diverged_names_ranks_waiting_on_different_collectives():
    first = (1, "all_gather", "blocks.0", "forward")
    logs = {0: _log(first, first, waiting_on=1), 1: _log(first, waiting_on=0)}
    message = diverged([0, 1], logs)
    assert message.startswith(
        "fsdp_lite: ranks [0, 1] wait on different collectives: rank 0 waits on collective 1 "
        "(all-gathered unit 'blocks.0' in forward of step 1 (8 elements)); rank 1 waits on "
        "collective 0"
    ), message


def _state_dict_on_rank_0_only(rank: int, world_size: int) -> dict:
    model = build_model("lm_untied")
    model = fsdp_lite.FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({type(model.blocks[0])})
    )
    start = time.monotonic()
    try:
        for step in (1, 2):
            if rank == 0 and step == 2:
                model.state_dict()  # the common bug: "only rank 0 saves", around a collective
            x, y = rank_batch("lm", step, rank, world_size)
            loss_fn("lm", model(x), y).backward()
    except CollectiveOrderError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_state_dict_on_one_rank_only_is_named_within_seconds(tmp_path):
    results = run_ranks(_state_dict_on_rank_0_only, 2, tmp_path, timeout=30, in_step=False)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} saw no order error"
        assert r["seconds"] < 10, f"rank {rank} took {r['seconds']:.1f} s"
        print(r["error"])
        assert "in state_dict of step" in r["error"], r["error"]
        assert "in forward of step 2" in r["error"], r["error"]
