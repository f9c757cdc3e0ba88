"""Replay, in a loop, the traffic every native heap crash on record followed; count the deaths.

    python scripts/repro_gloo_crash.py --out DIR --minutes M [--iterations 40] [--heap-checks]
        [--checkouts DIR [DIR ...]]

Each run launches 2 gloo ranks (torchrun) that repeat ``--iterations`` times what the crashed
matrix runs did on one data group (docs/engine.md, "Buffer lifetimes"): build a 4-block model with
``fully_shard`` and an explicit forward-prefetch chain, train two steps (fsdp_lite's gathers and
2-rank reduce-scatters by sends, one tag per unit and kind), gather a full state dict through
DTensor (``get_model_state_dict(full_state_dict=True)``: DTensor's all-gathers on the data group),
``all_gather_object``, create and destroy a subgroup, and drop the model. The order check's helper
thread runs as in a matrix run. Runs follow one another until ``--minutes`` have passed.

``--checkouts``: the fsdp_lite checkouts to measure (default: the one this script lives in); runs
take them in turn, so that load on the machine falls on all alike (how docs/engine.md's
before/after table was made, with a worktree of the commit before).
One line per run in DIR/repro.tsv (run, checkout, exit code, seconds, native messages: glibc heap
errors, fatal signals, ``terminate called``), and DIR/summary.json per checkout: runs, iterations,
deaths, deaths per hour of running, the messages. A run's log is kept only when it died.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.soak_matrix import HEAP_CHECKS, native_messages  # noqa: E402


def worker(iterations: int, checkout: str) -> None:
    """One rank's loop (run under torchrun), on the fsdp_lite of ``checkout``."""
    sys.path.insert(0, checkout)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import fsdp_lite
    from fsdp_lite.tools.launch import distributed

    assert Path(fsdp_lite.__file__).resolve().is_relative_to(checkout), fsdp_lite.__file__
    from scripts.stress_lifetimes import Blocks  # an embedding, four MLP blocks, a head

    with distributed("gloo"):
        rank = dist.get_rank()
        for it in range(iterations):
            torch.manual_seed(it)
            model = Blocks()
            for block in model.blocks:
                fsdp_lite.fully_shard(block)
            fsdp_lite.fully_shard(model)
            blocks = list(model.blocks)
            for a, b in zip(blocks, blocks[1:]):
                a.set_modules_to_forward_prefetch([b])
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(2):
                g = torch.Generator().manual_seed(1000 * it + 10 * step + rank)
                idx = torch.randint(0, 61, (4, 16), generator=g)
                loss = F.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten())
                loss.backward()
                optim.step()
                optim.zero_grad()
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, (rank, it))
            sub = dist.new_group([0, 1])
            dist.barrier(group=sub)
            dist.destroy_process_group(sub)
            del model, optim, blocks


def run_once(run: int, out: Path, iterations: int, heap_checks: bool, checkout: Path) -> dict:
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    if heap_checks:
        env.update(HEAP_CHECKS, MALLOC_PERTURB_=str(1 + run % 255))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29600 + run % 200),
        str(Path(__file__).resolve()),
        "--worker",
        "--iterations",
        str(iterations),
        "--checkouts",
        str(checkout),
    ]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "timeout", (e.stdout or "") + (e.stderr or "")
        text = text if isinstance(text, str) else text.decode(errors="replace")
    messages = native_messages(text)
    if code != 0 or messages:
        (out / f"run_{run}.log").write_text(text)
    return {
        "run": run,
        "checkout": str(checkout),
        "code": code,
        "seconds": time.monotonic() - start,
        "messages": messages,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--iterations", type=int, default=40, help="model lives per run")
    parser.add_argument("--heap-checks", action="store_true")
    parser.add_argument("--checkouts", nargs="+", type=Path, default=[ROOT])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts.iterations, str(opts.checkouts[0].resolve()))
        return 0
    if opts.out is None:
        parser.error("--out is required")
    opts.out.mkdir(parents=True, exist_ok=True)
    tsv = opts.out / "repro.tsv"
    tsv.write_text("run\tcheckout\tcode\tseconds\tmessages\n")
    checkouts = [c.resolve() for c in opts.checkouts]
    results, start = [], time.monotonic()
    while time.monotonic() - start < opts.minutes * 60:
        run = len(results) + 1
        checkout = checkouts[(run - 1) % len(checkouts)]
        result = run_once(run, opts.out, opts.iterations, opts.heap_checks, checkout)
        results.append(result)
        with tsv.open("a") as f:
            line = [run, checkout, result["code"], f"{result['seconds']:.1f}"]
            f.write("\t".join(map(str, line)) + "\t" + " | ".join(result["messages"]) + "\n")
        dead = sum(1 for r in results if r["code"] != 0 or r["messages"])
        print(
            f"run {run} ({checkout.name}): exit {result['code']} in {result['seconds']:.0f} s; "
            f"{dead} deaths in {len(results)} runs",
            flush=True,
        )
    summary = {
        str(c): _summary([r for r in results if r["checkout"] == str(c)], opts) for c in checkouts
    }
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 1 if any(s["deaths"] for s in summary.values()) else 0


def _summary(results: list[dict], opts: argparse.Namespace) -> dict:
    hours = sum(r["seconds"] for r in results) / 3600
    deaths = [r for r in results if r["code"] != 0 or r["messages"]]
    return {
        "runs": len(results),
        "iterations": len(results) * opts.iterations,
        "deaths": len(deaths),
        "hours": round(hours, 3),
        "deaths_per_hour": round(len(deaths) / hours, 2) if hours else None,
        "messages": [r["messages"] for r in deaths],
        "heap_checks": opts.heap_checks,
    }


if __name__ == "__main__":
    sys.exit(main())
