"""Trace a few training steps of a tiny GPT on CPU ranks and draw what each rank did.

    python scripts/trace_demo.py --out DIR [--strategy FULL_SHARD] [--steps 3] [--cpu-offload] [--bf16]
    python scripts/trace_demo.py --docs docs/figures    # every figure of the docs/ pages
    python scripts/trace_demo.py --out DIR --steps 2 --chrome DIR/trace.json [--torch-profile]
                                                        # + DIR/trace.html, its offline viewer

Writes DIR/timeline.png (each unit's compute and collectives per rank, last step), DIR/memory.png
(bytes by category per rank over the last step), DIR/explain.txt (every rank's sharding plan),
DIR/summary.txt (collectives, memory and the planner's numbers) and DIR/trace_rank{R}.json (the raw
trace). Without matplotlib it writes the text and JSON, says the PNGs need ``pip install -e .[plot]``
and exits 0; with ``--png`` (and always with ``--docs``) a missing matplotlib is an error before
any rank starts. ``--chrome FILE`` also writes every rank's trace as one Trace Event Format file
(Perfetto, chrome://tracing; ``fsdp_lite.trace.write_chrome_trace``), with torch.profiler's CPU ops
of the same steps beside it under ``--torch-profile``, and FILE with ``.html``, the same trace drawn
by a page that needs no network (``fsdp_lite.tools.trace_view``). Ranks launch themselves as
``python -m fsdp_lite.demo`` does, or run under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from conformance.models import Block, GPTConfig, TinyLM
from fsdp_lite import (
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from fsdp_lite.demo import PROCESS_GROUP_TIMEOUT, human_bytes, say
from fsdp_lite.engine.collectives import all_gather_objects
from fsdp_lite.tools.estimate import estimate
from fsdp_lite.tools.launch import launch_module, leave_together
from fsdp_lite.tools.trace_view import write_trace_html
from fsdp_lite.trace import (
    CollectiveTrace,
    explain,
    plot_memory,
    plot_timeline,
    record_collectives,
    write_chrome_trace,
)
from fsdp_lite.wrap import transformer_auto_wrap_policy

REPO_ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")
CFG = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256)
BATCH = 4  # sequences per rank per step


def build_model(cfg: GPTConfig, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(cfg)
    # The head is tied to the embedding: GPT-2's std 0.02 starts the loss near log(vocab_size).
    torch.nn.init.normal_(model.tok.weight, std=0.02)
    return model


@dataclasses.dataclass
class Job:
    """One traced run: a strategy and its options, and where its files go (``prefix`` + name)."""

    prefix: str  # "" for --out, "zero3_" etc. for --docs
    strategy: str
    cpu_offload: bool = False
    bf16: bool = False  # MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)
    nproc: int = 2
    state_dict_figure: bool = False  # also trace a FULL and a SHARDED model.state_dict()
    chrome: str | None = None  # also write the steps as a Chrome trace, to this file
    torch_profile: bool = False  # with torch.profiler's CPU ops in it

    @property
    def title(self) -> str:
        extras = [" + CPU offload"] * self.cpu_offload + [" + bf16 params, fp32 reduce"] * self.bf16
        return f"{self.strategy}{''.join(extras)}, {self.nproc} ranks"


# The figures of the docs/ pages, one job each (HYBRID_SHARD needs 2 replicas x 2 shards).
DOCS_JOBS = (
    Job("ddp_", "NO_SHARD"),
    Job("zero1_", "SHARD_OPTIM"),
    Job("zero2_", "SHARD_GRAD_OP"),
    Job("zero3_", "FULL_SHARD", state_dict_figure=True),
    Job("offload_", "FULL_SHARD", cpu_offload=True),
    Job("mixed_precision_", "FULL_SHARD", bf16=True),
    Job("hybrid_", "HYBRID_SHARD", nproc=4),
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python scripts/trace_demo.py",
        description="Trace a tiny GPT's training steps on CPU ranks; write timeline and memory PNGs.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="directory for one strategy's files")
    where.add_argument("--docs", type=Path, help="directory for every docs/ figure")
    parser.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD")
    parser.add_argument("--steps", type=int, default=3, help="steps to run and trace (default 3)")
    parser.add_argument(
        "--cpu-offload", action="store_true", help="CPUOffload(offload_params=True)"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 params, fp32 gradient reduction")
    parser.add_argument(
        "--nproc", type=int, help="ranks (default 2; HYBRID_SHARD: 4, as 2 replicas x nproc/2)"
    )
    parser.add_argument("--png", action="store_true", help="fail if matplotlib is missing")
    parser.add_argument(
        "--chrome", type=Path, help="also write a Chrome trace JSON file (with --out only)"
    )
    parser.add_argument(
        "--torch-profile",
        action="store_true",
        help="merge torch.profiler's CPU ops of the traced steps into the --chrome file",
    )
    # What the launcher hands its ranks: the runs, and whether the launcher found matplotlib.
    parser.add_argument("--jobs-json", help=argparse.SUPPRESS)
    parser.add_argument("--skip-png", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.chrome and args.docs:
        parser.error("--chrome goes with --out (one run), not --docs")
    if args.torch_profile and not args.chrome:
        parser.error("--torch-profile needs --chrome")
    nproc = args.nproc or (4 if args.strategy == "HYBRID_SHARD" else 2)
    if nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.strategy == "HYBRID_SHARD" and (nproc < 4 or nproc % 2):
        parser.error("HYBRID_SHARD needs an even --nproc of at least 4 (2 replicas)")
    if args.cpu_offload and args.strategy == "NO_SHARD":
        parser.error("--cpu-offload needs a sharded strategy")
    args.nproc = nproc
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = (args.docs or args.out).resolve()
    chrome = args.chrome.resolve() if args.chrome else None
    if args.jobs_json:
        jobs = [Job(**j) for j in json.loads(args.jobs_json)]
    elif args.docs:
        jobs = list(DOCS_JOBS)
    else:
        chrome_file = str(chrome) if chrome else None
        jobs = [
            Job(
                "",
                args.strategy,
                args.cpu_offload,
                args.bf16,
                args.nproc,
                chrome=chrome_file,
                torch_profile=args.torch_profile,
            )
        ]
    has_matplotlib = _has_matplotlib()
    if "RANK" in os.environ:  # one rank, under torchrun or our own launch below
        run_rank(jobs, out, args.steps, png=has_matplotlib and not args.skip_png)
        return 0
    if not has_matplotlib and (args.png or args.docs):
        print("trace_demo: the PNGs need matplotlib: pip install -e '.[plot]'", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if chrome:
        chrome.parent.mkdir(parents=True, exist_ok=True)
    # The ranks run `python -m scripts.trace_demo`: from the repo root, so `scripts` imports.
    os.chdir(REPO_ROOT)
    for nproc in sorted({j.nproc for j in jobs}):
        group = [dataclasses.asdict(j) for j in jobs if j.nproc == nproc]
        print(
            f"trace_demo: {nproc} ranks, {len(group)} run(s), {args.steps} steps each", flush=True
        )
        rank_argv = [
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--jobs-json",
            json.dumps(group),
        ]
        rank_argv += [] if has_matplotlib else ["--skip-png"]
        if not launch_module("scripts.trace_demo", rank_argv, nproc):
            return 1
    if not has_matplotlib:
        print("trace_demo: no matplotlib, so no PNGs; install them with pip install -e '.[plot]'")
    print(f"trace_demo: wrote {out}" + (f" and {chrome}" if chrome else ""))
    return 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ---- one rank ----------------------------------------------------------------------------------


def run_rank(jobs: list[Job], out: Path, steps: int, png: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        for job in jobs:
            run_job(job, out, steps, png)
        leave_together()  # every rank, then gloo's threads at rest (launch.py)
    finally:
        dist.destroy_process_group()


def wrap(job: Job) -> FullyShardedDataParallel:
    model = build_model(CFG, seed=0)  # the same weights on every rank
    kwargs = {}
    if job.strategy == "HYBRID_SHARD":
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (2, job.nproc // 2), mesh_dim_names=("replicate", "shard")
        )
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy[job.strategy],
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        cpu_offload=CPUOffload(offload_params=job.cpu_offload),
        mixed_precision=(
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if job.bf16
            else None
        ),
        **kwargs,
    )


def train_traced(
    job: Job, steps: int, profile: Path | None = None
) -> tuple[FullyShardedDataParallel, CollectiveTrace]:
    """Train ``steps`` AdamW steps of the demo model under ``job``'s strategy, traced; with
    ``profile``, under torch.profiler too, whose Chrome trace goes to that file."""
    rank = dist.get_rank()
    model = wrap(job)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profiler = contextlib.nullcontext()
    if profile is not None:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    dist.barrier()  # start the traces together: each rank's clock starts at its own trace
    with profiler as prof, record_collectives(model, optim) as trace:
        for step in range(steps):
            started = time.perf_counter()
            optim.zero_grad(set_to_none=True)  # here, so the grads show until the step's end
            g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
            tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
            logits = model(tokens[:, :-1])  # (batch, seq_len, vocab_size)
            loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))
            loss.backward()
            with trace.span("optimizer"):
                optim.step()
            if rank == 0:
                ms = (time.perf_counter() - started) * 1e3
                print(
                    f"  {job.title}: step {step + 1}/{steps} loss {loss.item():.4f} ({ms:.0f} ms)",
                    flush=True,
                )
    if profile is not None:
        prof.export_chrome_trace(str(profile))
    return model, trace


def run_job(job: Job, out: Path, steps: int, png: bool) -> None:
    rank = dist.get_rank()
    chrome = Path(job.chrome) if job.chrome else None
    profile = None
    if chrome and job.torch_profile:  # kept beside the merged file: torch's own view of the rank
        profile = chrome.with_name(f"{chrome.stem}_torch_rank{rank}.json")
    model, trace = train_traced(job, steps, profile)
    if chrome:
        doc = write_chrome_trace(trace, chrome, profile=profile)
        if rank == 0:
            say(f"  wrote {chrome}")
            ops = " and torch.profiler's CPU ops" if profile else ""
            title = f"{job.title}: {steps} steps of a TinyLM, fsdp_lite's trace{ops}"
            say(f"  wrote {write_trace_html(doc, chrome.with_suffix('.html'), title)}")
    if job.state_dict_figure:
        trace_state_dicts(model, out, png)
    data = trace.to_json()
    if not job.prefix:  # --out: the raw trace of every rank; --docs keeps only the figures
        (out / f"trace_rank{rank}.json").write_text(json.dumps(data))
    everyone = all_gather_objects((data, explain(model)))
    if rank != 0:
        return
    traces = [CollectiveTrace.from_json(d) for d, _ in everyone]
    plans = [f"# rank {r}\n{text}\n" for r, (_, text) in enumerate(everyone)]
    write(out / f"{job.prefix}explain.txt", "\n".join(plans))
    write(out / f"{job.prefix}summary.txt", summary(job, traces))
    if png:
        title = f"{job.title}: step {steps} of a TinyLM (2 blocks, d_model {CFG.d_model})"
        plot_timeline(traces, out / f"{job.prefix}timeline.png", title=title)
        say(f"  wrote {out / f'{job.prefix}timeline.png'}")
        plot_memory(traces, out / f"{job.prefix}memory.png", title=title)
        say(f"  wrote {out / f'{job.prefix}memory.png'}")


def trace_state_dicts(model: FullyShardedDataParallel, out: Path, png: bool) -> None:
    """A FULL (rank 0 only, on CPU) then a SHARDED ``model.state_dict()``, traced, into one figure."""
    full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    dist.barrier()
    with record_collectives(model) as trace:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, full):
            with trace.span("FULL state_dict()"):
                model.state_dict()
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            with trace.span("SHARDED state_dict()"):
                model.state_dict()
    everyone = all_gather_objects(trace.to_json())
    if dist.get_rank() == 0 and png:
        traces = [CollectiveTrace.from_json(d) for d in everyone]
        path = out / "state_dict_timeline.png"
        plot_timeline(traces, path, title="FULL_SHARD, 2 ranks: a FULL then a SHARDED state dict")
        say(f"  wrote {path}")


def write(path: Path, text: str) -> None:
    path.write_text(text)
    say(f"  wrote {path}")


# ---- the summary -------------------------------------------------------------------------------


def summary(job: Job, traces: list[CollectiveTrace]) -> str:
    """The last step per rank: collectives by kind and phase, memory, and the planner's row."""
    last = max(s.step for s in traces[0].spans)
    shape = f"{CFG.n_layers} blocks, d_model {CFG.d_model}, vocab {CFG.vocab_size}"
    lines = [f"{job.title}, TinyLM ({shape}), AdamW, step {last + 1} of each rank's trace", ""]
    lines.append("collectives (count, bytes of this rank's input):")
    for t in traces:
        counts: Counter = Counter()
        nbytes: Counter = Counter()
        for r in t.records:
            if r.step == last:
                counts[(r.kind, r.phase)] += 1
                nbytes[(r.kind, r.phase)] += r.nbytes
        cells = [f"{k} {p} x{counts[(k, p)]} {human_bytes(nbytes[(k, p)])}" for k, p in counts]
        lines.append(f"  rank {t.rank}: " + ", ".join(cells))
    lines += ["", "memory (storage accounting, summed over units):"]
    for t in traces:
        samples = [m for m in t.memory if m.step == last]
        end = samples[-1]
        peak = max(samples, key=lambda m: m.total())
        working = max(
            samples,
            key=lambda m: sum(
                m.total(c) for c in ("unsharded_params", "unsharded_grads", "comm_buffers")
            ),
        )
        states = ", ".join(f"{c} {human_bytes(end.total(c))}" for c in ("params", "grads", "optim"))
        lines.append(f"  rank {t.rank} after the step: {states}")
        lines.append(
            f"  rank {t.rank} peak {human_bytes(peak.total())} at '{peak.event}'; working set peak "
            f"(unsharded_params {human_bytes(working.total('unsharded_params'))}, unsharded_grads "
            f"{human_bytes(working.total('unsharded_grads'))}, comm_buffers "
            f"{human_bytes(working.total('comm_buffers'))}) at '{working.event}'"
        )
    with torch.device("meta"):  # the planner counts the unwrapped model
        unwrapped = TinyLM(CFG)
    plan = estimate(
        unwrapped,
        job.nproc,
        shard_size=job.nproc // 2 if job.strategy == "HYBRID_SHARD" else None,
        param_itemsize=2 if job.bf16 else 4,
        grad_itemsize=4,
        offload=job.cpu_offload,
        unit_classes={Block},
    )
    row = plan[job.strategy]
    lines += [
        "",
        f"planner (fsdp_lite.estimate, {plan.numel:,} params, world size {job.nproc}, "
        f"units {list(plan.unit_numels or ())}): params {human_bytes(round(row.param_nbytes))}, "
        f"grads {human_bytes(round(row.grad_nbytes))}, optim {human_bytes(round(row.optim_nbytes))}, "
        f"working set {human_bytes(round(row.working_set_nbytes or 0))}, "
        f"comm {row.comm_numel / plan.numel:.3g} psi per step",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
