"""A gloo group for the pytest-benchmark cases: this pytest process is rank 0, the others follow.

Rank 0 tells the other ranks (scripts/bench.py ``follow_rank0``) which system to build and how many
steps to train, then trains it too while pytest-benchmark times its steps. The group is made once
per session and shared by every case. Not collected by a plain ``pytest`` (testpaths = tests):

    pytest benchmarks/ [--bench-world-size 2] [--bench-steps 20] [--bench-tiny]
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from fsdp_lite.tools.launch import leave_together
from scripts import bench


def pytest_addoption(parser) -> None:
    group = parser.getgroup("fsdp_lite benchmarks")
    group.addoption("--bench-world-size", type=int, default=2, help="ranks (default 2)")
    group.addoption("--bench-steps", type=int, default=20, help="timed steps per case (default 20)")
    group.addoption("--bench-warmup", type=int, default=2, help="untimed steps first (default 2)")
    group.addoption(
        "--bench-tiny",
        action="store_true",
        help="a 2-block, d_model 32 model instead of the 13.8M-param GPT (a quick check)",
    )


@dataclass(frozen=True)
class Ranks:
    world_size: int
    cfg: bench.GPTConfig
    batch: int
    seed: int
    steps: int
    warmup: int


@pytest.fixture(scope="session")
def ranks(request) -> Iterator[Ranks]:
    option = request.config.getoption
    world_size = option("--bench-world-size")
    # scripts/bench.py's defaults: the 13.8M-param GPT; --bench-tiny: a 2-block one.
    tiny = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq-len", "16"]
    args = bench.parse_args(tiny if option("--bench-tiny") else [])
    threads = 1  # world_size ranks on few cores: more threads per rank only oversubscribe them
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        followers = [
            ctx.Process(target=bench.follow_rank0, args=(rank, world_size, init_method, threads))
            for rank in range(1, world_size)
        ]
        for p in followers:
            p.start()
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=0,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=300),
        )
        try:
            yield Ranks(
                world_size,
                bench.model_config(args),
                args.batch,
                args.seed,
                option("--bench-steps"),
                option("--bench-warmup"),
            )
            bench.broadcast_command(None)
            leave_together()  # as the followers do after the stop
        finally:
            dist.destroy_process_group()
            torch.set_num_threads(previous_threads)
            for p in followers:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()  # only after a failed case: it is waiting on a collective
                    p.join()
