"""The canonical mode's promise, run: a 4-rank job's bits reproduced at 2 ranks and in one process.

    python scripts/invariance_demo.py [--steps 5]

Trains the same small GPT on the same global batches with ``fsdp_lite.Canonical`` (V = 8 virtual
micro-batches) three times: at 4 ranks with the FSDP1 front (FULL_SHARD), at 2 ranks with
``fully_shard``, and in this process on the plain module, with no process group. Prints each
run's SHA-1 of its final parameters and AdamW state and its last reported loss; they agree bit for
bit (docs/invariance.md). Each multi-rank run is one launch of this script's ranks.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_lite  # noqa: E402
from conformance.models import Block, GPTConfig, TinyLM  # noqa: E402
from fsdp_lite.tools.launch import launch_module, leave_together  # noqa: E402
from fsdp_lite.wrap import ModuleWrapPolicy  # noqa: E402

CONFIG = GPTConfig(vocab_size=61, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)
V = 8  # virtual micro-batches per global batch
GLOBAL_BATCH = 16  # sequences: 2 per micro-batch


def wrap(how: str, model: torch.nn.Module) -> torch.nn.Module:
    if how == "FULL_SHARD":
        return fsdp_lite.FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True
        )
    if how == "fully_shard":
        for block in model.blocks:
            fsdp_lite.fully_shard(block)
        fsdp_lite.fully_shard(model)
    return model  # "plain"


def train(how: str, steps: int) -> tuple[str, float]:
    """The SHA-1 of the final parameters and optimizer state (full, by name), the last loss."""
    torch.set_num_threads(1)  # the contract: the same thread count in every run
    torch.manual_seed(0)
    model = wrap(how, TinyLM(CONFIG))
    canon = fsdp_lite.Canonical(model, virtual_batches=V)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    canon.check_optimizer(optim)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(
            0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1), generator=g
        )
        losses = []
        for micro in canon.micro_batches(tokens):
            logits = model(micro[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), micro[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss.detach())
        canon.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        reported = canon.mean(losses)
    digest = hashlib.sha1()
    for p in model.parameters():
        tensors = [p, *(v for v in optim.state[p].values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            digest.update(bytes(full.detach().reshape(-1).view(torch.uint8).tolist()))
    return digest.hexdigest(), reported.item()


def run_rank(how: str, steps: int, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    sha, loss = train(how, steps)
    if dist.get_rank() == 0:
        Path(out).write_text(f"{sha} {loss!r}\n")
    leave_together()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank-run", nargs=2, metavar=("HOW", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_run:
        run_rank(args.rank_run[0], args.steps, args.rank_run[1])
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for nproc, how in ((4, "FULL_SHARD"), (2, "fully_shard")):
            out = os.path.join(scratch, f"{how}.txt")
            print(f"{nproc} ranks, {how}: training {args.steps} steps ...", flush=True)
            argv_ = ["--steps", str(args.steps), "--rank-run", how, out]
            if not launch_module("scripts.invariance_demo", argv_, nproc):
                return 1
            sha, loss = Path(out).read_text().split()
            runs.append((f"{nproc} ranks, {how}", sha, float(loss)))
    print("1 process, plain module, no process group: training ...", flush=True)
    runs.append(("1 process, plain module", *train("plain", args.steps)))
    print(f"\nfsdp_lite.Canonical(V={V}), {args.steps} AdamW steps, clip 1.0, TinyLM {CONFIG}")
    print(f"{'run':28} {'SHA-1 of params + AdamW state':42} last loss")
    for name, sha, loss in runs:
        print(f"{name:28} {sha:42} {loss!r}")
    same = len({(sha, loss) for _, sha, loss in runs}) == 1
    print(f"\nthe same bits in every run: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
