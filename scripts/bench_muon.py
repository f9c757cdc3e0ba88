"""What one optimizer step of ``fsdp_lite.Muon`` costs on the GPT of scripts/bench.py: time,
collectives and bytes, beside AdamW on the same matrices.

Each rank trains the seeded 13.8M-parameter GPT (6 blocks, d_model 384) wrapped by ``fully_shard``
per block and root (or the FSDP1 front), and steps the blocks' 24 weight matrices with the chosen
optimizer (the other parameters are not stepped: what is timed is the matrices' step). Per step:
the optimizer step's time (a barrier before it; the slowest rank's), every c10d collective it
issues (torch's CommDebugMode), and for ``fsdp_lite.Muon`` the numel and dtype each rank hands its
exchanges (fsdp_lite's trace) against the formula in docs/muon.md.

    python scripts/bench_muon.py [--world-size 2] [--steps 10] [--optim muon,adamw]
        [--front fully_shard|fsdp1] [--layers 6] [--d-model 384] [--threads 1] [--bucket-numel N]

To measure another commit's Muon, put its fsdp_lite first on PYTHONPATH (``git archive REF
fsdp_lite | tar -x -C DIR``; PYTHONPATH=DIR:.): the script reads whatever ``fsdp_lite`` imports.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import fsdp_lite  # noqa: E402
from conformance.models import Block, GPTConfig, TinyLM  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402
from fsdp_lite.trace import record_collectives  # noqa: E402


def build(args: argparse.Namespace, optim_name: str):
    cfg = GPTConfig(
        vocab_size=4096,
        seq_len=128,
        d_model=args.d_model,
        n_heads=6,
        n_layers=args.layers,
        d_ff=4 * args.d_model,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = TinyLM(cfg)
    if args.front == "fsdp1":
        model = fsdp_lite.FullyShardedDataParallel(
            model,
            auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({Block}),
            use_orig_params=True,
        )
    else:
        for block in model.blocks:
            fsdp_lite.fully_shard(block)
        fsdp_lite.fully_shard(model)
    matrices = [p for n, p in model.named_parameters() if "blocks." in n and p.ndim == 2]
    if optim_name == "muon":
        extra = {"bucket_numel": args.bucket_numel} if args.bucket_numel else {}
        optim = fsdp_lite.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw", **extra)
    else:
        optim = torch.optim.AdamW(matrices, lr=1e-3)
    return cfg, model, optim, matrices


def counted_step(optim) -> tuple[float, dict[str, int]]:
    """One ``optim.step()``: its seconds on this rank and every c10d collective it issued
    (torch's CommDebugMode, by op name)."""
    with CommDebugMode() as comm:
        start = time.perf_counter()
        optim.step()
        elapsed = time.perf_counter() - start
    return elapsed, {str(op): n for op, n in comm.get_comm_counts().items()}


def exchange_row(muon, matrices: list, records: list, steps: int, rank: int) -> dict:
    """What ``muon`` (an ``fsdp_lite.Muon`` watched by the trace that made ``records``) handed
    its exchanges per step over ``steps`` steps, beside docs/muon.md's formula:
    2 bytes x (this rank's elements of every matrix + every element of the matrices it owns)."""
    exchanges = [r for r in records if r.kind == "all_to_all"]
    mine = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in matrices)
    owned = [p for p in matrices if muon.whole.owner(p) == rank]
    return {
        "exchanges_per_step": len(exchanges) / steps,
        "bytes_handed_to_all_to_all_per_step": sum(r.nbytes for r in exchanges) / steps,
        "formula_bytes": 2 * (mine + sum(p.numel() for p in owned)),
        "owned_matrices": len(owned),
        "owned_cost": sum(p.shape[0] * p.shape[1] * min(p.shape) for p in owned),
    }


def run(rank: int, args: argparse.Namespace, rendezvous: str, out: dict) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    results = {}
    for optim_name in args.optim.split(","):
        cfg, model, optim, matrices = build(args, optim_name)
        if rank == 0 and hasattr(optim, "whole"):
            names = {p: n for n, p in model.named_parameters()}
            print(optim.whole.explain(names), flush=True)
        times, counts = [], {}
        watchable = hasattr(optim, "watch")
        with record_collectives(model, optim if watchable else None) as trace:
            for step in range(args.warmup + args.steps):
                g = torch.Generator().manual_seed(1000 * step + rank)
                idx = torch.randint(cfg.vocab_size, (4, cfg.seq_len), generator=g)
                logits = model(idx[:, :-1])
                F.cross_entropy(
                    logits.reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1)
                ).backward()
                dist.barrier()
                seconds, step_counts = counted_step(optim)
                elapsed = torch.tensor(seconds)
                optim.zero_grad()
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    times.append(elapsed.item() * 1e3)
                    for op, n in step_counts.items():
                        counts[op] = counts.get(op, 0) + n
        row = {
            "step_ms_median": statistics.median(times),
            "step_ms_min": min(times),
            "collectives_per_step": {op: n / args.steps for op, n in counts.items()},
        }
        if watchable and hasattr(optim, "whole"):
            row |= exchange_row(optim, matrices, trace.records, args.warmup + args.steps, rank)
        results[optim_name] = row
    out[rank] = results
    leave_together()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python scripts/bench_muon.py")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--optim", default="muon,adamw")
    parser.add_argument("--front", default="fully_shard", choices=("fully_shard", "fsdp1"))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--bucket-numel", type=int, default=0, help="Muon's bucket_numel (default 0: one bucket)"
    )
    args = parser.parse_args(argv)
    print(f"fsdp_lite from {os.path.dirname(fsdp_lite.__file__)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(run, args=(args, f"{tmp}/rendezvous", out), nprocs=args.world_size)
        for rank in sorted(out.keys()):
            for optim_name, row in out[rank].items():
                print(f"rank {rank} {optim_name}: {row}", flush=True)


if __name__ == "__main__":
    main()
