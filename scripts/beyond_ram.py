"""Train a GPT whose fp32 params, grads and AdamW state do not fit in this machine's RAM.

FULL_SHARD with disk offload (``CPUOffload(offload_params=True, offload_dir=DIR)``) on gloo
ranks. The model is built on ``meta`` and materialized unit by unit straight into its files, so
it is never whole in memory; the optimizer steps one unit at a time (``disk_offload.step``). The
number of blocks is chosen from ``/proc/meminfo`` so that the states (16 bytes per parameter)
exceed ``--ram-factor`` x MemTotal on whatever machine runs it.

Before training it measures the offload directory's sequential bandwidth with ``dd`` (O_DIRECT);
after it, the same model cut to ``--floor-blocks`` blocks takes a few steps with its states in
memory (the compute floor, scaled to the full depth). The report gives per rank the peak RSS,
the bytes read and written per step (``/proc/self/io``), the step time, and the step's ratio to
max(I/O floor, compute floor). A watchdog in each rank stops the run, naming the figures, if
MemAvailable falls under ``--min-available-gib``, so it is never the OOM killer that ends it.

    python scripts/beyond_ram.py --dir /path/on/local/disk
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from conformance.models import Block, GPTConfig, TinyLM
from fsdp_lite import CPUOffload, disk_offload
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.tools.launch import leave_together
from fsdp_lite.wrap import ModuleWrapPolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_disk_offload import launch, proc_status, reset_peak  # noqa: E402

GIB = 2**30
STATE_BYTES_PER_PARAM = 16  # fp32 param, grad, exp_avg, exp_avg_sq
RSS_SLACK = 1.1  # peak RSS over the in-memory run's peak allowed before the run fails


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def io_counters() -> dict[str, int]:
    """This process's storage traffic: read_bytes / write_bytes (what reached the block layer)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def block_params(cfg: GPTConfig) -> int:
    return sum(p.numel() for p in Block(cfg).parameters())


def config_for(args: argparse.Namespace, n_layers: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=256,  # bytes of the text
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.d_model // 128,
        n_layers=n_layers,
        d_ff=4 * args.d_model,
        tie_embeddings=False,
    )


def plan(args: argparse.Namespace) -> GPTConfig:
    """The smallest depth whose states exceed ram_factor x MemTotal (or --blocks)."""
    if args.blocks:
        return config_for(args, args.blocks)
    target = args.ram_factor * meminfo()["MemTotal"] / STATE_BYTES_PER_PARAM
    per_block = block_params(config_for(args, 1))
    return config_for(args, math.ceil(target / per_block))


def param_count(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyLM(cfg).parameters())


def disk_bandwidth(directory: str, nbytes: int) -> dict[str, float]:
    """Sequential O_DIRECT write then read of one nbytes file in directory, bytes/s, with dd."""
    path = os.path.join(directory, f"beyond_ram_dd_{os.getpid()}")
    count = max(1, nbytes // (64 << 20))
    rates = {}
    try:
        for name, cmd in (
            ("write", ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}",
                       "oflag=direct", "conv=fsync"]),
            ("read", ["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"]),
        ):  # fmt: skip
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            rates[name] = count * (64 << 20) / (time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rates


def batch(rank: int, cfg: GPTConfig, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed bytes of the shipped text, a different slice per rank; input and next-byte target."""
    text = (Path(__file__).parents[1] / "fsdp_lite" / "data" / "tinytext.txt").read_bytes()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    start = rank * micro * (cfg.seq_len + 1)
    rows = torch.stack(
        [data[start + i * (cfg.seq_len + 1) :][: cfg.seq_len + 1] for i in range(micro)]
    )
    return rows[:, :-1], rows[:, 1:]


class Watchdog(threading.Thread):
    """Ends the process (exit 3, naming the figures) if MemAvailable falls under a floor; records
    this rank's RSS and storage traffic every half second for the timeline plot."""

    def __init__(self, rank: int, floor: int) -> None:
        super().__init__(daemon=True)
        self.rank, self.floor, self.lowest = rank, floor, meminfo()["MemAvailable"]
        self.start_time = time.perf_counter()
        self.samples: list[tuple[float, int, int, int]] = []  # (s, RSS, read_bytes, write_bytes)
        self.marks: list[tuple[float, str]] = []  # (s, "init" / "step 0" / ... / "end")

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter() - self.start_time, label))

    def run(self) -> None:
        while True:
            available = meminfo()["MemAvailable"]
            self.lowest = min(self.lowest, available)
            now = time.perf_counter() - self.start_time
            if not self.samples or now - self.samples[-1][0] >= 0.5:
                io = io_counters()
                rss = proc_status()["VmRSS"]
                self.samples.append((now, rss, io["read_bytes"], io["write_bytes"]))
            if available < self.floor:
                status = proc_status()
                print(
                    f"beyond_ram: rank {self.rank} stops the run: MemAvailable "
                    f"{available / GIB:.2f} GiB < {self.floor / GIB:.2f} GiB "
                    f"(this rank's RSS {status['VmRSS'] / GIB:.2f} GiB)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)
            time.sleep(0.2)


def init_fn(progress: tqdm | None):
    """param_init_fn: the module's own initialization, ticking the progress bar by parameters."""

    def init(module: nn.Module) -> None:
        if isinstance(module, TinyLM):
            nn.init.normal_(module.pos, std=0.02)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if progress is not None:
            progress.update(sum(p.numel() for p in module.parameters(recurse=False)))

    return init


def rank_main(rank: int, args: argparse.Namespace, cfg: GPTConfig, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.dirname(out)}/rendezvous",
        rank=rank,
        world_size=args.world_size,
    )
    watchdog = Watchdog(rank, int(args.min_available_gib * GIB))
    watchdog.start()
    show = rank == 0 and mode == "disk"
    total = param_count(cfg)
    bar = tqdm(total=total, unit="param", unit_scale=True, desc="init", disable=not show)
    watchdog.mark("init")
    with torch.device("meta"):
        model = TinyLM(cfg)
    offload = CPUOffload(offload_params=True, offload_dir=args.dir if mode == "disk" else None)
    start = time.perf_counter()
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        cpu_offload=offload,
        param_init_fn=init_fn(bar if show else None),
        device_id=torch.device("cpu"),
    )
    bar.close()
    init_s = time.perf_counter() - start
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    units = 1 + cfg.n_layers  # the blocks and the root
    ticks = 2 * cfg.n_layers + units  # forward and backward per block, optimizer per unit

    def tick(*_) -> None:  # a hook: must return None
        progress.update(1)

    def forward_tick(module, inputs, output) -> None:
        tick()
        if output.requires_grad:
            output.register_hook(tick)  # backward reached the block

    for block in model.module.blocks if hasattr(model, "module") else model.blocks:
        block.register_forward_hook(forward_tick)
    optim.register_step_post_hook(tick)  # once per unit

    x, y = batch(rank, cfg, args.micro_batch)
    rows = []
    for step in range(args.steps):
        progress = tqdm(total=ticks, desc=f"step {step}", disable=not show, mininterval=2)
        watchdog.mark(f"step {step}")
        dist.barrier()
        reset_peak()
        io0, use0, t0 = io_counters(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if mode == "disk":
            disk_offload.step(model, optim)
        else:
            optim.step()
        optim.zero_grad()
        t3 = time.perf_counter()
        io1, use1, status = io_counters(), resource.getrusage(resource.RUSAGE_SELF), proc_status()
        progress.close()
        losses = [torch.zeros(()) for _ in range(args.world_size)]
        dist.all_gather(losses, loss.detach())
        rows.append(
            dict(step=step, loss=sum(float(v) for v in losses) / len(losses))
            | dict(forward_s=t1 - t0, backward_s=t2 - t1, optim_s=t3 - t2, step_s=t3 - t0)
            | dict(read_bytes=io1["read_bytes"] - io0["read_bytes"])
            | dict(write_bytes=io1["write_bytes"] - io0["write_bytes"])
            | dict(peak_rss=status["VmHWM"], rss_anon=status["RssAnon"], rss_file=status["RssFile"])
            # CPU time against wall time says how long the rank waited (for I/O, or the CPU);
            # major faults are the pages it read from disk through the mappings.
            | dict(user_s=use1.ru_utime - use0.ru_utime, sys_s=use1.ru_stime - use0.ru_stime)
            | dict(major_faults=use1.ru_majflt - use0.ru_majflt)
        )
        if show:
            r = rows[-1]
            tqdm.write(
                f"step {step}: loss {r['loss']:.4f}, {r['step_s']:.1f} s, peak RSS "
                f"{r['peak_rss'] / GIB:.2f} GiB, read {r['read_bytes'] / GIB:.1f} GiB, "
                f"wrote {r['write_bytes'] / GIB:.1f} GiB (rank 0)"
            )
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    result = dict(rank=rank, mode=mode, init_s=init_s, shard_numel=shard_numel, steps=rows)
    watchdog.mark("end")
    result["lowest_available"] = watchdog.lowest
    result["timeline"] = dict(samples=watchdog.samples, marks=watchdog.marks)
    if mode == "disk":
        disk_offload.close(model)  # multiprocessing children skip atexit
    leave_together()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


def run(args: argparse.Namespace, cfg: GPTConfig, mode: str) -> list[dict]:
    return launch(args.world_size, rank_main, (args, cfg, mode), f"beyond_ram: {mode} run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="offload directory (local disk)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--ram-factor", type=float, default=1.1, help="states / MemTotal")
    parser.add_argument("--blocks", type=int, default=0, help="depth (default: from --ram-factor)")
    parser.add_argument("--floor-blocks", type=int, default=2, help="depth of the compute floor")
    parser.add_argument("--dd-gib", type=float, default=4.0)
    parser.add_argument("--min-available-gib", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results/beyond_ram")
    parser.add_argument("--plot", help="a PNG of RSS and disk traffic over time (matplotlib)")
    args = parser.parse_args()

    cfg = plan(args)
    params = param_count(cfg)
    mem = meminfo()
    state = params * STATE_BYTES_PER_PARAM
    free = shutil.disk_usage(args.dir).free
    print(
        f"beyond_ram: {params / 1e9:.2f}B parameters ({cfg.n_layers} blocks of d_model "
        f"{cfg.d_model}): states {state / GIB:.1f} GiB = {state / mem['MemTotal']:.2f} x "
        f"MemTotal ({mem['MemTotal'] / GIB:.1f} GiB); {free / GIB:.1f} GiB free in {args.dir}",
        flush=True,
    )
    if free < state * 1.05:
        raise SystemExit(f"beyond_ram: {args.dir} has {free} bytes free, the states need {state}")
    bandwidth = disk_bandwidth(args.dir, int(args.dd_gib * GIB))
    print(
        f"disk: write {bandwidth['write'] / 1e9:.2f} GB/s, read {bandwidth['read'] / 1e9:.2f} GB/s"
        f" (dd, O_DIRECT, {args.dd_gib:g} GiB)",
        flush=True,
    )
    disk = run(args, cfg, "disk")
    floor_cfg = config_for(args, args.floor_blocks)
    memory = run(args, floor_cfg, "memory")
    report = summarize(args, cfg, floor_cfg, bandwidth, disk, memory)
    print(report["text"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    meta = dict(command=command, torch=torch.__version__, cpu_cores=os.cpu_count(), meminfo=mem)
    meta |= dict(args=vars(args), config=asdict(cfg), params=params, bandwidth=bandwidth)
    out.with_suffix(".json").write_text(
        json.dumps(meta | dict(summary=report["summary"], disk=disk, memory=memory), indent=1)
    )
    out.with_suffix(".txt").write_text(f"$ {command}\n{report['text']}\n")
    if args.plot:
        plot_timeline(disk, args.plot)
    if report["summary"]["rss_ratio"] > RSS_SLACK:
        raise SystemExit("beyond_ram: the RSS bound was not held (see the report)")


def plot_timeline(ranks: list[dict], path: str) -> None:
    """RSS, and the bytes read and written so far, of each rank over the run; phases marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss_ax, io_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for r in ranks:
        t, rss, read, write = zip(*r["timeline"]["samples"])
        rss_ax.plot(t, [b / GIB for b in rss], label=f"rank {r['rank']}")
        io_ax.plot(t, [(b - read[0]) / GIB for b in read], label=f"rank {r['rank']} read")
        io_ax.plot(
            t, [(b - write[0]) / GIB for b in write], "--", label=f"rank {r['rank']} written"
        )
    for when, label in ranks[0]["timeline"]["marks"]:
        for ax in (rss_ax, io_ax):
            ax.axvline(when, color="grey", lw=0.5)
        rss_ax.text(when, 0, f" {label}", rotation=90, va="bottom", fontsize=7)
    rss_ax.set_ylabel("RSS, GiB")
    rss_ax.set_ylim(bottom=0)
    io_ax.set_ylabel("storage I/O so far, GiB")
    io_ax.set_xlabel("seconds (rank 0's marks: init, each step, end)")
    rss_ax.legend(fontsize=7)
    io_ax.legend(fontsize=7, ncol=2)
    fig.suptitle("scripts/beyond_ram.py: per rank, /proc/self/status VmRSS and /proc/self/io")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(args, cfg, floor_cfg, bandwidth, disk, memory) -> dict:
    """The per-rank table, the floors and the ratio."""
    params = param_count(cfg)
    shard_bytes = sum(r["shard_numel"] for r in disk) * 4  # one fp32 tensor of every rank's shards
    # What a step must move, all ranks together: the params read for forward and again for
    # backward, the grads written, and the optimizer reading param, grad and both states and
    # writing param and both states back.
    must_read, must_write = 6 * shard_bytes, 4 * shard_bytes
    io_floor = must_read / bandwidth["read"] + must_write / bandwidth["write"]
    # Compute floor: the in-memory steps after the first, scaled by the number of blocks.
    scale = params / param_count(floor_cfg)
    floor_steps = [s["step_s"] for r in memory for s in r["steps"][1:]]
    compute_floor = max(floor_steps) * scale if floor_steps else float("nan")
    lines = []
    summary = []
    for r in disk:
        later = r["steps"][1:] or r["steps"]
        step_s = max(s["step_s"] for s in later)
        row = dict(
            rank=r["rank"],
            init_s=r["init_s"],
            peak_rss_gib=max(s["peak_rss"] for s in r["steps"]) / GIB,
            read_gib=max(s["read_bytes"] for s in later) / GIB,
            write_gib=max(s["write_bytes"] for s in later) / GIB,
            step_s=step_s,
            cpu_s=max(s["user_s"] + s["sys_s"] for s in later),
            phases_s=[max(s[k] for s in later) for k in ("forward_s", "backward_s", "optim_s")],
            lowest_available_gib=r["lowest_available"] / GIB,
            losses=[s["loss"] for s in r["steps"]],
        )
        summary.append(row)
        lines.append(
            f"{row['rank']:>4} {row['init_s']:>7.0f} {row['peak_rss_gib']:>8.2f} "
            f"{row['read_gib']:>8.1f} {row['write_gib']:>8.1f} {row['step_s']:>7.1f} "
            f"{'/'.join(f'{t:.0f}' for t in row['phases_s']):>11} {row['cpu_s']:>6.0f} "
            f"{row['lowest_available_gib']:>9.2f}"
        )
    step_s = max(row["step_s"] for row in summary)
    # The bound disk offload holds at any depth: the engine's memory for a unit at a time, which
    # the shallow in-memory run (its states in memory too) measures.
    rss_bound = max(s["peak_rss"] for r in memory for s in r["steps"])
    rss_ratio = max(row["peak_rss_gib"] for row in summary) * GIB / rss_bound
    header = (
        f"{'rank':>4} {'init s':>7} {'peak RSS':>8} {'read/st':>8} {'wrote/st':>8} {'step s':>7} "
        f"{'f/b/opt s':>11} {'cpu s':>6} {'min avail':>9}"
    )
    text = "\n".join(
        [
            f"{params / 1e9:.2f}B params, states {params * STATE_BYTES_PER_PARAM / GIB:.1f} GiB "
            f"on {args.world_size} ranks; losses {summary[0]['losses']}",
            header,
            "-" * len(header),
            *lines,
            "GiB; read/st, wrote/st: this rank's /proc/self/io per step after the first (max); "
            "step s, f/b/opt s (forward, backward, optimizer), cpu s (user + system): after the "
            "first (max); min avail: lowest MemAvailable seen.",
            f"I/O floor {io_floor:.1f} s (read {must_read / GIB:.1f} GiB at "
            f"{bandwidth['read'] / 1e9:.2f} GB/s, write {must_write / GIB:.1f} GiB at "
            f"{bandwidth['write'] / 1e9:.2f} GB/s); compute floor {compute_floor:.1f} s "
            f"({floor_cfg.n_layers} blocks in memory x {scale:.1f}); step / max(floors) = "
            f"{step_s / max(io_floor, compute_floor):.2f}",
            f"RSS bound: peak RSS / the {floor_cfg.n_layers}-block in-memory run's peak "
            f"({rss_bound / GIB:.2f} GiB) = {rss_ratio:.2f}, "
            + ("held" if rss_ratio <= RSS_SLACK else f"NOT held (over {RSS_SLACK})"),
        ]
    )
    floors = dict(io_floor_s=io_floor, compute_floor_s=compute_floor, step_s=step_s)
    floors |= dict(rss_bound=rss_bound, rss_ratio=rss_ratio)
    return dict(text=text, summary=dict(ranks=summary, **floors))


if __name__ == "__main__":
    main()
