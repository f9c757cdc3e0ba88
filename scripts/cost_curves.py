"""Cost curves: step time and peak memory against model size, unit count and world size.

Runs ``scripts/bench.py`` once per point of three sweeps (fp32, AdamW, gloo), each a fresh launch
with DDP, torch FSDP2 and both fsdp_lite fronts (FULL_SHARD and ``fully_shard``) stepped in turn,
and draws one PNG per sweep: the median step time, and the peak memory each rank's MemTracker saw
beside ZeRO's prediction of the model states (params + grads + AdamW's two moments, 16 bytes a
parameter in fp32: all of it on every rank for DDP, a 1/N share for ZeRO-3) plus the activations
the unwrapped model measured at that point.

    python scripts/cost_curves.py --out benchmarks/results/cost_curves_DATE [--steps 6]
        [--sweeps params,units,world] [--replot]

Sweeps: params, 4 widths of a 4-block GPT at 2 ranks; units, 2 to 16 blocks of width 256 at 2
ranks (every block a unit); world, the 4-block width-256 GPT at 1, 2, 4 and 8 ranks (on a
machine with fewer cores than ranks, ranks share cores: the step time then measures that too).
Each point's bench.py JSON is kept under ``--out``; ``--replot`` redraws from them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench.py"
SYSTEMS = ("ddp", "torch_fsdp2", "fsdp_lite/FULL_SHARD", "fsdp_lite/fully_shard")
ZERO_STAGE = {"ddp": 0, "torch_fsdp2": 3, "fsdp_lite/FULL_SHARD": 3, "fsdp_lite/fully_shard": 3}
BYTES_PER_PARAM = 16  # fp32 param + grad + AdamW's exp_avg and exp_avg_sq
BASE = {"layers": 4, "d_model": 256, "heads": 4, "vocab": 4096, "seq_len": 128, "batch": 4}
SWEEPS = {
    "params": ("d_model", (128, 256, 384, 512), "width (d_model) of a 4-block GPT, 2 ranks"),
    "units": ("layers", (2, 4, 8, 16), "transformer blocks (= units), width 256, 2 ranks"),
    "world": ("world_size", (1, 2, 4, 8), "ranks, 4-block width-256 GPT"),
}
MiB = 1024**2


def point_args(sweep: str, value: int) -> dict:
    args = dict(BASE, world_size=2)
    args[SWEEPS[sweep][0]] = value
    return args


def run_point(out: Path, sweep: str, value: int, steps: int) -> dict:
    """One bench.py launch; its JSON report (kept as ``out/SWEEP_VALUE.json``)."""
    path = out / f"{sweep}_{value}.json"
    a = point_args(sweep, value)
    command = [sys.executable, str(BENCH), "--precision", "fp32", "--steps", str(steps)]
    command += ["--systems", ",".join(("single",) + SYSTEMS), "--json", str(path)]
    for key, v in a.items():
        command += [f"--{key.replace('_', '-')}", str(v)]
    print(f"cost_curves: {sweep}={value}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def summarize(report: dict, sweep: str, value: int) -> list[dict]:
    """A row per system: step time, peak memory, model states measured and predicted."""
    by_system = {r["system"]: r for r in report["results"]}
    single = by_system["single"]
    psi = report["config"]["params"]
    world = point_args(sweep, value)["world_size"]
    activations = single["peak_tracked_split_rank0"]["Activation"]
    rows = []
    for name in SYSTEMS:
        r = by_system[name]
        states = BYTES_PER_PARAM * psi / (world if ZERO_STAGE[name] == 3 else 1)
        rows.append(
            {
                "sweep": sweep,
                "x": value,
                "system": name,
                "params": psi,
                "world_size": world,
                "step_s": r["step_s"]["median"],
                "step_iqr_s": r["step_s"]["iqr"],
                "peak_nbytes": max(r["peak_tracked_nbytes"]),
                "state_nbytes": max(s["total"] for s in r["state_nbytes"]),
                "zero_states_nbytes": states,
                "zero_prediction_nbytes": states + activations,
            }
        )
    return rows


def plot(rows: list[dict], sweep: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, values, label = SWEEPS[sweep]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(SYSTEMS, ("tab:gray", "tab:orange", "tab:blue", "tab:green")))
    xs_label = "parameters (millions)" if sweep == "params" else label
    for name in SYSTEMS:
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["x"])
        xs = [r["params"] / 1e6 if sweep == "params" else r["x"] for r in mine]
        ax_t.plot(xs, [r["step_s"] * 1e3 for r in mine], "o-", color=colors[name], label=name)
        ax_m.plot(xs, [r["peak_nbytes"] / MiB for r in mine], "o-", color=colors[name], label=name)
        if name in ("ddp", "torch_fsdp2"):  # ZeRO-0 and ZeRO-3: one line each, not per system
            zero = "ZeRO prediction, DDP" if name == "ddp" else "ZeRO-3 prediction"
            ax_m.plot(
                xs,
                [r["zero_prediction_nbytes"] / MiB for r in mine],
                ":",
                color=colors[name],
                label=zero,
            )
    ax_t.set_ylabel("median step (ms)")
    ax_m.set_ylabel("peak memory per rank (MiB)")
    for ax in (ax_t, ax_m):
        ax.set_xlabel(xs_label)
        ax.grid(alpha=0.3)
        if sweep in ("world", "units"):
            ax.set_xscale("log", base=2)
            ax.set_xticks(values, [str(v) for v in values])
    ax_m.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"cost against {label} (fp32, AdamW, gloo on CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    head = "| sweep | x | system | params | step ms | peak MiB | states MiB | ZeRO states MiB |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['sweep']} | {r['x']} | {r['system']} | {r['params']:,} | "
            f"{r['step_s'] * 1e3:.1f} | {r['peak_nbytes'] / MiB:.1f} | "
            f"{r['state_nbytes'] / MiB:.1f} | {r['zero_states_nbytes'] / MiB:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/cost_curves.py", description=__doc__)
    parser.add_argument("--out", required=True, help="directory for the JSON, table and PNGs")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per system (6)")
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help="comma list of sweeps")
    parser.add_argument("--replot", action="store_true", help="redraw from the kept JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for sweep in args.sweeps.split(","):
        if sweep not in SWEEPS:
            parser.error(f"unknown sweep {sweep!r}: choose from {', '.join(SWEEPS)}")
        for value in SWEEPS[sweep][1]:
            path = out / f"{sweep}_{value}.json"
            report = (
                json.loads(path.read_text())
                if args.replot
                else run_point(out, sweep, value, args.steps)
            )
            rows += summarize(report, sweep, value)
        plot([r for r in rows if r["sweep"] == sweep], sweep, out / f"cost_{sweep}.png")
    (out / "cost_curves.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "cost_curves.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
