"""Resident memory and step time with disk offload (ZeRO-Infinity) against in-memory CPU offload.

A stack of wide Linear layers, one unit each, FULL_SHARD on 2 gloo ranks with AdamW: params, grads
and the two AdamW states are 16 bytes per parameter, so ~151M parameters give ~1.13 GiB of sharded
state per rank. Each mode runs in fresh processes, one after the other:

  memory      CPUOffload(offload_params=True), optim.step()
  disk        CPUOffload(offload_params=True, offload_dir=DIR), optim.step()
  disk_unit   the same, stepping with fsdp_lite.disk_offload.step(model, optim) (one unit at a time)
  deepspeed   DeepSpeed ZeRO-Infinity on the same model and AdamW: stage 3, offload_param and
              offload_optimizer to nvme in DIR, its default buffers (needs deepspeed and its
              async_io op: scripts/deepspeed_matrix.sh --libaio sets both up)

Per rank it reads /proc/self/status: the peak RSS (VmHWM, reset through /proc/self/clear_refs
after the model is built and again after the first step) and RssAnon / RssFile after each step.
It prints a table and writes JSON and the command line to benchmarks/results/.

    python scripts/bench_disk_offload.py --steps 4 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from fsdp_lite import CPUOffload, disk_offload
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.tools.launch import leave_together
from fsdp_lite.wrap import ModuleWrapPolicy

MODES = ("memory", "disk", "disk_unit", "deepspeed")
GIB = 2**30


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset VmHWM to the current RSS (Linux >= 4.0)


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    )


def rank_main(rank: int, args: argparse.Namespace, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    rendezvous = os.path.join(os.path.dirname(out), "rendezvous")
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.world_size
    )
    if mode == "deepspeed":
        result = deepspeed_steps(rank, args)
    else:
        result = fsdp_lite_steps(rank, args, mode)
    leave_together()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


def fsdp_lite_steps(rank: int, args: argparse.Namespace, mode: str) -> dict:
    offload = CPUOffload(offload_params=True, offload_dir=None if mode == "memory" else args.dir)
    model = FSDP(
        build(args.width, args.layers),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        cpu_offload=offload,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shard_numel = sum(p.to_local().numel() for p in model.parameters())

    def forward_backward(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    def optimizer_step() -> None:
        if mode == "disk_unit":
            disk_offload.step(model, optim)
        else:
            optim.step()
        optim.zero_grad()

    result = measure(rank, args, mode, shard_numel, forward_backward, optimizer_step)
    if mode != "memory":
        disk_offload.close(model)  # multiprocessing children skip atexit
    return result


def deepspeed_steps(rank: int, args: argparse.Namespace) -> dict:
    """The same model and AdamW under DeepSpeed ZeRO-Infinity: stage 3, params and optimizer
    state offloaded to nvme in ``args.dir`` with DeepSpeed's default buffers (libaio, O_DIRECT,
    pinned buffers, prefetch); torch's AdamW as the client optimizer, as fsdp_lite's."""
    os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed probes for one otherwise; read at import
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed insists; one host here
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    nvme = os.path.join(args.dir, f"deepspeed-{os.getppid()}")  # one per run, DeepSpeed's layout
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # every parameter offloaded, as fsdp_lite's
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW, not DeepSpeed's JIT-built CPUAdam
        "steps_per_print": 2**31 - 1,
    }
    engine, *_ = deepspeed.initialize(
        model=build(args.width, args.layers),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        config=config,
        dist_init_required=False,
    )
    shard_numel = sum(p.ds_tensor.numel() for p in engine.module.parameters())

    def forward_backward(x: torch.Tensor) -> torch.Tensor:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        return loss

    result = measure(rank, args, "deepspeed", shard_numel, forward_backward, engine.step)
    engine.destroy()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(nvme, ignore_errors=True)
    return result


def measure(rank, args, mode, shard_numel, forward_backward, optimizer_step) -> dict:
    """Time and peak RSS of each step's forward+backward and optimizer step, RSS after each."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    after_build = proc_status()
    reset_peak()
    rows = []
    for step in range(args.steps):
        dist.barrier()
        if step > 0:
            reset_peak()  # the first step's peak (AdamW state created) is its own column
        start = time.perf_counter()
        loss = forward_backward(x)
        middle = time.perf_counter()
        fwd_bwd_peak = proc_status()["VmHWM"]
        if step > 0:
            reset_peak()
        optimizer_step()
        end = time.perf_counter()
        status = proc_status()
        rows.append(
            dict(step=step, loss=loss.item(), fwd_bwd_s=middle - start, optim_s=end - middle)
            | dict(fwd_bwd_peak=fwd_bwd_peak, optim_peak=status["VmHWM"])
            | {k: status[k] for k in ("VmRSS", "RssAnon", "RssFile")}
        )
    return dict(
        rank=rank,
        mode=mode,
        shard_numel=shard_numel,
        sharded_state_bytes=shard_numel * 4 * 4,  # fp32 param, grad, exp_avg, exp_avg_sq
        after_build=after_build,
        first_step_peak_rss=rows[0]["optim_peak"],  # step 0 never resets the peak
        steps=rows,
    )


def launch(world_size: int, target, args: tuple, label: str) -> list[dict]:
    """``target(rank, *args, out)`` on ``world_size`` spawned ranks; the JSON each wrote to
    ``out`` (their rendezvous file sits beside it)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world_size)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=target, args=(r, *args, outs[r])) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"{label}: a rank failed ({[p.exitcode for p in procs]})")
        return [json.loads(Path(o).read_text()) for o in outs]


def run_mode(args: argparse.Namespace, mode: str) -> list[dict]:
    return launch(args.world_size, rank_main, (args, mode), f"mode {mode}")


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    table = []
    for mode, ranks in results.items():
        for r in ranks:
            steady = r["steps"][1:]
            table.append(
                dict(
                    mode=mode,
                    rank=r["rank"],
                    state_gib=r["sharded_state_bytes"] / GIB,
                    first_peak_gib=r["first_step_peak_rss"] / GIB,
                    fwd_bwd_peak_gib=max(s["fwd_bwd_peak"] for s in steady) / GIB,
                    optim_peak_gib=max(s["optim_peak"] for s in steady) / GIB,
                    rss_between_gib=statistics.median(s["VmRSS"] for s in steady) / GIB,
                    anon_gib=statistics.median(s["RssAnon"] for s in steady) / GIB,
                    file_gib=statistics.median(s["RssFile"] for s in steady) / GIB,
                    fwd_bwd_s=statistics.median(s["fwd_bwd_s"] for s in steady),
                    optim_s=statistics.median(s["optim_s"] for s in steady),
                    last_loss=r["steps"][-1]["loss"],
                )
            )
    return table


def render(table: list[dict]) -> str:
    header = (
        f"{'mode':<10} {'rank':>4} {'state GiB':>9} {'peak 1st':>8} {'peak f+b':>8} {'peak opt':>8} "
        f"{'RSS':>6} {'anon':>6} {'file':>6} {'fwd+bwd s':>9} {'optim s':>8}  last loss"
    )
    lines = [header, "-" * len(header)]
    for t in table:
        lines.append(
            f"{t['mode']:<10} {t['rank']:>4} {t['state_gib']:>9.3f} {t['first_peak_gib']:>8.2f} "
            f"{t['fwd_bwd_peak_gib']:>8.2f} {t['optim_peak_gib']:>8.2f} {t['rss_between_gib']:>6.2f} {t['anon_gib']:>6.2f} "
            f"{t['file_gib']:>6.2f} {t['fwd_bwd_s']:>9.2f} {t['optim_s']:>8.2f}  {t['last_loss']!r}"
        )
    lines.append(
        "GiB of RSS per rank. peak 1st: whole first step (AdamW state created); peak f+b / opt: "
        "forward+backward / optimizer step of later steps (max); RSS/anon/file: after each later "
        "step (median). Times: medians of the later steps; 2 shared, busy cores: noisy."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="offload directory")
    parser.add_argument("--modes", default="memory,disk,disk_unit", help=f"of {MODES}")
    parser.add_argument("--out", default="benchmarks/results/disk_offload")
    args = parser.parse_args()
    results = {mode: run_mode(args, mode) for mode in args.modes.split(",")}
    table = summarize(results)
    text = render(table)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    meta = dict(command=command, torch=torch.__version__, args=vars(args), cpu_cores=os.cpu_count())
    out.with_suffix(".json").write_text(
        json.dumps(meta | dict(summary=table, raw=results), indent=1)
    )
    out.with_suffix(".txt").write_text(f"$ {command}\n{text}\n")


if __name__ == "__main__":
    main()
