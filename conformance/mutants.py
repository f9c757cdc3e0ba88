"""Machine-made mutants of fsdp_lite judged by the suite: the mutation score (docs/mutation.md).

cosmic-ray's operators (its ``core/`` set) enumerate every mutant of fsdp_lite's engine/,
fronts/ and state/ at one commit (the package taken out of git with ``git archive``, never the
work tree); a seeded shuffle of that list, cut at ``--sample``, is the sample, kept with each
mutant's file, line, operator, occurrence and diff. Each mutant is then judged stage by stage, the
way a CI owner runs the suite: ``--quick``, the rest of the default matrix, the rest of ``--all``
(its adamw and muon matrices), ``--all`` at 4 ranks; a mutant killed at one stage is not judged at
the next. ``--world-sizes`` (the canonical mode's own run) is not a stage yet. Both of fsdp_lite's fronts (adapters ``fsdp_lite`` and ``fsdp_lite_fsdp2``) are judged,
since both are the code mutated.

The self-test's machinery runs them (selftest.py ``_run_group``): copies of the package, one
launch for many mutants, references shared, each mutant stopped at its first failing case.

Note [Only the cases that run the mutated line]: before a stage judges any mutant, one launch
runs the clean copy on every case of the stage under coverage.py, one context per case, so that
the harness knows which cases execute each line. A mutant is then run on those cases only: a
case that never reaches the mutated code computes exactly what the clean copy computes (the
suite is deterministic), and the clean copy passed it. Where the mutated code is reached is
decided from Python's ``ast``: inside a function body, the lines of the innermost statement (or
``except`` clause) holding it; in a function's signature (defaults, decorators), the function's
body, which runs whenever the signature matters; anywhere else (module or class level, or a line
that also runs while the package is imported), every case. A mutant no case reaches survives the
stage without a launch ("not executed").
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import lzma
import random
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.catalog import Patch

__all__ = [
    "DIRS",
    "STAGES",
    "Mutant",
    "Stage",
    "apply",
    "covering_cases",
    "describe",
    "draw",
    "enumerate_mutants",
    "judge",
    "load_results",
    "reach",
    "summarize",
]

REPO = Path(__file__).resolve().parents[1]
DIRS = ("engine", "fronts", "state")  # of the fsdp_lite package: what is mutated
IMPLS = ("fsdp_lite", "fsdp_lite_fsdp2")  # its two fronts: both run the mutated code


@dataclass(frozen=True)
class Stage:
    """One run of the suite a mutant faces: a matrix at a world size."""

    name: str
    world_size: int
    quick: bool
    optimizers: tuple[str, ...] = ("sgd",)
    after: tuple[str, ...] = ()  # stages whose cases this one does not run again
    only: tuple[str, ...] = ()  # case patterns (as --only takes them): these cases only
    coverage: str = ""  # the stage whose coverage run maps its cases' lines (default: its own)


# python -m conformance --quick, then the default matrix, then the rest of --all (its adamw and
# muon matrices), then --all at 4 ranks as the nightly runs it (scripts/nightly_conformance.sh).
STAGES = (
    Stage("quick", 2, True),
    Stage("default", 2, False, after=("quick",)),
    Stage("all", 2, False, optimizers=("adamw", "muon")),
    Stage("all_ws4", 4, False, optimizers=("sgd", "adamw", "muon")),
)


@dataclass(frozen=True)
class Mutant:
    """A Bug-like entry for selftest.py: one mutant, with the cases it is judged on."""

    name: str
    bug_class: str
    what: str
    patches: tuple[Patch, ...]
    cases: tuple[str, ...] | None = None
    modules: tuple[str, ...] = ()
    world_size: int = 2
    impls: tuple[str, ...] = IMPLS
    impl: str = "fsdp_lite"
    first: tuple[str, ...] = ()
    upstream: str = ""
    exitfirst: bool = True


# ---- enumerating and drawing ---------------------------------------------------------------


def _operators() -> list[tuple[str, Any]]:
    """cosmic-ray's operators that take no arguments, by name, as its ``init`` instantiates them."""
    try:
        import cosmic_ray.plugins as plugins
    except ImportError as e:  # pragma: no cover - the extra is not installed
        raise SystemExit(
            "the mutation score needs cosmic-ray: pip install 'fsdp-lite[mutation]'"
        ) from e
    out = []
    for name in plugins.operator_names():
        cls = plugins.get_operator(name)
        if not cls.arguments():
            out.append((name, cls()))
    return out


def snapshot(commit: str, dest: Path) -> Path:
    """fsdp_lite as committed at ``commit``, extracted under ``dest``; returns the package dir."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "fsdp_lite"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout
    tar_path = dest / "fsdp_lite.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()
    return dest / "fsdp_lite"


def enumerate_mutants(package: Path, dirs: Sequence[str] = DIRS) -> list[dict[str, Any]]:
    """Every mutant cosmic-ray's operators make of the .py files under ``package/dirs``, in file,
    operator and occurrence order (occurrences counted per file and operator, as cosmic-ray's
    ``init`` counts them); ``annotation`` marks those inside a type annotation."""
    from cosmic_ray.ast import ast_nodes, get_ast

    operators = _operators()
    found = []
    for path in sorted(p for d in dirs for p in _py_files(package, d)):
        rel = path.relative_to(package).as_posix()
        source = path.read_text()
        tree = get_ast(source)
        nodes = list(ast_nodes(tree))
        spans = _annotation_spans(source)
        for name, operator in operators:
            occurrence = 0
            for node in nodes:
                for start, _ in operator.mutation_positions(node):
                    found.append(
                        {
                            "file": rel,
                            "operator": name,
                            "occurrence": occurrence,
                            "line": start[0],
                            "col": start[1],
                            "annotation": any(a <= start <= b for a, b in spans),
                        }
                    )
                    occurrence += 1
    return found


def _py_files(package: Path, where: str) -> list[Path]:
    """The .py files of ``package/where``, a directory or one file."""
    return [package / where] if where.endswith(".py") else list((package / where).rglob("*.py"))


def _annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every annotation, in cosmic-ray's (line, character) positions. Under
    ``from __future__ import annotations`` (every mutated module but the empty __init__ files)
    none is evaluated, so a mutant inside one is equivalent by construction."""
    lines = source.splitlines()

    def chars(line: int, byte_col: int) -> int:
        return len(lines[line - 1].encode()[:byte_col].decode(errors="ignore"))

    spans = []
    for node in ast.walk(ast.parse(source)):
        found = []
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            found.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            found.append(node.returns)
        for a in found:
            spans.append(
                (
                    (a.lineno, chars(a.lineno, a.col_offset)),
                    (a.end_lineno, chars(a.end_lineno, a.end_col_offset)),
                )
            )
    return spans


def mutant_id(m: dict[str, Any]) -> str:
    return f"{m['file']}:{m['operator']}:{m['occurrence']}"


def apply(source: str, operator: str, occurrence: int) -> str:
    """``source`` with cosmic-ray's ``operator`` applied at ``occurrence``."""
    import cosmic_ray.plugins as plugins
    from cosmic_ray.mutating import mutate_code

    mutated = mutate_code(source, plugins.get_operator(operator)(), occurrence)
    if mutated is None:
        raise ValueError(f"{operator} has no occurrence {occurrence} here")
    return mutated


def describe(m: dict[str, Any], source: str) -> dict[str, Any]:
    """A sample's row for mutant ``m`` of ``source``: its id, a directory name, where its code
    runs and its diff."""
    mid = mutant_id(m)
    mutated = apply(source, m["operator"], m["occurrence"])
    return {
        "id": mid,
        "name": mid.replace("/", ".").replace(":", "-"),
        **{k: v for k, v in m.items() if k != "annotation"},
        "reach": reach(source, m["line"], m["col"]),
        "diff": diff(source, mutated, m["file"]),
    }


def draw(
    population: list[dict[str, Any]],
    size: int,
    seed: int,
    keep: Callable[[dict[str, Any]], bool] = lambda _: True,
) -> list[dict[str, Any]]:
    """The first ``size`` of the population shuffled with ``seed`` that ``keep`` accepts: a
    larger size extends a smaller one's sample."""
    order = list(range(len(population)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        if len(out) == size:
            break
        if keep(population[i]):
            out.append(population[i])
    return out


def incompetent(source: str, m: dict[str, Any]) -> str | None:
    """Why the mutant is no Python (cosmic-ray reads the ``*`` of keyword-only parameters as an
    operator, for one), or None."""
    with warnings.catch_warnings():  # "is" with a literal, and the like: still Python
        warnings.simplefilter("ignore", SyntaxWarning)
        try:
            compile(apply(source, m["operator"], m["occurrence"]), m["file"], "exec")
        except SyntaxError as e:
            return f"SyntaxError: {e.msg}"
    return None


def diff(original: str, mutated: str, file: str) -> str:
    lines = difflib.unified_diff(
        original.splitlines(),
        mutated.splitlines(),
        f"a/fsdp_lite/{file}",
        f"b/fsdp_lite/{file}",
        n=1,
        lineterm="",
    )
    return "\n".join(lines)


# ---- where a mutant runs (Note [Only the cases that run the mutated line]) -----------------


def reach(source: str, line: int, col: int) -> dict[str, Any]:
    """Where the code at ``line``, ``col`` (characters, as cosmic-ray gives them) runs:
    ``{"kind": "body", "lines": [a, b]}`` (the lines whose execution reaches it), or
    ``{"kind": "import"}`` (module or class level: every case)."""
    tree = ast.parse(source)
    text = source.splitlines()[line - 1] if line - 1 < len(source.splitlines()) else ""
    pos = (line, len(text[:col].encode()))  # ast's columns are UTF-8 byte offsets

    def start(node) -> tuple[int, int]:
        decorators = getattr(node, "decorator_list", [])
        first = min([node, *decorators], key=lambda n: (n.lineno, n.col_offset))
        return first.lineno, first.col_offset

    def contains(node) -> bool:
        if not hasattr(node, "lineno"):  # arguments, comprehension, withitem: their parts
            return any(contains(c) for c in ast.iter_child_nodes(node))
        return start(node) <= pos <= (node.end_lineno, node.end_col_offset)

    def header(node) -> list[int]:
        body = getattr(node, "body", None)
        first = start(node)[0]
        if isinstance(body, list) and body:
            return [first, max(first, body[0].lineno - 1)]
        return [first, node.end_lineno]

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    in_body = False  # inside some function's (or lambda's) body
    signature = None  # the function whose signature or decorators hold it, if that is innermost
    statement = None
    node: ast.AST = tree
    while True:
        child = next((c for c in ast.iter_child_nodes(node) if contains(c)), None)
        if child is None:
            break
        if isinstance(node, functions):
            in_body, signature = (True, None) if child in node.body else (in_body, node)
        elif isinstance(node, ast.Lambda) and child is node.body:
            in_body, signature = True, None
        if isinstance(child, ast.stmt | ast.excepthandler):
            statement = child
        node = child
    if signature is not None:  # defaults, decorators: they matter where the function runs
        return {"kind": "body", "lines": [signature.body[0].lineno, signature.end_lineno]}
    if in_body and statement is not None:
        return {"kind": "body", "lines": header(statement)}
    return {"kind": "import"}


def covering_cases(where: dict[str, Any], lines: dict[str, list[str]]) -> list[str] | None:
    """The cases that run the mutated code, from ``lines`` (line number as text -> the contexts
    that ran it, "" while importing); None: every case."""
    if where["kind"] != "body":
        return None
    first, last = where["lines"]
    found: set[str] = set()
    for n in range(first, last + 1):
        found.update(lines.get(str(n), ()))
    if "" in found:  # it ran while the package was imported: its effect may reach any case
        return None
    return sorted(found)


# ---- judging -------------------------------------------------------------------------------


def load_results(path: Path) -> list[dict[str, Any]]:
    """The results file's lines (a last line cut short is ignored)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class Judge:
    """What a judging run needs: the snapshot, the scratch directory, how to launch ranks."""

    package: Path  # the clean snapshot of fsdp_lite
    work: Path
    launch: Callable[[int, list[str]], Any]
    out: Path  # the results file (JSON lines)
    coverage_dir: Path  # per-stage case coverage maps, kept between runs
    commit: str
    steps: int = 3
    timeout: float = 20.0
    batch: int = 8  # mutants per launch at a --quick stage, where most die in a second
    full_batch: int = 2  # elsewhere: a survivor there takes minutes, and results land per batch
    equivalent: frozenset[str] = frozenset()  # ids shown equivalent: no further stage judges them
    say: Callable[[str], None] = print
    cases_cache: dict[str, list[str]] = field(default_factory=dict)


def stage_cases(stage: Stage) -> list[str]:
    """The names of every case of ``stage``'s matrix, in matrix order."""
    from conformance.adapters import get_adapter
    from conformance.matrix import build_matrix

    adapters = [get_adapter(n) for n in IMPLS]
    cases, _ = build_matrix(
        [a.name for a in adapters],
        {a.name: a.strategies() for a in adapters},
        stage.world_size,
        quick=stage.quick,
        known_features={a.name: a.features() for a in adapters},
        optimizers=list(stage.optimizers),
    )
    if stage.only:
        from conformance.matrix import select

        cases = select(cases, list(stage.only))
    return [c.name for c in cases]


def _modules(package: Path) -> list[str]:
    return sorted(
        "fsdp_lite." + ".".join(p.relative_to(package).with_suffix("").parts)
        for d in DIRS
        for p in (package / d).glob("*.py")
        if p.name != "__init__.py"
    )


def _module(file: str) -> str:
    return "fsdp_lite." + file.removesuffix(".py").replace("/", ".")


def _args(judge: Judge, stage: Stage, coverage_dir: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        quick=stage.quick,
        steps=judge.steps,
        timeout=judge.timeout,
        optimizers=list(stage.optimizers),
        coverage_dir=None if coverage_dir is None else str(coverage_dir),
    )


def coverage_map(judge: Judge, stage: Stage) -> dict[str, Any]:
    """The stage's map, case -> lines, read from its file or made by one launch of the clean
    copy on every case of the stage (Note [Only the cases that run the mutated line])."""
    from conformance import selftest

    cov_stage = _stage(stage.coverage) if stage.coverage else stage
    path = judge.coverage_dir / f"mutation_cases_{cov_stage.name}_{judge.commit[:10]}.json.xz"
    if path.exists():
        return json.loads(lzma.decompress(path.read_bytes()))
    cases = stage_cases(cov_stage)
    judge.say(
        f"mutation: mapping the lines each of {len(cases)} {cov_stage.name} cases runs "
        f"(clean copy, {cov_stage.world_size} ranks, one launch)"
    )
    data_dir = judge.work / f"coverage-{cov_stage.name}"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    clean = Mutant(
        "clean", "clean", "", (), cases=tuple(cases), modules=tuple(_modules(judge.package)),
        world_size=cov_stage.world_size, exitfirst=False,
    )  # fmt: skip
    root = str(judge.work / "clean")
    start = time.perf_counter()
    kills = selftest._run_group(
        _args(judge, cov_stage, data_dir),
        judge.launch,
        _fresh(judge.work / f"launch-coverage-{cov_stage.name}"),
        [clean],
        {"clean": root},
        root,
        cov_stage.world_size,
        confirm=False,
    )
    seconds = time.perf_counter() - start
    doc = _read_coverage(data_dir, cases)
    doc.update(
        stage=cov_stage.name,
        commit=judge.commit,
        seconds=round(seconds, 1),
        clean=dataclasses.asdict(kills["clean"]),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(json.dumps(doc, separators=(",", ":")).encode()))
    judge.say(f"mutation: {path} ({seconds:.0f} s)")
    return doc


def _read_coverage(data_dir: Path, cases: list[str]) -> dict[str, Any]:
    """Every rank's data combined: per file of the package, line -> indexes into ``cases`` (or
    -1 for the import), and the cases that ran."""
    import coverage

    combined = coverage.CoverageData(basename=str(data_dir / "combined"))
    for f in sorted(data_dir.glob(".coverage.*")):
        part = coverage.CoverageData(basename=str(f))
        part.read()
        combined.update(part)
    index = {name: i for i, name in enumerate(cases)}
    files: dict[str, dict[str, list[int]]] = {}
    seen: set[str] = set()
    for measured in combined.measured_files():
        rel = measured.split("/fsdp_lite/", 1)[-1]
        by_line = combined.contexts_by_lineno(measured)
        entry = {}
        for line, contexts in by_line.items():
            seen.update(contexts)
            entry[str(line)] = sorted({index.get(c, -1) for c in contexts if c in index or c == ""})
        files[rel] = entry
    return {"cases": cases, "ran": sorted(seen & set(cases)), "files": files}


def _lines_for(doc: dict[str, Any], file: str) -> dict[str, list[str]]:
    cases = doc["cases"]
    return {
        line: ["" if i < 0 else cases[i] for i in indexes]
        for line, indexes in doc["files"].get(file, {}).items()
    }


def plan_mutant(
    m: dict[str, Any], stage: Stage, doc: dict[str, Any], judge: Judge
) -> tuple[list[str], int]:
    """The cases of ``stage`` that ``m`` is run on, in matrix order, and how many of the stage's
    cases reach its code (those an earlier stage ran included)."""
    cases = _cached_cases(judge, stage)
    done = {c for s in stage.after for c in _cached_cases(judge, _stage(s))}
    clean = doc.get("clean") or {}
    failing = {clean["case"]} if clean.get("case") else set()
    mapped = set(doc["cases"])
    covering = covering_cases(m["reach"], _lines_for(doc, m["file"]))
    # a case the map has no line for (added to the matrix since it was made) runs anyway
    reaching = [
        name
        for name in cases
        if name not in failing and (covering is None or name in covering or name not in mapped)
    ]
    return [name for name in reaching if name not in done], len(reaching)


def _cached_cases(judge: Judge, stage: Stage) -> list[str]:
    if stage.name not in judge.cases_cache:
        judge.cases_cache[stage.name] = stage_cases(stage)
    return judge.cases_cache[stage.name]


def _stage(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)


def judge(
    judge: Judge, sample: list[dict[str, Any]], stages: Sequence[Stage], limit: int | None = None
) -> None:
    """Judge every mutant of ``sample`` not yet judged at each stage, appending a line per
    mutant and stage to ``judge.out``; a mutant killed at one stage is not judged at the next."""
    from conformance import selftest

    snapshot_package = judge.package
    judged = 0
    for stage in stages:
        results = load_results(judge.out)
        killed = {r["id"] for r in results if r["outcome"] == "killed"}
        done = {r["id"] for r in results if r["stage"] == stage.name}
        names = [s.name for s in STAGES]
        earlier = names[: names.index(stage.name)] if stage.name in names else []
        passed = {
            i: {r["stage"] for r in results if r["id"] == i and r["outcome"] == "survived"}
            for i in {m["id"] for m in sample}
        }
        todo = [
            m
            for m in sample
            if m["id"] not in killed
            and m["id"] not in done
            and all(s in passed[m["id"]] for s in earlier)
            and m["id"] not in judge.equivalent
        ]
        if limit is not None:
            todo = todo[: max(0, limit - judged)]
        if not todo:
            continue
        doc = coverage_map(judge, stage)
        entries = []
        for m in todo:
            cases, reaching = plan_mutant(m, stage, doc, judge)
            if not cases:  # no case of the stage reaches it, or an earlier stage ran them all
                how = "no case left" if reaching else "not executed"
                _append(judge.out, _record(m, stage, "survived", how, cases_planned=0))
                continue
            source = (snapshot_package / m["file"]).read_text()
            mutated = apply(source, m["operator"], m["occurrence"])
            entries.append(
                (
                    m,
                    Mutant(
                        name=m["name"],
                        bug_class=m["operator"].split("/")[-1],
                        what=m["id"],
                        patches=(Patch(m["file"], source, mutated),),
                        cases=tuple(cases),
                        modules=(_module(m["file"]),),
                        world_size=stage.world_size,
                    ),
                )
            )
        size = judge.batch if stage.quick else judge.full_batch
        for i in range(0, len(entries), size):
            batch = entries[i : i + size]
            roots = {}
            for _, entry in batch:
                dest = judge.work / "mutants" / entry.name
                shutil.rmtree(dest, ignore_errors=True)
                roots[entry.name] = str(selftest.plant(entry, snapshot_package, dest))
            start = time.perf_counter()
            kills = selftest._run_group(
                _args(judge, stage),
                judge.launch,
                _fresh(judge.work / f"launch-{stage.name}-{i // size}"),
                [e for _, e in batch],
                roots,
                str(judge.work / "clean"),
                stage.world_size,
                confirm=False,
            )
            wall = time.perf_counter() - start
            for m, entry in batch:
                kill = kills.get(entry.name)
                if kill is None or kill.status == "not run":
                    judge.say(
                        f"mutation: {m['id']}: not run (the launch failed); judged again next run"
                    )
                    continue
                record = _classify(m, stage, kill, len(entry.cases or ()), wall / len(batch))
                _append(judge.out, record)
                judge.say(
                    f"[{stage.name}] {m['id']} line {m['line']}: {record['outcome']} "
                    f"({record['how']}{': ' + record['case'] if record.get('case') else ''}; "
                    f"{record['cases_run']}/{record['cases_planned']} cases, {kill.seconds:.1f} s)"
                )
            for root in roots.values():
                shutil.rmtree(root, ignore_errors=True)
            judged += len(batch)


def _fresh(directory: Path) -> Path:
    """An empty directory: a launch's plan and results files start anew (selftest.py appends)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def _record(m, stage: Stage, outcome: str, how: str, **more) -> dict[str, Any]:
    return {"id": m["id"], "stage": stage.name, "outcome": outcome, "how": how, **more}


def _classify(m, stage: Stage, kill, planned: int, batch_share: float) -> dict[str, Any]:
    """A selftest Kill as a result line: killed by a case (and its stage), by an import error or
    a dying rank; or survived."""
    more = {
        "cases_planned": planned,
        "cases_run": kill.cases_run,
        "seconds": kill.seconds,
        "launch_share_s": round(batch_share, 1),
    }
    if kill.status != "caught":
        return _record(m, stage, "survived", "passed every case run", **more)
    detail = kill.stage or ""
    if detail.startswith("import error"):
        how = "import error"
    elif detail.startswith("a rank died"):
        how = "rank died"
    else:  # a comparison ("grads (step 1)") or an exception the case raised
        how = "case"
    return _record(m, stage, "killed", how, case=kill.case, detail=detail[:300], **more)


# ---- reporting -----------------------------------------------------------------------------


def summarize(sample: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: judged, killed (by how), survived; per mutant its last outcome."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_id.setdefault(r["id"], []).append(r)
    stages: dict[str, dict[str, Any]] = {}
    for s in STAGES:
        rows = [r for r in results if r["stage"] == s.name]
        hows: dict[str, int] = {}
        for r in rows:
            if r["outcome"] == "killed":
                hows[r["how"]] = hows.get(r["how"], 0) + 1
        stages[s.name] = {
            "judged": len(rows),
            "killed": sum(r["outcome"] == "killed" for r in rows),
            "killed_by": hows,
            "survived": sum(r["outcome"] == "survived" for r in rows),
            "not_executed": sum(r["how"] == "not executed" for r in rows),
        }
    final = {}
    for m in sample:
        rows = by_id.get(m["id"], [])
        killed = next((r for r in rows if r["outcome"] == "killed"), None)
        final[m["id"]] = {
            "killed_at": killed["stage"] if killed else None,
            "survived": [r["stage"] for r in rows if r["outcome"] == "survived"],
        }
    return {"stages": stages, "mutants": final}


def iter_sample(path: Path) -> Iterable[dict[str, Any]]:
    return json.loads(path.read_text())["mutants"]


def main_hint() -> None:  # pragma: no cover
    print("run: python scripts/mutation_score.py --help", file=sys.stderr)


def score(sample, results, reasons: dict[str, str], stages: Sequence[str]) -> dict[str, Any]:
    """Killed by the time ``stages`` have run, over the mutants killed there or judged at every
    one of them, less those shown equivalent (a reason starting "equivalent"); ``pending``: the
    mutants neither killed there, nor equivalent, nor judged at all of them yet."""
    by_id: dict[str, dict[str, str]] = {}
    for r in results:
        by_id.setdefault(r["id"], {})[r["stage"]] = r["outcome"]
    counted = killed = equivalent = pending = 0
    for m in sample:
        outcomes = by_id.get(m["id"], {})
        if any(outcomes.get(s) == "killed" for s in stages):
            counted, killed = counted + 1, killed + 1
        elif reasons.get(m["id"], "").startswith("equivalent"):
            equivalent += 1  # no stage can kill it: whether judged there or not
        elif all(outcomes.get(s) == "survived" for s in stages):
            counted += 1
        else:
            pending += 1
    return {"killed": killed, "of": counted, "equivalent": equivalent, "pending": pending}


def _median(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    mid = len(ordered) // 2
    value = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return f"{value:.1f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def report_markdown(doc, results, reasons: dict[str, str]) -> str:
    """The report: per stage what was judged and how it ended, the score, the survivors."""
    sample = doc["mutants"]
    summary = summarize(sample, results)
    lines = [
        f"# Mutation score: {doc['tool']} on fsdp_lite at {doc['commit'][:10]}",
        "",
        f"{len(sample)} mutants drawn (seed {doc['seed']}) of {doc['population']} that cosmic-ray's "
        f"operators make of {', '.join(doc['dirs'])}; the sample: `{doc['command']}`.",
        "",
        "| stage | judged | killed | by a case | import error | rank died | survived | of them not executed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["stages"].items():
        if not s["judged"]:
            continue
        by = s["killed_by"]
        lines.append(
            f"| {name} | {s['judged']} | {s['killed']} | {by.get('case', 0)} | "
            f"{by.get('import error', 0)} | {by.get('rank died', 0)} | {s['survived']} | "
            f"{s['not_executed']} |"
        )
    lines += [
        "",
        "Cost of the mutants a stage ran (in the ranks: the mutant's cases alone; wall: its "
        "batch's wall time, launches, imports and references included, over the batch's "
        "mutants; a mutant no case reaches costs nothing):",
        "",
        "| stage | mutants run | killed: median s in the ranks | survived: median s in the ranks "
        "(cases) | wall per mutant: mean s | wall in all: s |",
        "|---|---|---|---|---|---|",
    ]
    for name in summary["stages"]:
        run = [r for r in results if r["stage"] == name and "launch_share_s" in r]
        if not run:
            continue
        killed = [r["seconds"] for r in run if r["outcome"] == "killed"]
        survived = [r for r in run if r["outcome"] == "survived"]
        share = [r["launch_share_s"] for r in run]
        lines.append(
            f"| {name} | {len(run)} | {_median(killed)} | {_median([r['seconds'] for r in survived])}"
            f" ({_median([r['cases_run'] for r in survived])}) | {sum(share) / len(share):.1f} | "
            f"{sum(share):.0f} |"
        )
    lines.append("")
    cumulative: list[str] = []
    for s in STAGES:
        cumulative.append(s.name)
        sc = score(sample, results, reasons, cumulative)
        if not summary["stages"][s.name]["judged"]:
            break
        pct = 100.0 * sc["killed"] / sc["of"] if sc["of"] else 0.0
        lines.append(
            f"- through `{s.name}` ({' + '.join(cumulative)}): {sc['killed']} of {sc['of']} "
            f"non-equivalent mutants killed ({pct:.1f} %), {sc['equivalent']} equivalent left out"
            + (f"; {sc['pending']} not judged at every stage yet" if sc["pending"] else "")
        )
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_id.setdefault(r["id"], []).append(r)
    survivors = [
        m for m in sample
        if by_id.get(m["id"]) and all(r["outcome"] == "survived" for r in by_id[m["id"]])
    ]  # fmt: skip
    kinds: dict[str, int] = {}
    for m in survivors:
        kind = reasons.get(m["id"], "to classify").split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    lines += [
        "",
        f"{len(survivors)} survivors so far, by reason: "
        + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1])),
    ]
    lines += [
        "",
        "## Survivors so far",
        "",
        "| mutant | line | stages survived (cases run) | diff | reason |",
        "|---|---|---|---|---|",
    ]
    for m in survivors:
        runs = ", ".join(
            f"{r['stage']} ({r.get('cases_run', 0)})"
            if r["how"] != "not executed"
            else f"{r['stage']} (not executed)"
            for r in by_id[m["id"]]
        )
        change = " / ".join(
            line.strip()
            for line in m["diff"].splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        )
        change = change.replace("|", "\\|")[:160]
        lines.append(
            f"| `{m['id']}` | {m['line']} | {runs} | `{change}` | "
            f"{reasons.get(m['id'], '**to classify**')} |"
        )
    return "\n".join(lines) + "\n"
