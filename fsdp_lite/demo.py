"""The main job: train a tiny GPT under DDP and under each fsdp_lite strategy, then compare them.

``python -m fsdp_lite.demo`` launches itself on ``--nproc`` CPU ranks through torch's elastic launcher
(what torchrun runs); under torchrun it runs as one rank. Every rank trains the same seeded model on
its own character-level batches of data/tinytext.txt (original prose written for this project,
public domain), and rank 0 prints one table: loss and parameter differences from DDP, per-rank bytes
of params, grads and AdamW state, and bytes through collectives per step (from fsdp_lite.tools.trace).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.resources
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fsdp_lite import FullyShardedDataParallel, ShardingStrategy
from fsdp_lite.engine.collectives import all_gather_objects
from fsdp_lite.tools.launch import launch_module, leave_together
from fsdp_lite.tools.trace import record_collectives
from fsdp_lite.wrap import transformer_auto_wrap_policy

__all__ = ["main"]

MODES = ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")  # DDP first: the others compare to it
DATA_FILE = "data/tinytext.txt"
# Short, so that a rank left waiting on a dead peer gives up soon (the launcher kills it first anyway).
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


@dataclasses.dataclass
class RunResult:
    """What one rank measured in one mode; rank 0 merges these over ranks into a table row."""

    losses: list[float]  # this rank's loss at every step
    loss_diff: float  # max over steps of |loss - DDP's loss| on this rank
    param_diff: float  # max over parameters of |full param - DDP's| after the last step
    param_nbytes: int  # storage this rank holds between steps, padding included
    grad_nbytes: int
    optim_nbytes: int
    all_gather_nbytes: int  # per step: all_gather_output, world_size * this rank's all_gather_input
    reduce_scatter_nbytes: int  # per step: reduce_scatter_input
    all_reduce_nbytes: int  # per step: the all-reduced flat grads
    seconds_per_step: float  # median


# ---- command line and launch -------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    # Option names are not prefixes of torchrun's own (torchrun rejects a script option that is a prefix of one of its own, "--d"), except
    # --nproc, which only the self-launch reads; under torchrun pass --nproc-per-node instead.
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lite.demo",
        description="Train a tiny GPT under DDP and fsdp_lite's strategies and compare them.",
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks to launch (default 2); ignored under torchrun"
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="training steps per mode (default 30)"
    )
    parser.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument(
        "--seq-len", type=int, default=64, help="characters per sequence (default 64)"
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="sequences per rank per step (default 8)"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    parser.add_argument(
        "--log-every", type=int, default=10, help="progress line every N steps (default 10)"
    )
    args = parser.parse_args(argv)
    for name in ("nproc", "steps", "d_model", "layers", "heads", "seq_len", "batch", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    text_len = len(load_text())
    if args.seq_len + 1 >= text_len:
        parser.error(f"--seq-len {args.seq_len} does not fit in {DATA_FILE} ({text_len} chars)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun, or by launch() below
        run_rank(args)
        return 0
    return launch(args, argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this module on ``args.nproc`` local ranks."""
    return 0 if launch_module("fsdp_lite.demo", argv, args.nproc) else 1


# ---- one rank ----------------------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        text = load_text()
        vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(vocab)}
        data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        cfg = ModelConfig(
            vocab_size=len(vocab),
            seq_len=args.seq_len,
            d_model=args.d_model,
            n_heads=args.heads,
            n_layers=args.layers,
        )
        num_params = sum(p.numel() for p in build_model(cfg, args.seed).parameters())
        if rank == 0:
            say(
                f"fsdp_lite demo: world size {world_size}, CharGPT {args.layers} layers, d_model "
                f"{args.d_model}, vocab {len(vocab)} chars, {num_params:,} params; {args.steps} steps "
                f"of {args.batch} x {args.seq_len} chars per rank"
            )
        results: dict[str, RunResult] = {}
        ddp_losses: list[float] = []
        ddp_params: dict[str, torch.Tensor] = {}
        for mode in MODES:
            losses, full_params, result = train(mode, cfg, data, args)
            if mode == "DDP":
                ddp_losses, ddp_params = losses, full_params
            result.loss_diff = max(abs(a - b) for a, b in zip(losses, ddp_losses))
            result.param_diff = max_param_diff(full_params, ddp_params, mode)
            results[mode] = result
        everyone = all_gather_objects({m: dataclasses.asdict(r) for m, r in results.items()})
        if rank == 0:
            say(format_table(everyone, world_size, num_params, args))
        leave_together()  # every rank, then gloo's threads at rest (tools/launch.py)
    finally:
        dist.destroy_process_group()


def say(line: str) -> None:
    # stdout is often a pipe (torchrun, pytest, | tee): flush, or progress arrives at exit.
    print(line, flush=True)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int


class CharGPT(nn.Module):
    """The demo's model: a character-level GPT from torch's own layers (pre-norm causal
    ``TransformerEncoderLayer`` blocks, the units), its output projection tied to the embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # N(0, 1) would give tied logits of size ~sqrt(d_model) and a first loss near 50; GPT-2's
        # std 0.02 starts near log(vocab_size).
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.d_model,
                cfg.n_heads,
                4 * cfg.d_model,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, used twice in one forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=idx.device)
        x = self.tok(idx) + self.pos[:length]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


def build_model(cfg: ModelConfig, seed: int) -> CharGPT:
    torch.manual_seed(seed)  # same weights in every mode and on every rank
    return CharGPT(cfg)


def load_text() -> str:
    return importlib.resources.files("fsdp_lite").joinpath(DATA_FILE).read_text(encoding="utf-8")


def get_batch(
    data: torch.Tensor, args: argparse.Namespace, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) for ``step``: random windows of the text, the same in every mode."""
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + rank)
    starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch, 1), generator=g)
    window = starts + torch.arange(args.seq_len + 1)  # (batch, seq_len + 1)
    chars = data[window]
    return chars[:, :-1], chars[:, 1:]


def wrap(mode: str, model: CharGPT) -> torch.nn.Module:
    if mode == "DDP":
        return DistributedDataParallel(model)
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy[mode],
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={nn.TransformerEncoderLayer}
        ),
    )


def train(
    mode: str, cfg: ModelConfig, data: torch.Tensor, args: argparse.Namespace
) -> tuple[list[float], dict[str, torch.Tensor], RunResult]:
    """Train one mode from the seeded init; return its losses, full params after the last step, and stats."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = wrap(mode, build_model(cfg, args.seed))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses: list[float] = []
    seconds: list[float] = []
    trace = None
    for step in range(args.steps):
        inputs, targets = get_batch(data, args, step, rank)
        is_last = step == args.steps - 1
        # One step is traced: the last, when any prefetch order has settled.
        recording = (
            record_collectives(model) if is_last and mode != "DDP" else contextlib.nullcontext()
        )
        start = time.perf_counter()
        with recording as trace_or_none:
            optim.zero_grad(set_to_none=True)
            logits = model(inputs)  # (batch, seq_len, vocab_size)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            loss.backward()
            optim.step()
        seconds.append(time.perf_counter() - start)
        if trace_or_none is not None:
            trace = trace_or_none
        losses.append(loss.item())
        if step == 0 or is_last or (step + 1) % args.log_every == 0:
            mean_loss = torch.tensor(losses[-1])
            dist.all_reduce(mean_loss)  # every rank joins; only rank 0 prints
            if rank == 0:
                say(
                    f"{mode:<13} step {step + 1:>4}/{args.steps}  loss {mean_loss.item() / world_size:.4f}"
                )

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    optim_state = [
        t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    records = trace.records if trace is not None else []
    sent = {
        kind: sum(r.nbytes for r in records if r.kind == kind)
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }
    if mode == "DDP":
        # DDP's reducer is not traced: it all-reduces every parameter's gradient once per step.
        sent["all_reduce"] = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        full_params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    else:
        full_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = RunResult(
        losses=losses,
        loss_diff=0.0,
        param_diff=0.0,
        param_nbytes=storage_nbytes(model.parameters()),
        grad_nbytes=storage_nbytes(grads),
        optim_nbytes=storage_nbytes(optim_state),
        all_gather_nbytes=sent["all_gather"] * world_size,  # the trace records this rank's input
        reduce_scatter_nbytes=sent["reduce_scatter"],
        all_reduce_nbytes=sent["all_reduce"],
        seconds_per_step=statistics.median(seconds[1:] or seconds),  # step 1 builds buffers
    )
    return losses, full_params, result


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` on this rank (a DTensor counts its local shard).

    Counting storages, not tensor sizes, includes shard padding and counts a storage that several
    tensors view (the grads of one unit, views of one reduce_scatter_output) once.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def max_param_diff(
    full: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], mode: str
) -> float:
    if full.keys() != reference.keys():
        raise AssertionError(
            f"{mode}: state_dict keys differ from DDP's: only in {mode} "
            f"{sorted(full.keys() - reference.keys())}, only in DDP {sorted(reference.keys() - full.keys())}"
        )
    diffs = []
    for name, ref in reference.items():
        if full[name].shape != ref.shape:
            raise AssertionError(
                f"{mode}: {name} has shape {tuple(full[name].shape)}, DDP {tuple(ref.shape)}"
            )
        diffs.append((full[name] - ref).abs().max().item() if ref.numel() else 0.0)
    return max(diffs, default=0.0)


# ---- the report --------------------------------------------------------------------------------


def human_bytes(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 1024**2:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / 1024**2:.2f} MiB"


def format_diff(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def format_table(
    everyone: list[dict[str, dict]], world_size: int, num_params: int, args: argparse.Namespace
) -> str:
    """One row per mode, merged over ranks: mean final loss, max diffs, max bytes, rank 0's time."""
    columns = [
        ("mode", "<", 13),
        ("final loss", ">", 10),
        ("loss diff", ">", 9),
        ("param diff", ">", 10),
        ("params", ">", 10),
        ("grads", ">", 10),
        ("AdamW", ">", 10),
        ("all-gather", ">", 10),
        ("reduce-scatter", ">", 14),
        ("all-reduce", ">", 11),
        ("ms/step", ">", 7),
    ]

    def row(cells: list[str]) -> str:
        return "  ".join(
            f"{c:{align}{width}}" for c, (_, align, width) in zip(cells, columns)
        ).rstrip()

    def comm(nbytes: int, mark: str = "") -> str:
        return human_bytes(nbytes) + mark if nbytes else "-"

    header = row([name for name, _, _ in columns])
    lines = [
        "",
        f"fsdp_lite vs DDP: world size {world_size}, {num_params:,} params "
        f"({human_bytes(num_params * 4)} fp32), {args.steps} steps, AdamW lr {args.lr:g}, seed {args.seed}",
        header,
        "-" * len(header),
    ]
    for mode in MODES:
        per_rank = [r[mode] for r in everyone]
        final_loss = statistics.fmean(r["losses"][-1] for r in per_rank)
        biggest = {key: max(r[key] for r in per_rank) for key in per_rank[0] if key != "losses"}
        is_ref = mode == "DDP"
        lines.append(
            row(
                [
                    mode,
                    f"{final_loss:.4f}",
                    "(ref)" if is_ref else format_diff(biggest["loss_diff"]),
                    "(ref)" if is_ref else format_diff(biggest["param_diff"]),
                    human_bytes(biggest["param_nbytes"]),
                    human_bytes(biggest["grad_nbytes"]),
                    human_bytes(biggest["optim_nbytes"]),
                    comm(biggest["all_gather_nbytes"]),
                    comm(biggest["reduce_scatter_nbytes"]),
                    comm(biggest["all_reduce_nbytes"], "*" if is_ref else ""),
                    f"{per_rank[0]['seconds_per_step'] * 1e3:.1f}",
                ]
            )
        )
    lines += [
        "",
        "final loss: last step's loss, mean over ranks. loss diff: max over steps and ranks of |loss - DDP's|.",
        "param diff: max |param - DDP's| over all full parameters after the last step (0 = bitwise equal).",
        "params, grads, AdamW: bytes per rank between steps (max over ranks), local shards incl. padding.",
        f"all-gather (output), reduce-scatter (input), all-reduce: bytes per rank in step {args.steps}, "
        "from fsdp_lite.tools.trace.",
        "* DDP is not traced: its all-reduce bytes are computed, one all-reduce of every parameter's grad.",
        "ms/step: median over steps after the first, on rank 0, forward + backward + AdamW step.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
