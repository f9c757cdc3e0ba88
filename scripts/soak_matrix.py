"""Run the conformance matrix again and again, to catch a native crash seen once in many runs.

    python scripts/soak_matrix.py --out DIR (--runs N | --minutes M) [--heap-checks] [--no-cores]
        [-- ARGS...]

ARGS go to ``python -m conformance`` (default ``--impl fsdp_lite fsdp_lite_fsdp2``: the default
matrix of both fronts, 2 ranks). Every run gets ``PYTHONFAULTHANDLER=1`` (a crashing rank prints
every thread's Python stack) and core files up to the hard limit (where cores land is the kernel's
``/proc/sys/kernel/core_pattern``; ``core`` means each rank's working directory). Each run works in
DIR/run_N (relative paths in ARGS land there) and imports from where the script was started.
``--heap-checks`` adds glibc's checks: ``MALLOC_CHECK_=3``, ``MALLOC_PERTURB_`` (a new value each
run) and ``MALLOC_MMAP_THRESHOLD_`` so that every allocation is on the checked heap.

One line per run in DIR/soak.tsv: run, exit code, seconds, the matrix's summary line, and the
native messages found in its output (glibc heap errors, fatal signals, ``terminate called``). A
run's log and folder are kept only when it failed or printed such a message. Exit 1 if any did.
Why: docs/engine.md, "Buffer lifetimes" (``free(): invalid pointer`` once in about 25 runs).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ARGS = ["--impl", "fsdp_lite", "fsdp_lite_fsdp2"]

# glibc's heap checks (--heap-checks here, and tests/test_buffer_lifetimes.py).
HEAP_CHECKS = {
    "MALLOC_CHECK_": "3",  # abort on any inconsistency glibc detects in the heap
    "MALLOC_PERTURB_": "165",  # fill freed (and new) memory: a read of a freed buffer shows
    "MALLOC_MMAP_THRESHOLD_": "33554432",  # buffers up to 32 MiB on the checked heap, not mmap
}

# What glibc, CPython and the C++ runtime print when a process dies natively, and torch's launcher
# when a rank died of a signal.
NATIVE = re.compile(
    r"(?m)free\(\): .*|malloc\(\): .*|double free.*|^corrupted .*|munmap_chunk\(\).*"
    r"|Fatal Python error: .*|Segmentation fault.*|terminate called .*"
    r"|Signal \d+ \(SIG\w+\)"
)
SUMMARY = re.compile(r"^\d+ cases: .*$", re.MULTILINE)


def native_messages(text: str) -> list[str]:
    """The distinct native-crash messages in ``text``, in order of first appearance."""
    return list(dict.fromkeys(m.group(0).strip() for m in NATIVE.finditer(text)))


def _core_limit(cores: bool):
    """Set in each run's process before it starts: core files up to the hard limit, or none."""

    def set_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (hard if cores else 0, hard))

    return set_limit


def run_once(
    run: int, out: Path, args: list[str], heap_checks: bool, cores: bool = True
) -> tuple[int, float, str, list[str]]:
    """One matrix run in out/run_N; its folder is removed when it was clean."""
    folder = out / f"run_{run}"
    folder.mkdir(parents=True, exist_ok=True)
    # Run in its own folder (cores, relative paths in args), importing from where we were started,
    # as `python -m conformance` there would (a --model module).
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=path)
    if heap_checks:
        env.update(HEAP_CHECKS, MALLOC_PERTURB_=str(1 + run % 255))
    log = folder / "conformance.log"
    start = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "conformance", *args],
            cwd=folder,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_core_limit(cores),
        )
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    found = SUMMARY.findall(text)
    messages = native_messages(text)
    if rc == 0 and not messages:
        shutil.rmtree(folder)
    return rc, seconds, (found[-1] if found else "no summary"), messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for soak.tsv and kept runs")
    limit = parser.add_mutually_exclusive_group(required=True)
    limit.add_argument("--runs", type=int, help="this many runs")
    limit.add_argument("--minutes", type=float, help="start runs until this much time has passed")
    parser.add_argument("--heap-checks", action="store_true", help="glibc's heap checks (slower)")
    parser.add_argument("--no-cores", action="store_true", help="no core files (each is ~300 MB)")
    parser.add_argument(
        "conformance_args", nargs="*", help="after --: args of python -m conformance"
    )
    opts = parser.parse_args(argv)
    args = opts.conformance_args or DEFAULT_ARGS
    opts.out.mkdir(parents=True, exist_ok=True)
    tsv = opts.out / "soak.tsv"
    if not tsv.exists():
        tsv.write_text("run\texit code\tseconds\tsummary\tnative messages\n")
    first = len(tsv.read_text().splitlines()) - 1  # runs already recorded there
    runs = opts.runs if opts.runs is not None else math.inf
    deadline = time.monotonic() + 60 * opts.minutes if opts.minutes is not None else math.inf
    bad = 0
    run = first
    while run - first < runs and time.monotonic() < deadline:
        run += 1
        rc, seconds, summary, messages = run_once(
            run, opts.out, args, opts.heap_checks, not opts.no_cores
        )
        bad += rc != 0 or bool(messages)
        line = f"{run}\t{rc}\t{seconds:.0f}\t{summary}\t{' | '.join(messages) or '-'}"
        with tsv.open("a") as f:
            f.write(line + "\n")
        print(
            f"run {run}: exit {rc}, {seconds:.0f} s, {summary}"
            + (f", {messages}" if messages else ""),
            flush=True,
        )
    print(f"{run - first} runs, {bad} failed or printed a native error; {tsv}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
