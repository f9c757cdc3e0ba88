"""The mutation-score harness (conformance/mutants.py, scripts/mutation_score.py).

Its own logic without the matrix: the draw is seeded and extends with its size; annotations are
told apart; where a mutant's code runs is read from the source; a stage runs a mutant only on the
cases that reach its line; results are appended per mutant and a rerun judges only what is left,
each ending classified (a case, an import error, a dying rank, not executed). The launches there
are stand-ins that write what the ranks would; one test launches real ranks on one case.
"""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
from pathlib import Path

import pytest

from conformance import mutants, selftest
from conformance.mutants import Judge, Stage

pytest.importorskip("cosmic_ray")

REPO = Path(__file__).resolve().parents[1]
CASE = "fsdp_lite/FULL_SHARD/fp32/plain/lm_untied/ws2"
OTHER = "fsdp_lite/SHARD_GRAD_OP/fp32/plain/lm_untied/ws2"

SOURCE = """from __future__ import annotations

LIMIT = 4 + 1


def scale(x: int | None, factor=2):
    if x is None:
        return 0
    return x * factor


def unused(y):
    return y - 1
"""


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "fsdp_lite"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "toy.py").write_text(SOURCE)
    return package


def test_every_mutant_is_listed_and_applies_and_annotations_are_marked(tmp_path):
    found = mutants.enumerate_mutants(_package(tmp_path), dirs=("engine/toy.py",))
    assert found and all(m["file"] == "engine/toy.py" for m in found)
    in_annotation = [m for m in found if m["annotation"]]
    assert in_annotation and all(m["line"] == 6 for m in in_annotation)  # int | None
    ids = [mutants.mutant_id(m) for m in found]
    assert len(set(ids)) == len(ids)
    for m in found:
        mutated = mutants.apply(SOURCE, m["operator"], m["occurrence"])
        assert mutated != SOURCE
        changed = [
            n + 1
            for n, (a, b) in enumerate(zip(SOURCE.splitlines(), mutated.splitlines()))
            if a != b
        ]
        assert changed == [m["line"]], m
    with pytest.raises(ValueError):
        mutants.apply(SOURCE, "core/ReplaceBinaryOperator_Mul_Add", 99)


def test_the_draw_is_seeded_and_a_larger_one_extends_a_smaller():
    population = [{"n": i} for i in range(500)]
    assert mutants.draw(population, 20, 0) == mutants.draw(population, 20, 0)
    assert mutants.draw(population, 20, 0) != mutants.draw(population, 20, 1)
    assert mutants.draw(population, 50, 0)[:20] == mutants.draw(population, 20, 0)
    assert len({m["n"] for m in mutants.draw(population, 500, 3)}) == 500


def test_where_the_mutated_code_runs():
    assert mutants.reach(SOURCE, 3, 10) == {"kind": "import"}  # LIMIT = 4 + 1
    assert mutants.reach(SOURCE, 6, 27) == {"kind": "body", "lines": [7, 9]}  # factor=2
    assert mutants.reach(SOURCE, 7, 9) == {"kind": "body", "lines": [7, 7]}  # if x is None
    assert mutants.reach(SOURCE, 9, 13) == {"kind": "body", "lines": [9, 9]}  # x * factor
    lines = {"7": [CASE], "9": [CASE, OTHER], "13": [""]}
    assert mutants.covering_cases({"kind": "body", "lines": [9, 9]}, lines) == [CASE, OTHER]
    assert mutants.covering_cases({"kind": "body", "lines": [12, 12]}, lines) == []
    # a line run while importing may set what any case reads: every case
    assert mutants.covering_cases({"kind": "body", "lines": [13, 13]}, lines) is None
    assert mutants.covering_cases({"kind": "import"}, lines) is None


def _sample(package: Path, lines: list[int], operator: str) -> list[dict]:
    found = mutants.enumerate_mutants(package, dirs=("engine/toy.py",))
    return [
        mutants.describe(m, SOURCE)
        for m in found
        if m["line"] in lines and m["operator"] == operator
    ]


def _named(package: Path, *picks: tuple[int, str], unique: bool = True) -> list[dict]:
    """The toy's mutants at (line, operator) picks, each named after its line (the fake ranks
    find their script by it), with its position too where ``unique``."""
    sample = [m for line, op in picks for m in _sample(package, [line], op)]
    for i, m in enumerate(sample):
        m["name"] = f"line{m['line']}-{i}" if unique else f"line{m['line']}"
    return sample


class FakeRanks:
    """Stands in for the ranks: reads the plan, writes the events a rank 0 would, by a script
    keyed on the mutated line (kill / import / die / pass)."""

    def __init__(self, by_line: dict[int, str]):
        self.by_line, self.launches, self.plans = by_line, 0, []

    def __call__(self, nproc: int, argv: list[str]):
        self.launches += 1
        plan = json.loads(Path(argv[argv.index("--self-test-plan") + 1]).read_text())
        self.plans.append(plan)
        with open(plan["results"], "a") as out:
            for entry in plan["entries"]:
                line = int(
                    next(ln for ln in self.by_line if f"line{ln}" in Path(entry["root"]).name)
                )
                what = self.by_line[line]
                out.write(json.dumps({"event": "start", "name": entry["name"]}) + "\n")
                out.write(
                    json.dumps({"event": "case_start", "name": entry["name"], "case": CASE}) + "\n"
                )
                if what == "die":
                    return None  # the launch ends here, the entries after it not started
                kill = {"name": entry["name"], "bug_class": "x", "world_size": nproc,
                        "status": "missed", "cases_run": len(entry["cases"]), "seconds": 0.5}  # fmt: skip
                if what == "kill":
                    kill.update(status="caught", case=CASE, stage="grads (step 1)")
                elif what == "import":
                    kill.update(status="caught", stage="import error: NameError: x")
                out.write(json.dumps({"event": "done", "name": entry["name"], "kill": kill}) + "\n")
        return None


def _judge(tmp_path, package, launch, stage) -> Judge:
    cases = mutants.stage_cases(stage)
    assert sorted(cases) == [CASE, OTHER]
    case, other = cases.index(CASE), cases.index(OTHER)
    doc = {
        "cases": cases,
        "files": {"engine/toy.py": {"7": [case], "9": [case, other], "13": []}},
        "clean": {},
    }
    (tmp_path / f"mutation_cases_{stage.name}_abcdef0123.json.xz").write_bytes(
        lzma.compress(json.dumps(doc).encode())
    )
    return Judge(
        package=package,
        work=tmp_path / "work",
        launch=launch,
        out=tmp_path / "results.jsonl",
        coverage_dir=tmp_path,
        commit="abcdef0123456",
        batch=2,
        say=lambda _: None,
    )


def test_a_stage_judges_each_mutant_once_on_the_cases_reaching_it_and_a_rerun_resumes(
    tmp_path, monkeypatch
):
    package = _package(tmp_path)
    stage = Stage("default", 2, False, only=(CASE, OTHER))
    monkeypatch.setattr(mutants, "STAGES", (stage,))
    sample = _named(
        package,
        (7, "core/AddNot"),
        (9, "core/ReplaceBinaryOperator_Mul_Add"),
        (13, "core/ReplaceBinaryOperator_Sub_Add"),
        (9, "core/ReplaceBinaryOperator_Mul_Sub"),
    )
    assert [m["line"] for m in sample] == [7, 9, 13, 9]
    ranks = FakeRanks({7: "kill", 9: "die", 13: "pass"})
    judge = _judge(tmp_path, package, ranks, stage)
    mutants.judge(judge, sample[:3], [stage])
    results = mutants.load_results(judge.out)
    by = {r["id"]: r for r in results}
    assert len(results) == 3
    r7, r9, r13 = (by[m["id"]] for m in sample[:3])
    assert (r7["outcome"], r7["how"], r7["case"]) == ("killed", "case", CASE)
    assert r7["cases_planned"] == 1  # line 7 runs in one case of the two
    assert (r9["outcome"], r9["how"]) == ("killed", "rank died")
    assert r9["cases_planned"] == 2
    assert (r13["outcome"], r13["how"], r13["cases_planned"]) == ("survived", "not executed", 0)
    entries = [e for plan in ranks.plans for e in plan["entries"]]
    assert entries[0]["cases"] == [CASE] and entries[0]["modules"] == ["fsdp_lite.engine.toy"]
    # nothing left of the mutated copies; the package itself untouched
    assert not list((tmp_path / "work" / "mutants").iterdir())
    assert (package / "engine" / "toy.py").read_text() == SOURCE
    # a rerun with one more mutant judges that one alone
    launches = ranks.launches
    ranks.by_line[9] = "import"
    mutants.judge(judge, sample, [stage])
    results = mutants.load_results(judge.out)
    assert len(results) == 4 and ranks.launches == launches + 1
    assert (results[-1]["id"], results[-1]["how"]) == (sample[3]["id"], "import error")
    mutants.judge(judge, sample, [stage])
    assert ranks.launches == launches + 1
    summary = mutants.summarize(sample, results)["stages"]["default"]
    assert summary["killed_by"] == {"case": 1, "rank died": 1, "import error": 1}
    assert summary["not_executed"] == 1
    doc = {"mutants": sample, "tool": "t", "commit": "abc", "seed": 0, "population": 4,
           "dirs": ["fsdp_lite/engine"], "command": "c"}  # fmt: skip
    report = mutants.report_markdown(doc, results, {sample[2]["id"]: "equivalent: never runs"})
    assert "3 of 3 non-equivalent mutants killed (100.0 %), 1 equivalent left out\n" in report
    partial = mutants.report_markdown(doc, results[:2], {})
    assert "1 of 2 non-equivalent mutants killed (50.0 %), 0 equivalent left out; 2 not " in partial
    assert "equivalent: never runs" in report


def test_a_mutant_killed_at_one_stage_is_not_judged_at_the_next(tmp_path, monkeypatch):
    package = _package(tmp_path)
    first = Stage("quick", 2, True, only=(CASE, OTHER))
    second = Stage("default", 2, False, only=(CASE, OTHER), after=("quick",))
    monkeypatch.setattr(mutants, "STAGES", (first, second))
    sample = _named(
        package, (7, "core/AddNot"), (9, "core/ReplaceBinaryOperator_Mul_Add"), unique=False
    )
    ranks = FakeRanks({7: "kill", 9: "pass"})
    judge = _judge(tmp_path, package, ranks, first)
    shutil.copy(
        tmp_path / "mutation_cases_quick_abcdef0123.json.xz",
        tmp_path / "mutation_cases_default_abcdef0123.json.xz",
    )
    mutants.judge(judge, sample, [first, second])
    rows = [(r["stage"], r["outcome"], r["how"]) for r in mutants.load_results(judge.out)]
    # the second stage runs no case the first passed: the survivor has none left
    assert rows == [
        ("quick", "killed", "case"),
        ("quick", "survived", "passed every case run"),
        ("default", "survived", "no case left"),
    ]


@pytest.mark.slow
def test_real_ranks_map_the_cases_and_kill_a_mutant_of_the_divide_factor(tmp_path):
    """One case, two real launches: the clean copy's per-case coverage, then the mutant."""
    from conformance.cli import _launchers

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    package = mutants.snapshot(commit, tmp_path / "snapshot")
    source = (package / "engine" / "collectives.py").read_text()
    line = next(
        n + 1
        for n, text in enumerate(source.splitlines())
        if text.strip() == "return float(pre), world_size / pre"
    )
    found = mutants.enumerate_mutants(package, dirs=("engine/collectives.py",))
    sample = []
    for m in found:
        if m["line"] == line and m["operator"] == "core/ReplaceBinaryOperator_Div_Mul":
            sample.append(m)  # world_size * pre: the average's factor wrong
    assert len(sample) == 1
    sample = [mutants.describe(m, source) for m in sample]
    selftest.plant(None, package, tmp_path / "clean")
    launchers = _launchers(str(tmp_path / "ranks"), selftest.SELF_TEST_TIMEOUT_S)
    stage = Stage("quick", 2, True, only=(CASE,))
    judge = Judge(
        package=package,
        work=tmp_path,
        launch=lambda nproc, argv: launchers(nproc).run(argv),
        out=tmp_path / "results.jsonl",
        coverage_dir=tmp_path,
        commit=commit,
        say=lambda _: None,
    )
    mutants.judge(judge, sample, [stage])
    doc = json.loads(
        lzma.decompress((tmp_path / f"mutation_cases_quick_{commit[:10]}.json.xz").read_bytes())
    )
    assert doc["ran"] == [CASE] and doc["clean"]["status"] == "missed"
    assert str(line) in doc["files"]["engine/collectives.py"]
    [result] = mutants.load_results(judge.out)
    assert (result["outcome"], result["how"], result["case"]) == ("killed", "case", CASE)
    assert "(step" in result["detail"]


def test_a_mutant_that_is_no_python_is_passed_over_by_the_draw(tmp_path):
    source = "def f(a, *, b):\n    return a * b\n"
    package = _package(tmp_path)
    (package / "engine" / "kw.py").write_text(source)
    found = [
        m
        for m in mutants.enumerate_mutants(package, dirs=("engine/kw.py",))
        if m["operator"] == "core/ReplaceBinaryOperator_Mul_Add"
    ]
    assert [m["line"] for m in found] == [1, 2]  # the keyword-only marker, then a * b
    why = [mutants.incompetent(source, m) for m in found]
    assert why[0].startswith("SyntaxError") and why[1] is None
    drawn = mutants.draw(found, 2, 0, keep=lambda m: mutants.incompetent(source, m) is None)
    assert drawn == [found[1]]


def test_a_mutant_shown_equivalent_is_judged_no_further_and_left_out_of_the_score(
    tmp_path, monkeypatch
):
    package = _package(tmp_path)
    stage = Stage("default", 2, False, only=(CASE, OTHER))
    monkeypatch.setattr(mutants, "STAGES", (stage,))
    sample = _named(package, (7, "core/AddNot"), (9, "core/ReplaceBinaryOperator_Mul_Add"))
    ranks = FakeRanks({7: "kill", 9: "pass"})
    judge = _judge(tmp_path, package, ranks, stage)
    judge.equivalent = frozenset({sample[1]["id"]})
    mutants.judge(judge, sample, [stage])
    results = mutants.load_results(judge.out)
    assert [r["id"] for r in results] == [sample[0]["id"]]
    reasons = {sample[1]["id"]: "equivalent: shown by argument"}
    got = mutants.score(sample, results, reasons, ["default"])
    assert got == {"killed": 1, "of": 1, "equivalent": 1, "pending": 0}
