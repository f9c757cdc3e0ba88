"""tests/ranks.py itself: results, collectives, and how failures, hangs and crashes are reported."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.ranks import RankFailure, RankTimeout, run_ranks


def _report_rank(rank, world_size, tag):
    return (rank, world_size, dist.get_rank(), dist.get_world_size(), tag)


def _all_reduce_rank(rank, world_size):
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return tensor.item()


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def _exit_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def test_results_come_back_in_rank_order_with_args(tmp_path):
    results = run_ranks(_report_rank, 2, tmp_path, args=("x",))
    assert results == [(0, 2, 0, 2, "x"), (1, 2, 1, 2, "x")]


def test_all_reduce_sums_over_three_ranks(tmp_path):
    assert run_ranks(_all_reduce_rank, 3, tmp_path) == [6.0, 6.0, 6.0]


def test_rank_that_raises_is_named_with_its_traceback(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, 2, tmp_path)
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom" in message
    assert "_raise_on_rank_1" in message  # the child's own frame, not just the exception line


def test_hung_rank_is_killed_and_named_after_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank 0 of 2 still running") as info:
        run_ranks(_hang_on_rank_0, 2, tmp_path, timeout=10, in_step=False)
    assert "rank 1" not in str(info.value)
    assert time.monotonic() - start < 20


def test_rank_that_exits_without_reporting_shows_its_exit_code(tmp_path):
    with pytest.raises(RankFailure, match=r"rank 1 of 2 exited without reporting.*exit code 3"):
        run_ranks(_exit_on_rank_1, 2, tmp_path)


def _raise_late_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(0.5)  # rank 0 reports first, failing on a dead peer, yet rank 1 is the cause
        raise ValueError("boom")
    dist.barrier()
    return rank


def _exit_while_rank_0_waits(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()  # fails on the dead peer and reports, while rank 1 reported nothing
    return rank


@pytest.mark.parametrize(
    ("fn", "cause"),
    [
        (_raise_late_on_rank_1, r"^rank 1 of 2 failed:.*ValueError: boom"),
        (_exit_while_rank_0_waits, r"^rank 1 of 2 exited without reporting.*exit code 3"),
    ],
)
def test_the_cause_is_named_when_a_peer_fails_because_of_it(tmp_path, fn, cause):
    with pytest.raises(RankFailure) as info:
        run_ranks(fn, 2, tmp_path, in_step=False)
    message = str(info.value)
    assert re.search(cause, message, re.S), message
    assert "\nthen:\n  rank 0 of 2 failed:" in message, message


def test_importing_fsdp_lite_starts_no_thread():
    """tests/ranks.py preloads fsdp_lite in the forkserver, which forks every rank: a thread started
    there would be missing in the ranks, and a lock it held would stay held."""
    code = (
        "import os, torch, torch.distributed\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "import fsdp_lite\n"
        "after = len(os.listdir('/proc/self/task'))\n"
        "assert after == before, (before, after)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
