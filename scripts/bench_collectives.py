"""The backend's all-gather and reduce-scatter against fsdp_lite's sends, as the units call them.

    torchrun --nproc_per_node 2 scripts/bench_collectives.py [--numels 887232,1597824] [--iters 30]

For each shard numel (fp32; the defaults are a 6-block GPT's block and root shards at 2 ranks,
scripts/bench.py's model) it times ``fsdp_lite.engine.collectives.all_gather`` (in place, as a unit does)
and ``reduce_scatter``, each with the backend's own collective and with sends
(``collectives.Transport``: all_gather_by_sends, reduce_scatter_by_sends), and ``all_reduce`` of the same buffer,
alternating the variants so that machine load falls on each alike. It checks that both ways give
the same bits, and prints rank 0's median and quartiles in milliseconds (async issue to wait
return). docs/performance.md quotes its output.
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

from fsdp_lite.engine import collectives  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402


def all_gather(shard: torch.Tensor, transport: collectives.Transport | None) -> torch.Tensor:
    group = dist.group.WORLD
    slot, output = collectives.all_gather_buffers(shard.numel(), group, shard.dtype, shard.device)
    slot.copy_(shard)
    collectives.all_gather(
        slot, group, async_op=True, all_gather_output=output, transport=transport
    ).wait()
    return output


def reduce_scatter(shard: torch.Tensor, transport: collectives.Transport | None) -> torch.Tensor:
    world_size = dist.get_world_size()
    buffer = shard.repeat(world_size)  # a fresh (N * numel) input, as each backward packs one
    return collectives.reduce_scatter(
        buffer, dist.group.WORLD, async_op=True, transport=transport
    ).wait()


def all_reduce(shard: torch.Tensor, transport: collectives.Transport | None) -> torch.Tensor:
    buffer = shard.repeat(dist.get_world_size())
    return collectives.all_reduce(buffer, dist.group.WORLD, async_op=True).wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numels", default="887232,1597824", help="shard numels, comma-separated")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variants = [
        ("all_gather", "backend", all_gather),
        ("all_gather", "sends", all_gather),
        ("reduce_scatter", "backend", reduce_scatter),
        ("reduce_scatter", "sends", reduce_scatter),
        ("all_reduce", "backend", all_reduce),
    ]
    if world_size != 2:  # fsdp_lite reduce-scatters by sends at 2 ranks only (collectives.py)
        variants = [v for v in variants if v[:2] != ("reduce_scatter", "sends")]
    rows = []
    for numel in (int(n) for n in args.numels.split(",")):
        shard = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        times: dict[tuple[str, str], list[float]] = {(op, way): [] for op, way, _ in variants}
        results = {}
        for it in range(args.iters + 2):  # 2 warm-up rounds
            for op, way, fn in variants:
                transport = collectives.BACKEND if way == "backend" else None  # None: sends
                dist.barrier()
                start = time.perf_counter()
                out = fn(shard, transport)
                elapsed = time.perf_counter() - start
                if it >= 2:
                    times[(op, way)].append(elapsed * 1000)
                results[(op, way)] = out
        for op in ("all_gather", "reduce_scatter"):
            if (op, "sends") not in results:
                continue
            if not torch.equal(results[(op, "backend")], results[(op, "sends")]):
                raise SystemExit(f"rank {rank}: {op} by sends differs from the backend's")
        for (op, way), ms in times.items():
            q1, median, q3 = statistics.quantiles(ms, n=4)
            rows.append((numel, op, way, median, q1, q3))
    if rank == 0:
        print(f"gloo, {world_size} ranks, fp32, {args.iters} timed iterations, rank 0, ms")
        print(
            f"{'shard numel':>11}  {'MB':>5}  {'collective':<14} {'way':<8} {'median':>7} {'q1':>7} {'q3':>7}"
        )
        for numel, op, way, median, q1, q3 in rows:
            print(
                f"{numel:>11}  {numel * 4 / 1e6:>5.1f}  {op:<14} {way:<8} "
                f"{median:>7.2f} {q1:>7.2f} {q3:>7.2f}"
            )
        print("sends give the same bits as the backend's collectives: checked")
    leave_together()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
