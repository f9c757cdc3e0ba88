"""``python -m conformance --self-test``: plant each catalogued bug in fsdp_lite and see what catches it.

The parent process copies the fsdp_lite package once per catalog entry (catalog.py) into a
scratch directory and applies the entry's patches there; an anchor that is not found exactly once
stops everything before a rank starts, naming the entry ("stale": re-anchor it). Then one launch
per world size runs every entry in turn: the ranks import the entry's copy in place of the last
one (adapters/lite.py ``load_from``), run the matrix (``--quick`` or the default) with the entry's
likely killers first, and stop at the first failing case. The recorded references serve every
entry, since they do not depend on the implementation. At the end the clean copy runs every case
that caught something, so that no kill is the scratch copy's own doing. The parent prints the kill
table: per entry the case and stage that caught it, or "missed".

Note [One launch, many copies]: a launch costs seconds and the references more, so the entries
share one process group, and isolation comes from the import system: every ``fsdp_lite`` module
is dropped from ``sys.modules`` before the next copy is imported, and the import is checked to come
from that copy. Models wrapped by an earlier copy are gone by then (each case builds its own). A
bug that kills a rank ends the launch; the parent then counts that entry as caught ("a rank
died", which is what a user of the suite would see: the case it died in, which rank, how, and
its native message, from launcher.py) and launches again for the entries left.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conformance import catalog as _catalog
from conformance.catalog import Bug

__all__ = [
    "DEFAULT_FIRST",
    "SCHEMA_VERSION",
    "Kill",
    "StaleEntry",
    "format_table",
    "order_cases",
    "plant",
    "run",
    "select_entries",
    "stale_patches",
]

SCHEMA_VERSION = 1  # of the --json report of a self-test
# After an entry's own ``first`` patterns: cases that catch most bugs of a step, cheaply.
DEFAULT_FIRST = (
    "*/FULL_SHARD/fp32/plain/lm_untied/*",
    "*/SHARD_GRAD_OP/fp32/plain/lm_untied/*",
    "*/NO_SHARD/fp32/plain/lm_untied/*",
    "*/FULL_SHARD/bf16/plain/lm_untied/*",
    "*/FULL_SHARD/fp16/plain/lm_untied/*",
)
SELF_TEST_TIMEOUT_S = 20.0  # a planted hang costs this much; no correct case comes near it


class StaleEntry(Exception):
    """A catalog entry whose anchor is not in the source once: it must be re-anchored."""


@dataclass
class Kill:
    """What happened to one entry: caught (by which case and stage), missed, or not judged."""

    name: str
    bug_class: str
    world_size: int
    status: str  # "caught" | "missed" | "stale" | "not run" | "false kill"
    case: str | None = None  # the first case that failed
    stage: str | None = None  # "grads (step 1)", "raised in ...", "a rank died"
    cases_run: int = 0
    seconds: float = 0.0


# ---- choosing and planting -----------------------------------------------------------------


def select_entries(patterns: list[str], catalog: tuple[Bug, ...] | None = None) -> list[Bug]:
    """Entries of ``catalog`` (default CATALOG) whose name matches a pattern (glob with * ? [,
    else substring); all of them without any."""
    catalog = _catalog.CATALOG if catalog is None else catalog
    if not patterns:
        return list(catalog)

    def matches(name: str, pattern: str) -> bool:
        if any(ch in pattern for ch in "*?["):
            return fnmatch.fnmatchcase(name, pattern)
        return pattern in name

    return [b for b in catalog if any(matches(b.name, p) for p in patterns)]


def stale_patches(bugs: list[Bug], package: Path) -> list[str]:
    """A line per patch whose anchor does not occur exactly once in its file (nothing copied)."""
    problems = []
    for bug in bugs:
        for patch in bug.patches:
            path = package / patch.file
            text = path.read_text() if path.exists() else None
            found = 0 if text is None else text.count(patch.anchor)
            if found != 1:
                where = "no such file" if text is None else f"found {found} times"
                first_line = patch.anchor.strip().splitlines()[0]
                problems.append(
                    f"{bug.name}: fsdp_lite/{patch.file}: anchor {first_line!r} {where}; "
                    "re-anchor the entry in conformance/catalog.py"
                )
    return problems


def plant(bug: Bug | None, package: Path, dest: Path) -> Path:
    """Copy ``package`` to ``dest/fsdp_lite`` with ``bug``'s patches applied (None: clean);
    returns ``dest``, the directory to import it from."""
    target = dest / "fsdp_lite"
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for patch in bug.patches if bug is not None else ():
        path = target / patch.file
        text = path.read_text() if path.exists() else ""
        if text.count(patch.anchor) != 1:
            raise StaleEntry("\n".join(stale_patches([bug], package)))
        path.write_text(text.replace(patch.anchor, patch.replacement))
    return dest


def order_cases(cases: list, first: tuple[str, ...]) -> list:
    """``cases`` with those matching ``first`` (then DEFAULT_FIRST) moved ahead, in that order."""
    from conformance.matrix import select

    ordered: list = []
    for pattern in (*first, *DEFAULT_FIRST):
        ordered += [c for c in select(cases, [pattern]) if c not in ordered]
    return ordered + [c for c in cases if c not in ordered]


# ---- the parent: plant, launch per world size, read, report --------------------------------


def run(args: argparse.Namespace, launch) -> int:
    """The whole self-test; ``launch(nproc, argv)`` starts the ranks (cli.py). Returns the exit
    status: 0 every entry caught, 1 some missed, 2 stale entries or a kill the clean copy shares."""
    from conformance.adapters.lite import package_dir

    bugs = select_entries(args.only)
    if not bugs:
        print(f"conformance: no catalog entry matches {args.only}", file=sys.stderr)
        return 2
    package = package_dir()
    problems = stale_patches(bugs, package)
    if problems:
        print("conformance: stale catalog entries (their anchors are not in the source once):")
        print("\n".join(f"  {p}" for p in problems))
        return 2
    matrix = "quick" if args.quick else "default"
    print(
        f"conformance self-test: {len(bugs)} planted bugs in copies of {package}, the {matrix} "
        f"matrix, stopping at each entry's first failing case"
    )
    start = time.perf_counter()
    kills: dict[str, Kill] = {}
    with tempfile.TemporaryDirectory(prefix="conformance-selftest-") as tmp:
        work = Path(tmp)
        control = str(plant(None, package, work / "clean"))
        roots = {b.name: str(plant(b, package, work / b.name)) for b in bugs}
        for world_size in sorted({b.world_size for b in bugs}):
            group = [b for b in bugs if b.world_size == world_size]
            kills.update(_run_group(args, launch, work, group, roots, control, world_size))
    seconds = time.perf_counter() - start
    ordered = [kills[b.name] for b in bugs]
    print()
    print(format_table(ordered))
    print(f"wall time {seconds:.0f} s")
    _write(args.json, json.dumps(_report(ordered, bugs, args, seconds), indent=2))
    _write(args.markdown, format_markdown(ordered, bugs, matrix))
    if any(k.status in ("stale", "false kill", "not run") for k in ordered):
        return 2
    return int(any(k.status == "missed" for k in ordered))


def _run_group(
    args, launch, work: Path, group: list[Bug], roots, control: str, world_size: int, confirm=True
):
    """Every entry of ``group`` at ``world_size``: launches until each has an outcome, then (if
    ``confirm``) one launch of the clean copy on the cases that caught them.

    An entry may also carry (as conformance/mutants.py's do) ``impls``, several adapters in place
    of ``impl``; ``cases``, the only case names to run; ``modules``, modules imported right after
    the copy, so that one that fails to import is told apart from a case that fails;
    ``exitfirst`` False to run every case. ``args`` may carry ``optimizers`` (default sgd) and
    ``coverage_dir``: where each rank writes the lines of the copies it runs that each case
    executed (a coverage.py context per case).
    """
    kills: dict[str, Kill] = {}
    pending = list(group)
    attempt = 0

    def launch_plan(entries: list[Bug], control_cases: list[str]):
        nonlocal attempt
        attempt += 1
        plan_path = work / f"plan-ws{world_size}-{attempt}.json"
        results_path = work / f"results-ws{world_size}-{attempt}.jsonl"
        plan = {
            "entries": [
                {
                    "name": b.name,
                    "bug_class": b.bug_class,
                    "root": roots[b.name],
                    "first": b.first,
                    "impl": b.impl,
                    "impls": getattr(b, "impls", None),
                    "cases": getattr(b, "cases", None),
                    "modules": getattr(b, "modules", ()),
                    "exitfirst": getattr(b, "exitfirst", True),
                }
                for b in entries
            ],
            "optimizers": getattr(args, "optimizers", ["sgd"]),
            "coverage": getattr(args, "coverage_dir", None),
            "control": control,
            "control_cases": control_cases,
            "quick": args.quick,
            "steps": args.steps,
            "timeout": args.timeout,
            "results": str(results_path),
        }
        plan_path.write_text(json.dumps(plan))
        death = launch(
            world_size,
            ["--self-test-plan", str(plan_path), "--steps", str(args.steps)]
            + ["--timeout", str(args.timeout)],
        )
        return _read_events(results_path), death

    while pending:
        events, death = launch_plan(pending, [])
        for e in events:
            if e["event"] == "done":
                kills[e["name"]] = Kill(**e["kill"])
        started = [e["name"] for e in events if e["event"] == "start"]
        crashed = [n for n in started if n not in kills]
        for name in crashed:  # the launch ended inside this entry: a rank died
            bug = next(b for b in group if b.name == name)
            # The case it died in (kept out of ``case``: the clean copy's control run must not
            # die with it) and how (a launcher.Death, when the launch function gives one).
            cases = [e["case"] for e in events if e["event"] == "case_start" and e["name"] == name]
            stage = "a rank died" + (f" in {_short(cases[-1])}" if cases else "")
            summary = getattr(death, "summary", None)
            stage += f": {summary()}" if summary else ""
            kills[name] = Kill(name, bug.bug_class, world_size, "caught", stage=stage)
            print(f"conformance: {name}: {stage}; launching again for the entries left")
        left = [b for b in pending if b.name not in kills]
        if len(left) == len(pending):  # no progress: the launch itself is broken
            for b in left:
                kills[b.name] = Kill(b.name, b.bug_class, world_size, "not run")
            break
        pending = left
    killers = sorted({k.case for k in kills.values() if k.case is not None})
    if killers and confirm:
        events, _ = launch_plan([], killers)
        failed = next((e["failed"] for e in events if e["event"] == "control"), None)
        if failed is None:  # the control launch did not finish: no kill is confirmed
            failed = killers
        for k in kills.values():
            if k.case in failed:
                k.status = "false kill"
    return kills


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            break  # a line cut short by a dying rank
    return events


# ---- the ranks -----------------------------------------------------------------------------


def rank_main(plan_path: str, device) -> None:
    """One rank's part of a launch: every entry of the plan in turn, then the control run.

    Rank 0 appends one JSON line per event to the plan's results file, flushed at once, so the
    parent reads how far a launch got even when a rank dies.
    """
    import torch.distributed as dist

    from conformance.adapters import get_adapter
    from conformance.adapters.lite import load_from
    from conformance.matrix import build_matrix
    from conformance.reference import ReferenceCache
    from conformance.runner import run_cases

    with open(plan_path) as f:
        plan = json.load(f)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = open(plan["results"], "a") if rank == 0 else None

    def emit(event: dict[str, Any]) -> None:
        if out is not None:
            out.write(json.dumps(event) + "\n")
            out.flush()

    def matrix(*adapters):
        cases, _ = build_matrix(
            [a.name for a in adapters],
            {a.name: a.strategies() for a in adapters},
            world_size,
            quick=plan["quick"],
            known_features={a.name: a.features() for a in adapters},
            optimizers=plan.get("optimizers", ["sgd"]),
        )
        return cases

    coverage = _case_coverage(plan["coverage"], rank) if plan.get("coverage") else None

    # The references depend on the implementation only through its adapter's declared semantics
    # (ReferenceCache.key), not its code.
    references = ReferenceCache()
    if plan.get("control_cases"):
        # The clean copy on every case that caught something: a failure there is no planted
        # bug's. A launch of its own, so that no entry's aftermath can reach it.
        load_from(plan["control"])
        wanted = set(plan["control_cases"])
        adapters = [get_adapter(n) for n in sorted({c.partition("/")[0] for c in wanted})]
        control = run_cases(
            [c for c in matrix(*adapters) if c.name in wanted],
            adapters,
            steps=plan["steps"],
            device=device,
            timeout_s=plan["timeout"],
            references=references,
        )
        failed = [r.case.name for r in control if r.status != "passed"]
        emit({"event": "control", "cases": len(control), "failed": failed})
        for r in control:
            if r.status != "passed" and rank == 0:
                print(f"clean fsdp_lite fails {r.case.name} too: {r.reason}", flush=True)
    entries = plan["entries"]
    for index, entry in enumerate(entries):
        emit({"event": "start", "name": entry["name"]})
        try:
            load_from(entry["root"])
            for module in entry.get("modules") or ():
                importlib.import_module(module)
        except Exception as e:  # the copy does not import: no case can run it
            stage = f"import error: {type(e).__name__}: {e}".splitlines()[0][:160]
            kill = Kill(entry["name"], entry["bug_class"], world_size, "caught", stage=stage)
            emit({"event": "done", "name": entry["name"], "kill": asdict(kill)})
            continue
        adapters = [get_adapter(n) for n in entry.get("impls") or [entry.get("impl", "fsdp_lite")]]
        cases = order_cases(matrix(*adapters), tuple(entry["first"]))
        if entry.get("cases") is not None:
            wanted = set(entry["cases"])
            cases = [c for c in cases if c.name in wanted]
        start = time.perf_counter()

        def case_started(_, case, name=entry["name"]):
            # which case a rank died in, if one does (Note [One launch, many copies])
            emit({"event": "case_start", "name": name, "case": case.name})
            if coverage is not None:
                coverage.switch_context(case.name)

        results = run_cases(
            cases,
            adapters,
            steps=plan["steps"],
            device=device,
            timeout_s=plan["timeout"],
            exitfirst=entry.get("exitfirst", True),
            references=references,
            started=case_started,
        )
        kill = Kill(
            entry["name"],
            entry["bug_class"],
            world_size,
            "missed",
            cases_run=len(results),
            seconds=round(time.perf_counter() - start, 2),
        )
        failed = next((r for r in results if r.status == "failed"), None)
        if failed is not None:
            kill.status, kill.case, kill.stage = "caught", failed.case.name, _stage(failed)
        emit({"event": "done", "name": entry["name"], "kill": asdict(kill)})
        if rank == 0:
            where = f"by {kill.case}: {kill.stage}" if kill.case else "MISSED"
            print(
                f"[{index + 1:>2}/{len(entries)}] {entry['name']}: {kill.status} {where} "
                f"({kill.cases_run} cases, {kill.seconds:.1f} s)",
                flush=True,
            )
        if failed is not None and failed.traceback is not None and index + 1 < len(entries):
            # A case that raised may have left collectives half done (a timeout, a closed
            # connection): the entries left get a fresh launch, see Note [One launch, many copies].
            emit({"event": "restart"})
            break
    if coverage is not None:
        coverage.stop()
        coverage.save()
    if out is not None:
        out.close()


def _case_coverage(directory: str, rank: int):
    """A started coverage.Coverage that records, per case (its context), the lines run of every
    fsdp_lite copy this rank imports; saved under ``directory``, a data file per rank."""
    import coverage

    cov = coverage.Coverage(
        data_file=str(Path(directory) / ".coverage"),
        data_suffix=f"rank{rank}.{os.getpid()}",
        include=["*/fsdp_lite/*"],
        config_file=False,
    )
    cov.start()
    return cov


def _stage(result) -> str:
    """Where a failed case failed first, for the kill table: a comparison, or where it raised."""
    first = result.first_failure()
    if first is not None:
        return f"{first[1]} (step {first[0]})"
    return (result.reason or "raised").splitlines()[0][:120]


# ---- reports -------------------------------------------------------------------------------


def format_table(kills: list[Kill], times: bool = True) -> str:
    """The kill table for the terminal (``times``: with each entry's wall time), then the counts."""
    header = ("entry", "class", "ws", "result", "caught by (case: stage)", "cases", "time")
    rows = [header]
    for k in kills:
        caught = f"{_short(k.case)}: {k.stage}" if k.case else (k.stage or "-")
        rows.append(
            (
                k.name,
                k.bug_class,
                str(k.world_size),
                k.status,
                caught[:110],
                str(k.cases_run),
                f"{k.seconds:.1f}s",
            )
        )
    if not times:
        rows = [r[:-1] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts = {s: sum(k.status == s for k in kills) for s in ("caught", "missed")}
    lines += [
        "",
        f"{len(kills)} planted bugs: {counts['caught']} caught, {counts['missed']} missed"
        + "".join(
            f", {sum(k.status == s for k in kills)} {s}"
            for s in ("stale", "not run", "false kill")
            if any(k.status == s for k in kills)
        ),
    ]
    return "\n".join(lines)


def format_markdown(kills: list[Kill], bugs: list[Bug], matrix: str) -> str:
    """The kill table as Markdown, with each entry's bug, upstream reference and patched files."""
    by_name = {b.name: b for b in bugs}
    lines = [
        f"| entry | class | ranks | {matrix} matrix: caught by (case: stage) | planted in | upstream |",
        "|---|---|---|---|---|---|",
    ]
    for k in kills:
        bug = by_name[k.name]
        caught = f"`{_short(k.case)}`: {k.stage}" if k.case else f"**{k.status}**"
        files = ", ".join(sorted({f"`{p.file}`" for p in bug.patches}))
        lines.append(
            f"| `{k.name}`: {bug.what} | {bug.bug_class} | {k.world_size} | "
            f"{caught.replace('|', '/')} | {files} | {bug.upstream or '-'} |"
        )
    caught = sum(k.status == "caught" for k in kills)
    lines += ["", f"{caught} of {len(kills)} caught."]
    return "\n".join(lines) + "\n"


def _short(case: str | None) -> str:
    """A case name without its implementation and world size (the table says those)."""
    if case is None:
        return "-"
    parts = case.split("/")
    return "/".join(parts[1:-1])


def _report(kills: list[Kill], bugs: list[Bug], args, seconds: float) -> dict[str, Any]:
    by_name = {b.name: b for b in bugs}
    return {
        "schema": "conformance-self-test",
        "schema_version": SCHEMA_VERSION,
        "matrix": "quick" if args.quick else "default",
        "steps": args.steps,
        "seconds": round(seconds, 1),
        "summary": {
            s: sum(k.status == s for k in kills)
            for s in ("caught", "missed", "stale", "not run", "false kill")
        },
        "entries": [
            {
                **asdict(k),
                "what": by_name[k.name].what,
                "upstream": by_name[k.name].upstream,
                "patches": [
                    {"file": p.file, "anchor": p.anchor, "replacement": p.replacement}
                    for p in by_name[k.name].patches
                ],
            }
            for k in kills
        ],
    }


def _write(path: str | None, text: str) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main_guard(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot run a self-test, or None (cli.py checks this before anything runs)."""
    if "RANK" in os.environ and not args.self_test_plan:
        return "--self-test launches its own ranks: run it without torchrun"
    if args.impl != ["fsdp_lite"]:
        return "--self-test plants bugs in fsdp_lite: it takes no --impl"
    if args.model or args.case or args.shard or args.compare_to or args.retry_crashed:
        return "--self-test takes --quick, --only (entry names), --steps, --timeout, --json, --markdown"
    return None
