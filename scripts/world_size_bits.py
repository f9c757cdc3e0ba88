"""How many bits change when the same training runs at another world size (issue 26's measurement).

The same model, the same global batch (8 sequences, cut into N equal local batches), the same
AdamW steps, at N = 1, 2 and 4 ranks, for DDP, torch FSDP2 and fsdp_lite's two fronts. Every rank
computes the mean loss of its local batch; each system averages the gradients over the ranks, so
in exact arithmetic every N trains the same parameters. The report gives, per system and world
size, the largest difference from the N = 1 run over all parameters after each step, in units in
the last place (ulps) of the N = 1 value, and the losses' (the global batch's mean, gathered).
0 ulps everywhere is a world-size-invariant system: fsdp_lite's canonical mode (fsdp_lite.Canonical,
docs/invariance.md), which cuts the global batch into V = 4 micro-batches and sums them in one
fixed tree, is run beside the others.

    python scripts/world_size_bits.py [--world-sizes 1,2,4] [--steps 3] [--json PATH]

Each world size is one launch of this script's ranks (fsdp_lite.tools.launch); rank 0 writes the
full parameters after each step to a scratch file the parent compares.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_lite  # noqa: E402
from conformance.models import Block, GPTConfig, TinyLM  # noqa: E402
from fsdp_lite.tools.launch import launch_module, leave_together  # noqa: E402
from fsdp_lite.wrap import ModuleWrapPolicy  # noqa: E402

CONFIG = GPTConfig(vocab_size=61, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)
GLOBAL_BATCH = 8
SYSTEMS = (
    "ddp",
    "torch_fsdp2",
    "fsdp_lite/FULL_SHARD",
    "fsdp_lite/fully_shard",
    "fsdp_lite/FULL_SHARD/canonical",
    "fsdp_lite/fully_shard/canonical",
)
# fsdp_lite.Canonical's virtual micro-batches: 2 sequences each, a multiple of every world size here
VIRTUAL_BATCHES = 4


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def build(system: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyLM(CONFIG)
    system = system.removesuffix("/canonical")
    if system == "ddp":
        return DistributedDataParallel(model)
    if system == "fsdp_lite/FULL_SHARD":
        return fsdp_lite.FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True
        )
    api = fsdp_lite if system == "fsdp_lite/fully_shard" else torch.distributed.fsdp
    for block in model.blocks:
        api.fully_shard(block)
    api.fully_shard(model)
    return model


def full_params(system: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if system.startswith("fsdp_lite/FULL_SHARD"):
        with fsdp_lite.FullyShardedDataParallel.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    if system == "ddp":
        model = model.module
    full = {}
    for name, p in model.named_parameters():
        # A copy: on one rank full_tensor() may be the shard itself, which the next step updates.
        full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
    return full


def mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), y.reshape(-1))


def run_rank(steps: int, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    record: dict[str, list] = {}
    for system in SYSTEMS:
        model = build(system)
        canon = None
        if system.endswith("/canonical"):
            canon = fsdp_lite.Canonical(model, virtual_batches=VIRTUAL_BATCHES)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rows = []
        for step in range(steps):
            x, y = global_batch(step)
            if canon is None:
                mine = slice(rank * per_rank, (rank + 1) * per_rank)
                loss = mean_loss(model, x[mine], y[mine])
                loss.backward()
                reported = loss.detach().clone()
                dist.all_reduce(reported)
                reported /= world
            else:  # the global batch's V micro-batches, this rank's share of them
                losses = []
                for xm, ym in canon.micro_batches(x, y):
                    loss = mean_loss(model, xm, ym)
                    loss.backward()
                    losses.append(loss.detach())
                reported = canon.mean(losses)
            optim.step()
            optim.zero_grad()
            rows.append({"loss": reported.item(), "params": full_params(system, model)})
        record[system] = rows
    if rank == 0:
        torch.save(record, out)
    leave_together()
    dist.destroy_process_group()


def ulps(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest |value - reference| in units in the last place of ``reference``."""
    spacing = (
        torch.nextafter(reference, torch.full_like(reference, float("inf"))) - reference
    ).abs()
    return ((value - reference).abs() / spacing).max().item()


def compare(runs: dict[int, dict], steps: int) -> dict:
    base = runs[min(runs)]
    table: dict = {}
    for system in SYSTEMS:
        for world, record in sorted(runs.items()):
            rows = []
            for step in range(steps):
                ref, got = base[system][step], record[system][step]
                ddp = record["ddp"][step]["params"]
                rows.append(
                    {
                        "params_max_ulps": max(
                            ulps(got["params"][n], ref["params"][n]) for n in ref["params"]
                        ),
                        "params_max_abs": max(
                            (got["params"][n] - ref["params"][n]).abs().max().item()
                            for n in ref["params"]
                        ),
                        "loss_diff": abs(got["loss"] - ref["loss"]),
                        "bitwise_ddp": all(
                            torch.equal(got["params"][n], ddp[n]) for n in ref["params"]
                        ),
                    }
                )
            table.setdefault(system, {})[world] = rows
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write the table as JSON")
    parser.add_argument("--rank-run", nargs=2, metavar=("STEPS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_run:
        run_rank(int(args.rank_run[0]), args.rank_run[1])
        return 0
    worlds = [int(w) for w in args.world_sizes.split(",")]
    if any(GLOBAL_BATCH % w for w in worlds):
        parser.error(f"each world size must divide the global batch of {GLOBAL_BATCH}")
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for world in worlds:
            out = os.path.join(scratch, f"ws{world}.pt")
            print(f"world size {world}: {len(SYSTEMS)} systems, {args.steps} steps", flush=True)
            if not launch_module(
                "scripts.world_size_bits", ["--rank-run", str(args.steps), out], world
            ):
                return 1
            runs[world] = torch.load(out, weights_only=True)
    table = compare(runs, args.steps)
    base = min(worlds)
    print(
        f"\nafter the last of {args.steps} steps, against the {base}-rank run: the largest "
        "parameter difference in ulps and absolute, the loss difference; and whether the "
        "parameters equal DDP's at the same world size"
    )
    print(f"{'system':32} {'ranks':>5} {'max ulps':>12} {'max abs':>10} {'loss':>10}  = DDP")
    for system, per_world in table.items():
        for world, rows in per_world.items():
            last = rows[-1]
            print(
                f"{system:32} {world:>5} {last['params_max_ulps']:>12.3g} "
                f"{last['params_max_abs']:>10.2e} {last['loss_diff']:>10.2e}  "
                f"{'bitwise' if last['bitwise_ddp'] else 'differs'}"
            )
    if args.json:
        meta = {"world_sizes": worlds, "steps": args.steps, "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"config": meta, "table": table}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
