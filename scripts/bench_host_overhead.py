"""Host time per unit per step: N tiny units, every system stepped in turn, by phase.

    python scripts/bench_host_overhead.py [--units 16,64,256] [--steps 30] [--json out.json]
    torchrun --nproc_per_node 2 scripts/bench_host_overhead.py --backend gloo [...]

Each unit is one ``nn.Linear(16, 16)`` (272 parameters): compute is next to nothing, so what a
step costs beyond the plain model's is the wrapper's work on the host (hooks, bookkeeping, copies,
issuing collectives). ``--backend fake`` (default) runs one process on torch's fake process group
(world size 2; collectives return at once and move nothing): only host work is left.
``--backend gloo`` runs the same under torchrun, where waits for the peer count too.

Systems: the plain model (the floor), torch FSDP1 (``use_orig_params=True``, a lambda policy
wrapping each Linear), torch FSDP2 (``fully_shard`` per Linear and the root), fsdp_lite's FSDP1
front and its ``fully_shard``. All are built at once and stepped in turn, the order rotated each
step (a barrier before each under gloo), so that a change in machine load falls on all alike.
Each step is timed by phase: forward, backward (``loss.backward()``: pre-backward and
post-backward hooks, reductions issued and waited), optimizer (AdamW, ``foreach=False``) and
``zero_grad``. Reported: the median over steps of each phase, minus the plain model's, divided by
N: microseconds of host time per unit per step; and each system's total against torch FSDP2's.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fsdp_lite  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "zero_grad")
SYSTEMS = ("plain", "torch_fsdp1", "torch_fsdp2", "fsdp_lite_fsdp1", "fsdp_lite_fsdp2")
WIDTH = 16


def tiny(units: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(units)])


def build(system: str, units: int) -> nn.Module:
    model = tiny(units)
    if system == "plain":
        return model
    if system == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)
            ),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    if system == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        return fully_shard(model)
    if system == "fsdp_lite_fsdp1":
        return fsdp_lite.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({nn.Linear})
        )
    if system == "fsdp_lite_fsdp2":
        for layer in model:
            fsdp_lite.fully_shard(layer)
        return fsdp_lite.fully_shard(model)
    raise ValueError(f"unknown system {system!r}")


def step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, float]:
    """One training step; seconds per phase."""
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optim.step()
    t3 = time.perf_counter()
    optim.zero_grad()
    t4 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "zero_grad": t4 - t3}


def measure(units: int, steps: int, systems: tuple[str, ...], gloo: bool) -> dict[str, dict]:
    models = {s: build(s, units) for s in systems}
    optims = {
        s: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for s, m in models.items()
    }
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    times: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    warmup = 3
    for i in range(warmup + steps):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for s in order:
            if gloo:
                dist.barrier()
            t = step(models[s], optims[s], x)
            if i >= warmup:
                times[s].append(t)
    out = {}
    for s in systems:
        phases = {p: statistics.median(t[p] for t in times[s]) for p in PHASES}
        phases["total"] = statistics.median(sum(t.values()) for t in times[s])
        out[s] = phases
    del models, optims
    return out


def per_unit(result: dict[str, dict], units: int) -> dict[str, dict]:
    """Microseconds per unit per step above the plain model, by phase and in total."""
    plain = result["plain"]
    return {
        s: {p: (v - plain[p]) / units * 1e6 for p, v in phases.items()}
        for s, phases in result.items()
        if s != "plain"
    }


def table(rows: list[dict]) -> str:
    head = f"{'units':>5}  {'system':<16}" + "".join(f"{p:>11}" for p in (*PHASES, "total"))
    lines = [head + f"{'vs fsdp2':>10}", "-" * (len(head) + 10)]
    for row in rows:
        fsdp2 = row["per_unit"]["torch_fsdp2"]["total"]
        for system, phases in row["per_unit"].items():
            cells = "".join(f"{phases[p]:>11.1f}" for p in (*PHASES, "total"))
            lines.append(f"{row['units']:>5}  {system:<16}{cells}{phases['total'] / fsdp2:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--units", default="16,64,256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    systems = tuple(opts.systems.split(","))
    if "plain" not in systems:
        systems = ("plain", *systems)
    torch.set_num_threads(1)
    if opts.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("gloo")
    rows = []
    for units in (int(u) for u in opts.units.split(",")):
        result = measure(units, opts.steps, systems, opts.backend == "gloo")
        rows.append({"units": units, "seconds": result, "per_unit": per_unit(result, units)})
        if dist.get_rank() == 0:
            print(f"{units} units done", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        print(
            f"host time per unit per step above the plain model (us), backend {opts.backend}, "
            f"world size {dist.get_world_size()}, median of {opts.steps} steps"
        )
        print(table(rows))
        if opts.json:
            opts.json.write_text(
                json.dumps(
                    {
                        "date": datetime.date.today().isoformat(),
                        "command": " ".join(sys.argv),
                        "backend": opts.backend,
                        "torch": torch.__version__,
                        "machine": platform.processor() or platform.machine(),
                        "load_average": os.getloadavg(),
                        "rows": rows,
                    },
                    indent=1,
                )
                + "\n"
            )
    if opts.backend == "gloo":
        leave_together()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
