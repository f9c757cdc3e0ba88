"""Regenerate the table of every implementation's results in docs/conformance.md.

    python scripts/conformance_table.py                          # run, print the table
    python scripts/conformance_table.py --write docs/conformance.md
    python scripts/conformance_table.py --from report.json --write docs/conformance.md

It runs ``python -m conformance --impl fsdp_lite fsdp_lite_fsdp2 torch_fsdp1 torch_fsdp2 --json``
(the default matrix at 2 ranks; ``--impl`` and ``--nproc`` override) or reads such a report, and
puts one row per implementation and one per failing feature between the markers
``<!-- implementations table begin -->`` and ``<!-- implementations table end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.self_test_table import write_between_markers  # noqa: E402

BEGIN, END = "<!-- implementations table begin -->", "<!-- implementations table end -->"
IMPLS = ["fsdp_lite", "fsdp_lite_fsdp2", "torch_fsdp1", "torch_fsdp2"]


def table(doc: dict) -> str:
    """Per implementation: counts, bitwise share, and the features its failures fall under."""
    by_impl: dict[str, list[dict]] = defaultdict(list)
    for case in doc["cases"]:
        by_impl[case["impl"]].append(case)
    lines = [
        f"{doc['world_size']} ranks, {doc['backend']} on {doc['device']}, torch {doc['torch']}, "
        f"{doc['seconds'] / 60:.1f} min for {len(doc['cases'])} cases.",
        "",
        "| implementation | cases | passed | failed | crashed | unsupported "
        "| bitwise vs DDP (of passed) | failing or crashed (feature: cases) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for impl, cases in by_impl.items():
        counts = Counter(c["status"] for c in cases)
        passed = [c for c in cases if c["status"] == "passed"]
        bitwise = sum(all(s["bitwise"] for s in c["stages"].values()) for c in passed)
        failing = Counter(c["feature"] for c in cases if c["status"] in ("failed", "crashed"))
        where = ", ".join(f"{f}: {n}" for f, n in sorted(failing.items())) or "-"
        lines.append(
            f"| {impl} | {len(cases)} | {counts['passed']} | {counts['failed']} "
            f"| {counts['crashed']} | {counts['unsupported']} | {bitwise} | {where} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="report", metavar="JSON", help="a report to read instead")
    parser.add_argument("--impl", nargs="+", default=IMPLS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--write", metavar="PATH", help="replace the table between the markers")
    args = parser.parse_args(argv)
    if args.report:
        path = Path(args.report)
    else:
        path = Path(tempfile.mkdtemp(prefix="conformance-table-")) / "report.json"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "conformance", "--impl", *args.impl]
        command += ["--nproc", str(args.nproc), "--json", str(path)]
        subprocess.run(command, check=False)
    text = table(json.loads(path.read_text()))
    if args.write:
        write_between_markers(Path(args.write), text, BEGIN, END)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
