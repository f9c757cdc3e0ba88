"""What the collective-order check costs a step: one model, the check on and off in alternate steps.

    torchrun --nproc_per_node 2 scripts/bench_order_check.py [--steps 84] [bench.py's model flags]

scripts/bench.py compares two systems built side by side (``fsdp_lite/FULL_SHARD`` and
``.../no_order_check``); here one fsdp_lite FULL_SHARD model (the bench's GPT, one unit per
block) trains with ``set_collective_order_check`` toggled every step, after 4 warm-up steps, so
both settings share one build, its memory and the machine's load at that moment. Rank 0 prints,
per setting, the step time and the time spent inside the units' collective waits (where the
check's helper-thread hand-off would show), median and mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.engine.unit import ShardedUnit  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402

WARMUP = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=84, help="steps after warm-up, both settings")
    ours, rest = parser.parse_known_args()
    args = bench.parse_args(rest)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(args.threads)
    cfg = bench.model_config(args)
    spec = {s.name: s for s in bench.all_systems(dist.get_world_size())[0]}["fsdp_lite/FULL_SHARD"]
    system = bench.build_system(spec, "fp32", cfg, seed=0)

    in_waits = [0.0]
    wait = ShardedUnit._wait  # every wait of a unit's collectives goes through it

    def timed_wait(*a, **kw):
        start = time.perf_counter()
        try:
            return wait(*a, **kw)
        finally:
            in_waits[0] += time.perf_counter() - start

    ShardedUnit._wait = timed_wait
    seen: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for step in range(WARMUP + ours.steps):
        check = step % 2 == 1
        fsdp_lite.set_collective_order_check(system.model, check)
        inputs, targets = bench.make_batch(cfg, args.batch, 0, step, rank)
        dist.barrier()
        in_waits[0] = 0.0
        start = time.perf_counter()
        bench.train_step(system, inputs, targets)
        if step >= WARMUP:
            seen[check].append((time.perf_counter() - start, in_waits[0]))
    if rank == 0:
        print(f"{ours.steps // 2} steps per setting, world size {dist.get_world_size()}, fp32")
        for check in (True, False):
            steps, waits = zip(*seen[check])
            print(
                f"order check {'on ' if check else 'off'}: step median "
                f"{statistics.median(steps):.4f} s, mean {statistics.mean(steps):.4f} s; "
                f"in waits median {statistics.median(waits) * 1e3:.1f} ms, "
                f"mean {statistics.mean(waits) * 1e3:.1f} ms"
            )
    leave_together()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
