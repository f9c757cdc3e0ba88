"""The mutation score: cosmic-ray's mutants of fsdp_lite judged by the conformance suite.

    python scripts/mutation_score.py --sample 150 --seed 0 --out benchmarks/results/mutation_2026-12-07
    python scripts/mutation_score.py --out benchmarks/results/mutation_2026-12-07 --report

OUT_sample.json is the sample (made once; later runs read it), OUT.jsonl the results, a line per
mutant and stage, appended as each batch ends (a rerun judges only what is not there yet),
OUT_reasons.json the survivors' reasons (written by hand), OUT.md the report. docs/mutation.md
says how it works and what it measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from conformance import mutants  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="path prefix of the files written")
    p.add_argument("--sample", type=int, default=150, help="mutants drawn (default 150)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="HEAD", help="the fsdp_lite mutated (default HEAD)")
    p.add_argument(
        "--stages",
        default="quick,default",
        help="stages to judge, in order, of " + ",".join(s.name for s in mutants.STAGES),
    )
    p.add_argument("--limit", type=int, help="launch at most this many mutants in this run")
    p.add_argument(
        "--batch", type=int, default=8, help="mutants per launch at --quick (default 8; else 2)"
    )
    p.add_argument("--work", help="scratch directory (default a temporary one)")
    p.add_argument("--report", action="store_true", help="only write OUT.md from what is judged")
    return p.parse_args(argv)


def make_sample(args, out: Path, package: Path, commit: str) -> dict:
    every = mutants.enumerate_mutants(package)
    population = [m for m in every if not m.pop("annotation")]
    sources = {f: (package / f).read_text() for f in {m["file"] for m in population}}
    left_out = []

    def competent(m) -> bool:
        why = mutants.incompetent(sources[m["file"]], m)
        if why is not None:
            left_out.append({"id": mutants.mutant_id(m), "why": why})
        return why is None

    drawn = mutants.draw(population, args.sample, args.seed, keep=competent)
    rows = [mutants.describe(m, sources[m["file"]]) for m in drawn]
    by_op: dict[str, int] = {}
    for m in population:
        key = m["operator"].split("/")[-1].split("_")[0]
        by_op[key] = by_op.get(key, 0) + 1
    doc = {
        "tool": f"cosmic-ray {_version('cosmic-ray')}",
        "commit": commit,
        "dirs": [f"fsdp_lite/{d}" for d in mutants.DIRS],
        "seed": args.seed,
        "population": len(population),
        "left_out_in_annotations": len(every) - len(population),
        "left_out_not_python": left_out,  # drawn, then passed over: the sample is of the rest
        "population_by_operator": dict(sorted(by_op.items())),
        "command": " ".join(["python", "scripts/mutation_score.py", *sys.argv[1:]]),
        "mutants": rows,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    prefix = Path(args.out)
    sample_path = Path(f"{prefix}_sample.json")
    results_path = Path(f"{prefix}.jsonl")
    reasons_path = Path(f"{prefix}_reasons.json")
    reasons = json.loads(reasons_path.read_text()) if reasons_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        work = Path(args.work or tmp)
        if sample_path.exists():
            doc = json.loads(sample_path.read_text())
            commit = doc["commit"]
        else:
            commit = subprocess.run(
                ["git", "rev-parse", args.commit], cwd=REPO, check=True, capture_output=True,
                text=True,
            ).stdout.strip()  # fmt: skip
        package = mutants.snapshot(commit, work / "snapshot")
        if not sample_path.exists():
            doc = make_sample(args, sample_path, package, commit)
            print(
                f"mutation: {len(doc['mutants'])} of {doc['population']} mutants -> {sample_path}"
            )
        sample = doc["mutants"]
        if not args.report:
            from conformance import selftest
            from conformance.cli import _launchers

            clean = work / "clean"
            if not clean.exists():
                selftest.plant(None, package, clean)
            shutil.rmtree(work / "ranks", ignore_errors=True)  # a reused --work: launches anew
            launchers = _launchers(str(work / "ranks"), selftest.SELF_TEST_TIMEOUT_S)
            judge = mutants.Judge(
                package=package,
                work=work,
                launch=lambda nproc, argv: launchers(nproc).run(argv),
                out=results_path,
                coverage_dir=results_path.parent,
                commit=commit,
                batch=args.batch,
                equivalent=frozenset(
                    i for i, why in reasons.items() if why.startswith("equivalent")
                ),
                say=lambda line: print(line, flush=True),
            )
            wanted = args.stages.split(",")
            stages = [s for s in mutants.STAGES if s.name in wanted]
            mutants.judge(judge, sample, stages, limit=args.limit)
    results = mutants.load_results(results_path)
    report = mutants.report_markdown(doc, results, reasons)
    Path(f"{prefix}.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
