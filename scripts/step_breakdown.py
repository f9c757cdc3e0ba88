"""Where a training step's time goes: forward, backward and optimizer step, per system, side by side.

    torchrun --nproc_per_node 2 scripts/step_breakdown.py [--systems ddp,FULL_SHARD,fsdp2] [--steps 8]
        [--profile FULL_SHARD]

The 13.8M-parameter GPT of scripts/bench.py (6 blocks, d_model 384, vocab 4096, seq 128, batch 4 per
rank), fp32, AdamW, one thread per rank. Systems are stepped in turn with a barrier before each step,
so a change in machine load falls on all of them alike. Prints rank 0's median milliseconds.
``FULL_SHARD``-style names are fsdp_lite strategies; ``--no-forward-prefetch`` turns its forward
prefetch off, to see what it buys. ``--profile SYSTEM`` then runs 3 more steps of one system under
``torch.profiler`` and prints rank 0's top operators by self CPU time, per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.models import Block  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402
from scripts import bench  # noqa: E402

CFG = bench.model_config(bench.parse_args([]))  # scripts/bench.py's default model


def build(kind: str, forward_prefetch: bool) -> torch.nn.Module:
    model = bench.build_model(CFG, seed=0)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    import fsdp_lite
    from fsdp_lite.wrap import ModuleWrapPolicy

    return fsdp_lite.FullyShardedDataParallel(
        model,
        sharding_strategy=fsdp_lite.ShardingStrategy[kind],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        forward_prefetch=forward_prefetch,
    )


def train_step(model, optim, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])  # (batch, seq_len, vocab)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def profile_steps(model, optim, batches: list, name: str, top: int, steps: int = 3) -> None:
    """Rank 0's top operators by self CPU time over ``steps`` steps, in ms per step."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            train_step(model, optim, batches[step % len(batches)])
    if dist.get_rank() != 0:
        return
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"{name}: top {top} operators by self CPU time, ms per step over {steps} steps, rank 0")
    for e in events[:top]:
        print(
            f"  {e.key[:60]:<60} {e.self_cpu_time_total / 1000 / steps:8.1f}  {e.count // steps:6d} calls"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", default="ddp,FULL_SHARD,SHARD_GRAD_OP,fsdp2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-forward-prefetch", action="store_true")
    parser.add_argument("--profile", metavar="SYSTEM", help="profile 3 steps of this system")
    parser.add_argument("--top", type=int, default=15, help="operators shown by --profile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kinds = args.systems.split(",")
    if args.profile and args.profile not in kinds:
        parser.error(f"--profile {args.profile}: not in --systems {args.systems}")
    models = {k: build(k, not args.no_forward_prefetch) for k in kinds}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [
        torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g) for _ in range(4)
    ]
    times: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    for step in range(args.steps + 2):  # 2 warm-up steps
        tokens = batches[step % len(batches)]
        for kind in kinds:
            model, optim = models[kind], optims[kind]
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1])  # (batch, seq_len, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optim.step()
            optim.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if step >= 2:
                for name, value in (
                    ("forward", t1 - t0),
                    ("backward", t2 - t1),
                    ("optim", t3 - t2),
                    ("total", t3 - t0),
                ):
                    times[kind].setdefault(name, []).append(value)
    if args.profile:
        profile_steps(models[args.profile], optims[args.profile], batches, args.profile, args.top)
    if rank == 0:
        print(f"median ms over {args.steps} steps, rank 0")
        for kind in kinds:
            cells = "  ".join(
                f"{n} {statistics.median(v) * 1000:7.1f}" for n, v in times[kind].items()
            )
            print(f"{kind:15s} {cells}")
    leave_together()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
