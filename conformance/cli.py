"""``python -m conformance``: choose the cases, start the ranks, run, report.

Without ``RANK`` in the environment it starts ``--nproc`` local ranks itself through torchrun's
entry point (``torchrun --standalone``) and waits for them; under ``torchrun`` it
uses the ranks it is given. Every rank builds the same case list and calls ``run_cases`` in one
process group; rank 0 prints progress and writes each case's result to the events file as soon
as it is known. Launched here, a rank that dies ends only its case: the launching process records
it ``crashed``, starts fresh ranks for the cases left, and prints the summary and writes the
reports from the events file (launcher.py, Note [Results that survive a rank]). Under ``torchrun``
rank 0 prints the summary and writes the reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "parse_args"]

log = logging.getLogger("conformance")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    # No option may be a prefix of one of torchrun's (torchrun rejects those, measured), except
    # --nproc, which only the self-launch reads: under torchrun use --nproc-per-node instead.
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Check FSDP implementations against DDP and a single process, stage by stage.",
    )
    parser.add_argument(
        "--impl",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="implementations: fsdp_lite, fsdp_lite_fsdp2, torch_fsdp1, torch_fsdp2, deepspeed "
        "(and its variants, see docs/deepspeed.md), or module.path:AdapterClass (default fsdp_lite)",
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks to launch (default 2); ignored under torchrun"
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo (CPU, default) or nccl (cuda:LOCAL_RANK)",
    )
    parser.add_argument("--quick", action="store_true", help="a small subset (CI smoke test)")
    parser.add_argument(
        "--all",
        action="store_true",
        help="every axis one launch can run, for a nightly job: the default matrix and every "
        "optimizer's (--optimizers sgd,adamw,muon); at 4 or more ranks the default matrix adds "
        "hpZ. Across world sizes is --world-sizes, a run of its own (docs/conformance.md)",
    )
    parser.add_argument(
        "--optimizers",
        default="sgd",
        metavar="NAME,...",
        help="optimizers to train with: sgd (the default matrix), adamw, muon (each a smaller "
        "matrix of its own; muon: Muon on the 2-D non-embedding weights, AdamW on the rest); "
        "e.g. sgd,adamw,muon. Case names of the others end in /adamw, /muon",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run cases whose name matches (glob with * ? [ ], else substring); repeatable. "
        "Names look like fsdp_lite/FULL_SHARD/fp32/no_sync/lm_untied/ws2",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="optimizer steps per case before the state-dict round trip (default 3)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective may wait before the case is failed (default 60; 20 in a "
        "self-test); a rank that waits twice that at a stage end for the others has a peer that "
        "hung, and the case is crashed",
    )
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="NAME",
        help="run exactly the case of this name (from --list); repeatable",
    )
    parser.add_argument(
        "--shard",
        metavar="I/N",
        help="run part I of N of the selected cases (every N-th from the I-th), to split the "
        "matrix across CI jobs",
    )
    parser.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="judge your own model instead of the zoo: FACTORY() returns (model, units, batch) "
        "(see docs/conformance.md)",
    )
    parser.add_argument(
        "--compare-to",
        metavar="PATH",
        help="a previous --json report: report regressions and improvements against it; the exit "
        "status is then 0 (same), 2 (regressions) or 3 (only improvements)",
    )
    parser.add_argument(
        "--regression-factor",
        type=float,
        default=None,
        metavar="F",
        help="with --compare-to: a stage whose distance to a reference grew (shrank) more than F "
        "times is a regression (improvement); default 10",
    )
    parser.add_argument(
        "--exitfirst", action="store_true", help="stop after the first failed or crashed case"
    )
    parser.add_argument(
        "--retry-crashed",
        type=int,
        default=0,
        metavar="N",
        help="run a case whose rank died again, up to N times, in fresh ranks starting with it, "
        "to tell a deterministic crash from a flaky one (default 0)",
    )
    parser.add_argument(
        "--jsonl",
        metavar="PATH",
        help="append each case's result to PATH as a JSON line as soon as it is known (and a "
        "line when a case starts, and when one crashes)",
    )
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="plant each bug of the catalog (conformance/catalog.py) in a copy of fsdp_lite and "
        "print which case catches it; --only then selects entries by name",
    )
    parser.add_argument("--self-test-plan", help=argparse.SUPPRESS)  # set by the self-test
    parser.add_argument(
        "--world-sizes",
        metavar="N,M,...",
        help="train every case at each of these world sizes (one launch each) and report, per "
        "stage, the largest difference from the smallest in ulps: the canonical mode "
        "(fsdp_lite_canonical, fsdp_lite_fsdp2_canonical) fails on any, the others are "
        "information; DDP is always run. See docs/conformance.md, 'Across world sizes'",
    )
    parser.add_argument(
        "--virtual-batches",
        type=int,
        metavar="V",
        help="with --world-sizes: the canonical mode's micro-batches per global batch (a power "
        "of two; default the smallest one >= 4 and >= the largest world size)",
    )
    parser.add_argument("--world-size-run", help=argparse.SUPPRESS)  # set by --world-sizes
    parser.add_argument(
        "--coverage",
        nargs="?",
        const="conformance-coverage",
        metavar="DIR",
        help="measure the line and branch coverage of the judged implementation in every rank "
        "and write a per-file table to DIR (default ./conformance-coverage): coverage.md, "
        "coverage.json and the combined data file .coverage",
    )
    parser.add_argument(
        "--coverage-source",
        metavar="PKG,...",
        help="with --coverage: the packages or modules to measure (default fsdp_lite for the "
        "fsdp_lite implementations, else each adapter's own module)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    parser.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")
    parser.add_argument("--markdown", metavar="PATH", help="write the summary table as Markdown")
    parser.add_argument(
        "--html",
        metavar="PATH",
        help="write a self-contained HTML report: a heat map of every case's distance to each "
        "reference per stage, the failures first with their curves, the run's metadata and, with "
        "--compare-to, the changes (python -m conformance.html renders one from a --json report)",
    )
    parser.add_argument("--list", action="store_true", help="print the selected cases and exit")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="log diagnostics (logger 'conformance')"
    )
    parser.add_argument("--launch-dir", help=argparse.SUPPRESS)  # set by launcher.Launcher
    parser.add_argument("--case-range", help=argparse.SUPPRESS)  # A:B, set by the launcher
    args = parser.parse_args(argv)
    args.impl = args.impl or ["fsdp_lite"]
    if args.nproc < 1 or args.steps < 1:
        parser.error("--nproc and --steps must be at least 1")
    if args.retry_crashed < 0:
        parser.error(f"--retry-crashed takes 0 or more, not {args.retry_crashed}")
    if args.jsonl is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.jsonl))):
        parser.error(f"--jsonl {args.jsonl}: its directory does not exist")
    from conformance.matrix import OPTIMIZERS

    if args.all:
        if args.quick or args.optimizers != "sgd":
            parser.error("--all runs every optimizer's full matrix: drop --quick and --optimizers")
        args.optimizers = ",".join(OPTIMIZERS)
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    unknown = [o for o in args.optimizers if o not in OPTIMIZERS]
    if unknown or not args.optimizers:
        parser.error(f"--optimizers takes some of {','.join(OPTIMIZERS)}, not {unknown or '-'}")
    if args.shard is not None:
        from conformance.matrix import parse_shard

        try:
            parse_shard(args.shard)
        except ValueError as e:
            parser.error(str(e))
    if args.regression_factor is not None and args.compare_to is None:
        parser.error("--regression-factor needs --compare-to")
    if args.self_test:
        from conformance.selftest import main_guard

        problem = main_guard(args)
        if problem:
            parser.error(problem)
    if args.self_test and args.html is not None:
        parser.error("--self-test prints its own kill table: it takes no --html")
    if args.world_sizes is not None:
        from conformance.world_size import parse_world_sizes

        try:
            parse_world_sizes(args.world_sizes)
        except ValueError as e:
            parser.error(str(e))
        clash = [
            flag
            for flag, given in (
                ("--self-test", args.self_test),
                ("--compare-to", args.compare_to is not None),
                ("--shard", args.shard is not None),
                ("--case", bool(args.case)),
                ("--quick", args.quick),
                ("--all", args.all),
                ("--junit", args.junit is not None),
                ("--html", args.html is not None),
                ("--optimizers", args.optimizers != ["sgd"]),
            )
            if given
        ]
        if clash:
            parser.error(f"--world-sizes does not take {', '.join(clash)}")
        v = args.virtual_batches
        if v is not None and (v < 1 or v & (v - 1)):
            parser.error(f"--virtual-batches must be a power of two, not {v}")
    elif args.virtual_batches is not None:
        parser.error("--virtual-batches needs --world-sizes")
    if args.coverage is not None:
        given = {"--self-test": args.self_test, "--world-sizes": args.world_sizes is not None}
        clash = [flag for flag, on in given.items() if on]
        if clash:
            parser.error(f"--coverage does not take {', '.join(clash)}")
        try:
            import coverage  # noqa: F401
        except ImportError:
            parser.error("--coverage needs coverage.py: pip install 'fsdp-lite[coverage]'")
    elif args.coverage_source is not None:
        parser.error("--coverage-source needs --coverage")
    if args.timeout is None:
        from conformance.selftest import SELF_TEST_TIMEOUT_S

        args.timeout = SELF_TEST_TIMEOUT_S if args.self_test or args.self_test_plan else 60.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format=f"%(asctime)s rank {os.environ.get('RANK', '-')} %(name)s %(levelname)s: %(message)s",
    )
    if args.compare_to is not None:
        from conformance.baseline import load_report

        load_report(args.compare_to)  # a missing or unreadable baseline fails before any launch
    if args.world_sizes is not None and args.world_size_run is None:
        from conformance import world_size

        if args.list:
            for size in world_size.parse_world_sizes(args.world_sizes):
                print("\n".join(c.name for c in world_size.selected_cases(args, size)))
            return 0
        if "RANK" in os.environ:
            print("conformance: --world-sizes launches its own ranks; run it without torchrun")
            return 1
        with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
            return world_size.run(args, _rank_argv(argv), _launchers(tmp, args.timeout))
    if args.list:
        cases, notes, _ = _cases(args, int(os.environ.get("WORLD_SIZE", args.nproc)))
        for note in notes:
            print(f"note: {note}")
        print("\n".join(c.name for c in cases))
        return 0
    if args.self_test:
        from conformance import selftest

        with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
            launchers = _launchers(tmp, args.timeout)
            return selftest.run(args, lambda nproc, argv: launchers(nproc).run(argv))
    if "RANK" in os.environ:  # started by torchrun, or by a Launcher
        for flag, given in (("--retry-crashed", args.retry_crashed), ("--coverage", args.coverage)):
            if given and not args.launch_dir:
                print(f"conformance: {flag} needs the ranks it launches; run it without torchrun")
                return 1
        return run_rank(args)
    return launch(args, argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the cases on ``args.nproc`` local ranks, in as many launches as dying ranks need, then
    print the summary and write the reports (launcher.py, Note [Results that survive a rank])."""
    from conformance.launcher import run_surviving

    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        events = Path(args.jsonl) if args.jsonl else Path(tmp) / "events.jsonl"
        events.write_text("")  # this run's lines only
        launcher = _launchers(tmp, args.timeout)(args.nproc)
        state = run_surviving(
            launcher,
            _rank_argv(argv),
            events,
            retry_crashed=args.retry_crashed,
            exitfirst=args.exitfirst,
        )
        if args.coverage is not None:
            from conformance.launcher import combine_coverage

            covered = combine_coverage(
                launcher.launch_dirs(), Path(args.coverage), coverage_packages(args)
            )
    results = _assemble(state)
    if state.plan is not None:
        meta = dict(state.plan["meta"])
    else:  # the ranks died before they listed the cases
        meta = {"impls": args.impl, "world_size": args.nproc, "backend": args.backend}
    meta.update(
        seconds=round(state.seconds, 2), launches=state.launches, retry_crashed=args.retry_crashed
    )
    status = _finish(args, results, meta, print, outside=state.outside)
    if args.coverage is not None:
        _write_coverage(Path(args.coverage), covered, argv, print)
    return status


def coverage_packages(args: argparse.Namespace) -> list[str]:
    """What ``--coverage`` measures: ``--coverage-source``, else fsdp_lite for its
    implementations and each other adapter's module (torch's FSDP is imported before the ranks
    start measuring, so its module-level lines would read as missed)."""
    if args.coverage_source:
        return [p for p in args.coverage_source.split(",") if p]
    from conformance.adapters import BUILTIN

    packages: list[str] = []
    for spec in args.impl:
        if spec.startswith("fsdp_lite"):
            package = "fsdp_lite"
        else:
            package = BUILTIN.get(spec, spec).partition(":")[0]
        if package not in packages:
            packages.append(package)
    return packages


def _write_coverage(
    out: Path, doc: dict[str, Any], argv: list[str], say: Callable[[str], None]
) -> None:
    """Print the coverage table and write it to ``out`` as coverage.md and coverage.json."""
    from conformance import report

    doc = {"command": shlex.join(["python", "-m", "conformance", *argv]), **doc}
    table = report.coverage_markdown(doc)
    say("")
    say(table)
    _write(str(out / "coverage.md"), table)
    _write(str(out / "coverage.json"), json.dumps(doc, indent=2) + "\n")
    say(f"coverage: {out / 'coverage.md'}, {out / 'coverage.json'}, data {out / '.coverage'}")


def _launchers(work: str, timeout_s: float) -> Callable[[int], Any]:
    """A ``Launcher`` per rank count, its launches' files under ``work``: a rank that waits for
    the others twice the collective timeout at a stage end has a peer that hung (launcher.py)."""
    from conformance.launcher import Launcher

    made: dict[int, Launcher] = {}

    def launcher(nproc: int) -> Launcher:
        if nproc not in made:
            made[nproc] = Launcher(nproc, Path(work) / f"ranks{nproc}", 2 * timeout_s)
        return made[nproc]

    return launcher


def _assemble(state) -> list:
    """The run's results in case order from what the launches left: each case's result, or its
    crash."""
    from conformance.matrix import Case
    from conformance.results import CaseResult, case_from_json

    results = []
    for index in sorted(set(state.results) | set(state.crashed)):
        if index not in state.crashed:
            results.append(case_from_json(state.results[index]))
            continue
        start, crash = state.starts[index], state.crashed[index]
        reason = crash["summary"]
        if crash.get("verdict"):
            reason += f"; {crash['verdict']}: crashed in {crash['crashed_runs']} runs"
        case = Case(**start["fields"])
        seconds = crash["case_seconds"]
        results.append(CaseResult(case, "crashed", reason, seconds=seconds, crash=crash))
    return results


def _rank_argv(argv: list[str]) -> list[str]:
    """``argv`` less what only the launching process reads: ``--nproc``, ``--jsonl`` (the
    launcher passes the run's events file), ``--retry-crashed``."""
    takes_value = ("--nproc", "--jsonl", "--retry-crashed")
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in takes_value)):
            out.append(arg)
    return out


def _cases(args: argparse.Namespace, world_size: int):
    """The run's cases: the matrix (or --model's), then --only, --case and --shard in that order."""
    from conformance.adapters import get_adapter
    from conformance.matrix import build_matrix, parse_shard, select, shard
    from conformance.zoo import SPECS, register_model, spec_from_factory

    adapters = {}
    for spec in args.impl:
        adapter = get_adapter(spec)
        adapters[adapter.name] = adapter
    model = None
    if args.model is not None:
        model_spec = spec_from_factory(args.model)
        if SPECS.get(model_spec.name) is None:  # a second call in one process keeps the first
            register_model(model_spec)
        model = model_spec.name
    known = {name: a.strategies() for name, a in adapters.items()}
    features = {name: a.features() for name, a in adapters.items()}
    cases, notes = build_matrix(
        list(adapters),
        known,
        world_size,
        quick=args.quick,
        known_features=features,
        model=model,
        optimizers=args.optimizers,
    )
    cases = select(cases, args.only)
    if args.case:
        unknown = sorted(set(args.case) - {c.name for c in cases})
        if unknown:
            raise SystemExit(f"conformance: no such case (see --list): {', '.join(unknown)}")
        cases = [c for c in cases if c.name in set(args.case)]
    if args.shard is not None:
        index, count = parse_shard(args.shard)
        notes.append(
            f"shard {index}/{count}: {len(cases[index - 1 :: count])} cases of {len(cases)}"
        )
        cases = shard(cases, index, count)
    return cases, notes, adapters


def run_rank(args: argparse.Namespace) -> int:
    """One rank's whole run: join the group, run the cases of ``--case-range``, write each
    result to the events file; under torchrun, rank 0 also prints the summary and reports."""
    if args.launch_dir:
        from conformance.launcher import rank_setup

        rank_setup(args.launch_dir)  # stderr to the launch's files, faulthandler, heartbeat
        if args.coverage is not None:  # before any case imports the implementation
            from conformance.launcher import start_coverage

            start_coverage(args.launch_dir, coverage_packages(args))

    import torch
    import torch.distributed as dist

    from conformance import report
    from conformance.curves import CurveRecorder
    from conformance.launcher import EventLog, save_coverage
    from conformance.runner import run_cases, set_observer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    # Rank 0 shows each distinct warning once per run; N ranks x M cases of copies are noise.
    warnings.simplefilter("once" if rank == 0 else "ignore")
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend,
        timeout=datetime.timedelta(seconds=args.timeout * 2 + 60),
        device_id=device if device.type == "cuda" else None,
    )
    events = EventLog(args.jsonl) if args.jsonl and rank == 0 else None
    curves = CurveRecorder() if rank == 0 else None  # for the HTML report, in every report
    try:
        if args.self_test_plan:
            from conformance.selftest import rank_main

            rank_main(args.self_test_plan, device)
            return 0
        if args.world_size_run:
            from conformance.world_size import rank_main as world_size_rank

            world_size_rank(args, device, events)
            _leave_together()
            return 0
        world_size = dist.get_world_size()
        cases, notes, adapters = _cases(args, world_size)
        first, last = _case_range(args.case_range, len(cases))

        def say(line: str) -> None:
            if rank == 0:
                print(line, flush=True)  # stdout is often a pipe: flush, or lines arrive at exit

        def emit(event: dict[str, Any]) -> None:
            if events is not None:
                events.write(event)

        meta = {
            "impls": list(adapters),
            "world_size": world_size,
            "backend": args.backend,
            "device": device.type,
            "steps": args.steps,
            "quick": args.quick,
            "optimizers": args.optimizers,
            "only": args.only,
            "case": args.case,
            "shard": args.shard,
            "model": args.model,
            "exitfirst": args.exitfirst,
        }
        emit({"event": "run", "cases": [c.name for c in cases], "notes": notes, "meta": meta})
        if first == 0:  # not again when fresh ranks go on after a crash
            say(
                f"conformance: {len(cases)} cases for {', '.join(adapters)} at world size "
                f"{world_size} ({args.backend}, {device.type}), {args.steps} steps + a state-dict "
                "round trip each"
            )
            for note in notes:
                say(f"note: {note}")

        def started(index: int, case) -> None:
            fields = dataclasses.asdict(case)
            emit({"event": "start", "index": first + index, "case": case.name, "fields": fields,
                  "time": time.time()})  # fmt: skip

        def done(index: int, total: int, result) -> None:
            save_coverage()  # what a rank measured survives its death in a later case
            if curves is not None:
                result.curves = curves.pop(result.case.name)
            say(report.format_progress(first + index, len(cases), result))
            emit({"event": "case", "index": first + index, **report.case_json(result)})

        start = time.perf_counter()
        set_observer(curves)
        results = run_cases(
            cases[first:last],
            adapters,
            steps=args.steps,
            device=device,
            timeout_s=args.timeout,
            progress=done,
            exitfirst=args.exitfirst,
            started=started,
        )
        elapsed = time.perf_counter() - start
        emit({"event": "end", "seconds": round(elapsed, 2)})
        if args.launch_dir:  # the launching process reports, from the events file
            _leave_together()
            return 0
        status = report.exit_status(results)
        if rank == 0:
            meta["seconds"] = round(elapsed, 2)
            status = _finish(args, results, meta, say)
        if args.compare_to is not None:  # only rank 0 compared: every rank exits alike
            shared = [status]
            dist.broadcast_object_list(shared, src=0)
            status = shared[0]
        _leave_together()
        return status  # under torchrun every rank exits with it
    finally:
        if events is not None:
            events.close()
        dist.destroy_process_group()


def _case_range(text: str | None, total: int) -> tuple[int, int]:
    """``--case-range A:B`` (B empty: to the end) as (A, B); the whole list without it."""
    if not text:
        return 0, total
    first, _, last = text.partition(":")
    return int(first), int(last) if last else total


def _finish(
    args: argparse.Namespace,
    results: list,
    meta: dict[str, Any],
    say: Callable[[str], None],
    outside: Sequence[dict[str, Any]] = (),
) -> int:
    """Print the summary, compare with the baseline, write the reports; the exit status."""
    from conformance import report

    status = report.exit_status(results, outside)
    say("")
    say(report.format_summary(results, outside))
    say(f"wall time {meta['seconds']:.1f} s")
    text = report.to_json(results, meta, outside)
    markdown = report.to_markdown(results, outside=outside)
    if args.compare_to is not None:
        comparison = _compare(args, json.loads(text))
        say("")
        say(comparison.format())
        # A crash wins: the cases after a dead rank ran in fresh ranks, but the one it killed
        # has no result to compare.
        status = status if status == report.EXIT_CRASHED else comparison.exit_status
        doc = json.loads(text)
        doc["comparison"] = comparison.to_json()
        doc["exit_status"] = status
        text = json.dumps(doc, indent=2)  # already strict: to_json made it so
        markdown += "\n" + comparison.format_markdown()
    _write(args.json, text)
    _write(args.junit, report.to_junit(results, outside=outside))
    _write(args.markdown, markdown)
    if args.html is not None:
        from conformance.baseline import load_report
        from conformance.html import render

        baseline = None if args.compare_to is None else load_report(args.compare_to)
        _write(args.html, render(json.loads(text), baseline, args.compare_to))
    return status


def _leave_together() -> None:
    """The last collective: an all-reduce whose tensor this holds until gloo's thread drops it.

    A gloo thread that drops a finished collective's tensor while the interpreter shuts down is
    ended inside a noexcept destructor: "terminate called without an active exception"
    (pytorch/pytorch#190489). fsdp_lite.tools.launch.leave_together does the same for fsdp_lite's
    scripts; this package imports no implementation outside its adapters.
    """
    import torch
    import torch.distributed as dist

    device = "cpu" if "gloo" in dist.get_backend() else torch.accelerator.current_accelerator()
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    deadline = time.monotonic() + 10.0
    while token._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL the thread needs
    time.sleep(0.01)


def _compare(args: argparse.Namespace, doc: dict):
    from conformance.baseline import DEFAULT_FACTOR, compare_reports, load_report

    factor = DEFAULT_FACTOR if args.regression_factor is None else args.regression_factor
    return compare_reports(load_report(args.compare_to), doc, args.compare_to, factor)


def _write(path: str | None, text: str) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
