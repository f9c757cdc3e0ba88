"""Starting the ranks, noticing when one dies or hangs, and going on with the cases left.

Note [Results that survive a rank]: every case runs in one process group while nothing dies
(a launch costs seconds, a case a fraction of one), so a rank that dies natively (a signal, glibc
aborting on a double free, a C++ exception escaping on gloo's thread, ``os._exit``) or stops making
progress takes the whole group with it. What the run knew must not go with it:

* rank 0 appends one JSON line per event to the run's events file, flushed at once: ``run`` (the
  case list), ``start`` before each case, ``case`` with its result as soon as it is known, ``end``
  (cli.py ``run_rank``; the ``--jsonl`` option keeps the file);
* each rank's stderr, native messages included, goes to a file of the launch (forwarded to this
  process's stderr as it comes), since the native message is what says why a rank died;
* the launching process watches each rank's heartbeat (runner.py, Note [Progress]): a rank that
  has waited ``2 * --timeout`` seconds at a stage end for the others has a peer that hung (the
  control group would end that wait at ``2 * --timeout + 30`` with an error, and the rank with
  it); every rank's Python stacks are dumped (SIGUSR1, faulthandler), the ranks that were not
  waiting are the ones that hung, and the ranks are killed;
* when the launch ends with a dead rank, the case that was open in the events file is recorded
  ``crashed`` (which rank, the signal or exit code, the last stage every rank passed, the last
  lines of its stderr), a ``crashed`` line is appended to the events file, and fresh ranks go on
  from the next case; ``--retry-crashed N`` first starts fresh ranks from the crashed case itself,
  up to N times, and calls the crash ``flaky`` if a rerun ran it to its end (that launch then goes
  on with the cases after it), else ``deterministic``.

A death outside any case (while starting, between two cases, at exit) is kept too, without a
case. Nothing of this costs the normal path more than a write per stage on rank 0 and a thread in
the launching process that polls a few files.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "Death",
    "EventLog",
    "Launcher",
    "Survived",
    "combine_coverage",
    "rank_setup",
    "read_events",
    "run_surviving",
    "save_coverage",
    "start_coverage",
]

_TAIL_LINES = 40  # of a dead rank's stderr kept in the report, from its native message on
_TAIL_CHARS = 6000
_READ_BYTES = 1 << 16  # of the end of its stderr file, searched for the native message
_POLL_S = 0.1  # the launching process's look at the stderr files and the heartbeat
_DUMP_WAIT_S = 1.0  # after SIGUSR1, for faulthandler to write every rank's stacks
_HEARTBEAT_BYTES = 256
# What glibc, the C++ runtime and CPython print when a process dies natively (scripts/
# soak_matrix.py hunts the same lines): the line that says most, for a one-line reason.
_NATIVE = re.compile(
    r"(?m)^.*(?:free\(\): .*|malloc\(\): .*|double free.*|corrupted .*|munmap_chunk\(\).*"
    r"|terminate called .*|Segmentation fault.*|Fatal Python error: .*)$"
)
# What a rank prints when it gave up on a peer that died: never the root of a death.
_FOLLOWER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|timed out|Timeout",
    re.IGNORECASE,
)


# ---- events ------------------------------------------------------------------------------------


class EventLog:
    """JSON lines appended to ``path``, each flushed to the kernel at once: a line written before
    a rank dies is there after it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the run

    def write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every whole line of an events file (a line cut short by a dying rank ends the list)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            break
    return events


# ---- the rank's side ---------------------------------------------------------------------------


class _Heartbeat:
    """A rank's state (runner.py, Note [Progress]) in a small file: "busy", "waiting" or "idle",
    and where; its mtime says since when. One fixed-size write at the file's start per call, so
    the file is never seen half-written."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self, state: str, where: str) -> None:
        data = f"{state} {where}".encode()[: _HEARTBEAT_BYTES - 1]
        os.pwrite(self._fd, data.ljust(_HEARTBEAT_BYTES), 0)


def rank_setup(launch_dir: str) -> None:
    """A rank of a launch by ``Launcher``: stderr into the launch's file for this rank, Python's
    stacks on a fatal signal and on SIGUSR1, the pid for the watchdog, the heartbeat."""
    from conformance import runner

    directory = Path(launch_dir)
    rank = int(os.environ["RANK"])
    sys.stderr.flush()
    fd = os.open(directory / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)  # native writes too (glibc, libstdc++), not only Python's
    os.close(fd)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    (directory / f"rank{rank}.pid").write_text(str(os.getpid()))
    runner.set_heartbeat(_Heartbeat(directory / f"rank{rank}.heartbeat"))


# ---- coverage of the judged implementation (--coverage) ----------------------------------------
#
# Note [Coverage across ranks]: each rank of a launch measures the judged packages from before
# the first case (nothing of the implementation is imported before its adapter's first wrap),
# into a data file of its own in the launch's directory, tagged ``launchK/rankR`` (a static
# context). A rank saves after every case and at exit, and on torchrun's SIGTERM when a peer died
# (coverage's sigterm option), so fresh ranks after a crash add to what the dead ones measured;
# only a rank that dies natively or is killed loses its open case. The launching process combines
# every launch's files at the end (``combine_coverage``).

_coverage: Any = None  # this rank's coverage.Coverage, while it measures


def start_coverage(launch_dir: str, packages: list[str]) -> None:
    """Measure line and branch coverage of ``packages`` in this rank until it exits."""
    import atexit

    import coverage

    global _coverage
    rank = int(os.environ["RANK"])
    cov = coverage.Coverage(
        data_file=str(Path(launch_dir) / "coverage" / ".coverage"),
        data_suffix=True,  # .coverage.HOST.PID.RANDOM: one file per process
        branch=True,
        source=packages,
        context=f"{Path(launch_dir).name}/rank{rank}",  # e.g. launch2/rank1
        config_file=False,  # the user's .coveragerc is for their own tests, not this
    )
    cov.set_option("run:sigterm", True)
    cov.start()
    _coverage = cov
    atexit.register(save_coverage, stop=True)


def save_coverage(stop: bool = False) -> None:
    """Write what this rank measured so far to its data file (and stop measuring, if ``stop``)."""
    global _coverage
    if _coverage is None:
        return
    if stop:
        _coverage.stop()
    _coverage.save()
    if stop:
        _coverage = None


# ---- the launching process's side --------------------------------------------------------------


@dataclasses.dataclass
class Death:
    """How a launch ended when it did not end well."""

    kind: str  # "signal" | "exit" | "hang"
    rank: int | None  # the rank that died first (or hung); None when it cannot be told
    signal: str | None = None  # "SIGSEGV"
    signal_number: int | None = None
    exit_code: int | None = None
    after: str | None = None  # the last stage every rank passed (the heartbeat), if in a case
    native: str | None = None  # the line of its stderr that says most
    stderr_tail: str = ""
    ranks: dict[str, str] = dataclasses.field(default_factory=dict)  # rank -> how it ended
    seconds: float | None = None  # a hang: how long a rank waited for the others
    at: float = dataclasses.field(default_factory=time.time)  # when the launcher saw it

    def summary(self) -> str:
        """One line, e.g. ``rank 1 died: Signal 11 (SIGSEGV), after 'step 1, comparing loss':
        Fatal Python error: Segmentation fault``."""
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        if self.kind == "hang":
            text = (
                f"{who} hung: a rank waited {self.seconds:.0f} s for it at a stage end, and the "
                "launcher killed the ranks"
            )
        elif self.kind == "signal":
            text = f"{who} died: Signal {self.signal_number} ({self.signal})"
        else:
            text = f"{who} died: exit code {self.exit_code}"
        if self.after:
            text += f", after {self.after!r}"
        if self.native:
            text += f": {self.native}"
        return text

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "summary": self.summary()}


class Launcher:
    """Launches of ``python -m conformance`` on ``nproc`` local ranks, each reporting how it ended.

    Through torchrun's own entry point (``--standalone``), so that judging any FSDP needs nothing
    but torch installed.
    """

    def __init__(
        self,
        nproc: int,
        work: str | os.PathLike,
        hang_after_s: float,
        torchrun: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.nproc = nproc
        self.work = Path(work)
        self.hang_after_s = hang_after_s
        self.launches = 0
        self._torchrun = torchrun or _torchrun_main

    def run(self, argv: list[str]) -> Death | None:
        """``python -m conformance ARGV`` on the ranks; None when every rank exited 0."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        self.launches += 1
        launch_dir = self.work / f"launch{self.launches}"
        launch_dir.mkdir(parents=True)
        watch = _Watch(launch_dir, self.nproc, self.hang_after_s)
        watch.start()
        failures: dict[int, Any] = {}
        try:
            self._torchrun(
                # --standalone: a c10d rendezvous on a free local port; torchrun also sets
                # OMP_NUM_THREADS=1 for the ranks, so they do not fight over the cores.
                [
                    "--standalone",
                    f"--nproc-per-node={self.nproc}",
                    "--module",
                    "conformance",
                    *argv,
                    "--launch-dir",
                    str(launch_dir),
                ]
            )
        except ChildFailedError as e:
            failures = dict(e.failures)
        finally:
            watch.stop()
        if not failures and watch.hung is None:
            return None
        return _death(launch_dir, self.nproc, failures, watch)

    def launch_dirs(self) -> list[Path]:
        """The directories of the launches so far, in order."""
        return [self.work / f"launch{n}" for n in range(1, self.launches + 1)]


def combine_coverage(launch_dirs: list[Path], out_dir: Path, packages: list[str]) -> dict[str, Any]:
    """Combine every launch's coverage data into ``out_dir/.coverage``; per file of ``packages``
    its line and branch coverage, as a JSON-ready dict (Note [Coverage across ranks])."""
    import coverage

    out_dir.mkdir(parents=True, exist_ok=True)
    data_dirs = [d / "coverage" for d in launch_dirs if (d / "coverage").is_dir()]
    data_files = [f for d in data_dirs for f in sorted(d.glob(".coverage.*"))]
    cov = coverage.Coverage(
        data_file=str(out_dir / ".coverage"), branch=True, source=packages, config_file=False
    )
    cov.erase()  # a previous run's data in out_dir is not this run's
    cov.combine([str(f) for f in data_files], keep=True)
    cov.save()
    data = cov.get_data()
    contexts = [c for c in data.measured_contexts() if re.fullmatch(r"launch\d+/rank\d+", c)]
    doc: dict[str, Any] = {
        "packages": packages,
        "coverage_version": coverage.__version__,
        "launches": len(launch_dirs),
        "data_files": len(data_files),
        "ranks": sorted({int(c.rpartition("rank")[2]) for c in contexts}),
        "contexts": sorted(contexts, key=_natural),  # launchK/rankR: who measured
        "totals": _coverage_counts(0, 0, 0, 0),
        "files": {},
    }
    if not data.measured_files():
        return doc
    report = out_dir / ".coverage.json.tmp"
    cov.json_report(outfile=str(report))
    raw = json.loads(report.read_text())
    report.unlink()
    roots = _package_roots(packages)
    for path, entry in sorted(raw["files"].items(), key=lambda kv: _display(kv[0], roots)):
        summary = entry["summary"]
        counts = _coverage_counts(
            summary["num_statements"],
            summary["covered_lines"],
            summary.get("num_branches", 0),
            summary.get("covered_branches", 0),
        )
        doc["files"][_display(path, roots)] = {**counts, "missing_lines": entry["missing_lines"]}
    totals = raw["totals"]
    doc["totals"] = _coverage_counts(
        totals["num_statements"],
        totals["covered_lines"],
        totals.get("num_branches", 0),
        totals.get("covered_branches", 0),
    )
    return doc


def _natural(text: str) -> list[Any]:
    """A sort key that puts launch10 after launch9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _coverage_counts(statements: int, lines: int, branches: int, taken: int) -> dict[str, Any]:
    """Counts and percentages (one decimal); a file without branches has no branch percentage."""
    return {
        "statements": statements,
        "covered_lines": lines,
        "line_percent": round(100.0 * lines / statements, 1) if statements else 100.0,
        "branches": branches,
        "covered_branches": taken,
        "branch_percent": round(100.0 * taken / branches, 1) if branches else None,
    }


def _package_roots(packages: list[str]) -> list[Path]:
    """The directories that hold each package (or module): paths are shown relative to them."""
    import importlib.util

    roots = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            origin = Path(spec.origin).resolve()
            depth = name.count(".") + (1 if spec.submodule_search_locations else 0)
            roots.append(origin.parents[depth])
    return roots


def _display(path: str, roots: list[Path]) -> str:
    """``path`` relative to the first root that holds it, e.g. ``fsdp_lite/engine/unit.py``."""
    resolved = Path(path).resolve()
    for root in roots:
        if resolved.is_relative_to(root):
            return resolved.relative_to(root).as_posix()
    return path


def _torchrun_main(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun

    torchrun(argv)


class _Watch(threading.Thread):
    """While a launch runs: copy each rank's stderr file to ours as it grows, and end a hang."""

    def __init__(self, launch_dir: Path, nproc: int, hang_after_s: float) -> None:
        super().__init__(name="conformance-watch", daemon=True)
        self.dir, self.nproc, self.hang_after_s = launch_dir, nproc, hang_after_s
        self.offsets = [0] * nproc
        # (the last stage every rank passed, seconds a rank waited, the ranks not waiting)
        self.hung: tuple[str, float, list[int]] | None = None
        self._finished = threading.Event()

    def run(self) -> None:
        while not self._finished.wait(_POLL_S):
            self._forward()
            if self.hung is None:
                self._check_progress()

    def stop(self) -> None:
        self._finished.set()
        self.join()
        self._forward()

    def _forward(self) -> None:
        out = sys.stderr
        for rank in range(self.nproc):
            try:
                with open(self.dir / f"rank{rank}.stderr", "rb") as f:
                    f.seek(self.offsets[rank])
                    data = f.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            self.offsets[rank] += len(data)
            if hasattr(out, "buffer"):  # the bytes as the rank wrote them
                out.flush()
                out.buffer.write(data)
                out.buffer.flush()
            else:  # a stream without bytes (a test's capture)
                out.write(data.decode(errors="replace"))
                out.flush()

    def _check_progress(self) -> None:
        beats = [read_heartbeat(self.dir, rank) for rank in range(self.nproc)]
        waited = [age for state, _, age in beats if state == "waiting"]
        if not waited or max(waited) <= self.hang_after_s:
            return
        # The last stage every rank passed: what a rank still busy in the case last synced.
        after = next((where for state, where, _ in beats if state == "busy"), "")
        stuck = [rank for rank, (state, _, _) in enumerate(beats) if state != "waiting"]
        self.hung = (after, max(waited), stuck)
        pids = _pids(self.dir, self.nproc)
        for pid in pids:  # every rank's Python stacks into its stderr file (faulthandler)
            _signal(pid, signal.SIGUSR1)
        time.sleep(_DUMP_WAIT_S)
        for pid in pids:
            _signal(pid, signal.SIGKILL)


def read_heartbeat(launch_dir: Path, rank: int) -> tuple[str, str, float]:
    """(state, where, seconds since it was written) of a rank's heartbeat; "idle" if none."""
    path = launch_dir / f"rank{rank}.heartbeat"
    try:
        age = time.time() - path.stat().st_mtime
        text = path.read_bytes().rstrip(b" \0").decode(errors="replace")
    except FileNotFoundError:
        return "idle", "", 0.0
    state, _, where = text.partition(" ")
    return state, where, age


def _pids(launch_dir: Path, nproc: int) -> list[int]:
    pids = []
    for rank in range(nproc):
        try:
            pids.append(int((launch_dir / f"rank{rank}.pid").read_text()))
        except (FileNotFoundError, ValueError):
            continue
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stderr(launch_dir: Path, rank: int) -> str:
    """The end of a rank's stderr file."""
    try:
        with open(launch_dir / f"rank{rank}.stderr", "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _READ_BYTES))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(text: str, start: str | None = None) -> str:
    """The lines of ``text`` from the last line equal to ``start`` (its native message, or the
    header of a stack dump), at most _TAIL_LINES; without one, its last lines."""
    lines = text.rstrip().splitlines()
    at = max((i for i, line in enumerate(lines) if line.strip() == start), default=None)
    chosen = lines[at : at + _TAIL_LINES] if at is not None else lines[-_TAIL_LINES:]
    return "\n".join(chosen)[:_TAIL_CHARS]


def _native(text: str) -> str | None:
    """The line of ``text`` that says most about a native death: glibc's or the C++ runtime's
    over CPython's "Fatal Python error" (which follows them), else its last line."""
    found = [m.group(0).strip() for m in _NATIVE.finditer(text)]
    own = [line for line in found if "Fatal Python error" not in line]
    if own or found:
        return (own or found)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _current_thread(text: str) -> list[str]:
    """The last faulthandler dump's block of the thread that took the signal ("Current
    thread", the main one): its header, then its frames, innermost first."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("Current thread")]
    if not heads:
        return []
    block = []
    for line in lines[heads[-1] :]:
        if not line.strip():
            break
        block.append(line.strip())
    return block


def _death(launch_dir: Path, nproc: int, failures: dict[int, Any], watch: _Watch) -> Death:
    # The last stage every rank passed: where the ranks still in the case last synced.
    beats = [read_heartbeat(launch_dir, rank) for rank in range(nproc)]
    synced = [where for state, where, _ in beats if state == "busy" and where != "started"]
    after = synced[0] if synced else None
    ranks = {}
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        ranks[str(rank)] = (
            f"Signal {-code} ({failure.signal_name()})" if code < 0 else (f"exit code {code}")
        )
    texts = {r: _stderr(launch_dir, r) for r in range(nproc)}
    if watch.hung is not None:
        hung_where, seconds, hung = watch.hung  # hung: the ranks that were not waiting
        blocks = {r: _current_thread(text) for r, text in texts.items()}  # their stacks, dumped
        rank = hung[0] if len(hung) == 1 else None
        shown = [rank] if rank is not None else list(texts)
        tail = "\n".join(
            f"--- rank {r} ---\n{_tail(texts[r], (blocks[r] or [None])[0])}" for r in shown
        )[:_TAIL_CHARS]
        innermost = blocks[rank][1] if rank is not None and len(blocks[rank]) > 1 else None
        return Death(
            "hang",
            rank,
            after=hung_where if hung_where not in ("", "started") else None,
            native=innermost,
            stderr_tail=tail,
            ranks=ranks,
            seconds=seconds,
        )

    def cause(item: tuple[int, Any]) -> tuple[int, int]:
        rank, failure = item
        code = failure.exitcode
        if code < 0 and -code != signal.SIGTERM:  # SIGTERM: torchrun stopping the others
            return 0, rank
        if code > 0 and not _FOLLOWER.search(texts.get(rank, "")[-2000:]):
            return 1, rank
        return (2 if code > 0 else 3), rank

    rank, failure = min(failures.items(), key=cause)
    native = _native(texts.get(rank, ""))
    code = failure.exitcode
    return Death(
        "signal" if code < 0 else "exit",
        rank,
        signal=failure.signal_name() if code < 0 else None,
        signal_number=-code if code < 0 else None,
        exit_code=code if code >= 0 else None,
        after=after,
        native=native[:300] if native else None,
        # from the native message on; a Python exit's traceback ends the file: its last lines
        stderr_tail=_tail(
            texts.get(rank, ""), native if _NATIVE.search(texts.get(rank, "")) else None
        ),
        ranks=ranks,
    )


# ---- a run that survives its ranks --------------------------------------------------------------


@dataclasses.dataclass
class Survived:
    """What the launches of one run left: the case list, each case's result or crash."""

    plan: dict[str, Any] | None = None  # the first "run" event
    starts: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # index -> event
    results: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    crashed: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # -> record
    outside: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # deaths, no case
    launches: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return len(self.plan["cases"]) if self.plan else 0

    def absorb(self, events: list[dict[str, Any]]) -> int | None:
        """Take a launch's events; the index of the case it started and never finished."""
        open_case = None
        for e in events:
            kind = e.get("event")
            if kind == "run" and self.plan is None:
                self.plan = e
            elif kind == "start":
                self.starts[e["index"]] = e
                open_case = e["index"]
            elif kind == "case":
                self.results[e["index"]] = e
                if open_case == e["index"]:
                    open_case = None
        return open_case


def run_surviving(
    launcher: Launcher,
    argv: list[str],
    events: Path,
    *,
    retry_crashed: int = 0,
    exitfirst: bool = False,
    say: Callable[[str], None] = print,
) -> Survived:
    """Run every case of ``argv``'s selection, in as few launches as the ranks allow (Note
    [Results that survive a rank]). The ranks append to ``events``; so does this function, a
    ``crashed`` line when a case crashes and another with the verdict after its retries.

    A retry is a launch from the crashed case: fresh ranks, the case first. If it runs to its end
    (flaky), the same launch goes on with the cases after it; under ``exitfirst`` it runs that
    case alone, and the run stops after it.
    """
    start_time = time.perf_counter()
    state = Survived()
    log = EventLog(events)
    first = 0
    retrying: int | None = None  # the crashed case the next launch starts with
    runs: dict[int, list[str]] = {}  # crashed case -> how each of its runs ended
    records: dict[int, dict[str, Any]] = {}  # crashed case -> its first death's record

    def conclude(index: int, completed: dict[str, Any] | None) -> None:
        record = records[index]
        if retry_crashed > 0:
            crashes = sum(1 for r in runs[index] if not r.startswith("ran to its end"))
            record.update(
                runs=runs[index],
                verdict="flaky" if completed is not None else "deterministic",
                crashed_runs=f"{crashes} of {len(runs[index])}",
                retry_result=None
                if completed is None
                else {"status": completed["status"], "reason": completed.get("reason")},
            )
            say(
                f"conformance: {state.starts[index]['case']}: {record['verdict']} crash "
                f"(crashed in {crashes} of {len(runs[index])} runs)"
            )
        state.crashed[index] = record
        case = state.starts[index]["case"]
        log.write({"event": "crashed", "index": index, "case": case, "crash": record})

    try:
        while True:
            seen = len(read_events(events))
            last = first + 1 if retrying is not None and exitfirst else None
            death = launcher.run(
                [*argv, "--jsonl", str(events), "--case-range", f"{first}:{last or ''}"]
            )
            new = read_events(events)[seen:]
            open_case = state.absorb(new)
            if retrying is not None and retrying in state.results:  # flaky: it ran to its end
                completed = state.results.pop(retrying)
                runs[retrying].append(f"ran to its end: {completed['status']}")
                conclude(retrying, completed)
                retrying = None
                if exitfirst:
                    break
            if death is None:
                if not any(e.get("event") == "end" for e in new):
                    state.outside.append({"summary": "the ranks exited before the last case"})
                break
            if open_case is None:  # before the case list, between two cases, or at exit
                record = {**death.record(), "where": _where(state, new)}
                state.outside.append(record)
                say(f"conformance: {record['summary']} ({record['where']})")
                done = [e["index"] for e in new if e.get("event") == "case"]
                if state.plan is None or not done:
                    break  # nothing ran in that launch: another would end the same way
                first = max(done) + 1
            else:
                case = state.starts[open_case]["case"]
                if open_case not in records:
                    records[open_case] = death.record()
                    # how long the case ran before its rank died: its seconds in the reports
                    ran = death.at - state.starts[open_case]["time"]
                    records[open_case]["case_seconds"] = round(max(0.0, ran), 3)
                    runs[open_case] = []
                    crash = records[open_case]
                    log.write(
                        {"event": "crashed", "index": open_case, "case": case, "crash": crash}
                    )
                runs[open_case].append(death.summary())
                say(f"conformance: {case} crashed: {death.summary()}")
                retrying = None
                if len(runs[open_case]) <= retry_crashed:
                    retrying = first = open_case
                    say(f"conformance: running {case} again in fresh ranks")
                    continue
                conclude(open_case, None)
                if exitfirst:
                    break
                first = open_case + 1
            if first >= state.total:
                break
            say(f"conformance: fresh ranks for the {state.total - first} cases left")
    finally:
        log.close()
        state.launches = launcher.launches
        state.seconds = time.perf_counter() - start_time
    return state


def _where(state: Survived, new: list[dict[str, Any]]) -> str:
    """Where a death outside any case happened, from the events of its launch."""
    if state.plan is None or not any(e.get("event") == "run" for e in new):
        return "before the first case"
    done = [e for e in new if e.get("event") == "case"]
    if any(e.get("event") == "end" for e in new):
        return "after the last case, while the ranks were leaving"
    if not done:
        return "before the first case of the launch"
    return f"after case {done[-1]['name']}"
