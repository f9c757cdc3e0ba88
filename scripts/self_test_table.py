"""Regenerate the self-test's kill table in docs/conformance.md: every catalog entry, what catches
it on the default matrix and on ``--quick``, where it is planted and what it is modelled on.

    python scripts/self_test_table.py                      # both runs, print the table
    python scripts/self_test_table.py --write docs/conformance.md
    python scripts/self_test_table.py --from default.json quick.json --write docs/conformance.md

It runs ``python -m conformance --self-test`` and ``--self-test --quick`` (each with ``--json``),
or reads two such reports (``--from``), and puts the table between the markers
``<!-- self-test table begin -->`` and ``<!-- self-test table end -->`` of the file given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEGIN, END = "<!-- self-test table begin -->", "<!-- self-test table end -->"


def run_self_test(quick: bool, out: Path) -> float:
    """One self-test run writing its JSON report to ``out``; returns its wall time in seconds."""
    command = [sys.executable, "-m", "conformance", "--self-test", "--json", str(out)]
    start = time.perf_counter()
    subprocess.run(command + (["--quick"] if quick else []), check=False)
    return time.perf_counter() - start


def _caught(entry: dict) -> str:
    if entry["status"] != "caught":
        return f"**{entry['status']}** ({entry['cases_run']} cases)"
    case = "/".join(entry["case"].split("/")[1:-1]) if entry["case"] else "-"
    return f"`{case}`: {entry['stage']}".replace("|", "/")


def table(default: dict, quick: dict) -> str:
    """The Markdown table and a line of counts per run."""
    quick_by_name = {e["name"]: e for e in quick["entries"]}
    lines = [
        "| entry: what it plants | class | ranks | default matrix: caught by (case: stage) "
        "| `--quick` | planted in | modelled on |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in default["entries"]:
        q = quick_by_name.get(e["name"])
        files = ", ".join(sorted({f"`{p['file']}`" for p in e["patches"]}))
        lines.append(
            f"| `{e['name']}`: {e['what']} | {e['bug_class']} | {e['world_size']} | {_caught(e)} "
            f"| {_caught(q) if q else '-'} | {files} | {e['upstream'] or '-'} |"
        )
    lines.append("")
    for name, doc in (("default matrix", default), ("`--quick`", quick)):
        s, n = doc["summary"], len(doc["entries"])
        lines.append(
            f"- {name}: {s['caught']} of {n} caught ({100 * s['caught'] / n:.0f} %), "
            f"{s['missed']} missed; self-test wall time {doc['seconds'] / 60:.1f} min"
        )
    return "\n".join(lines) + "\n"


def write_between_markers(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between the markers ``begin`` and ``end`` of ``path`` with ``text``."""
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} ... {end} markers")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="reports", nargs=2, metavar=("DEFAULT", "QUICK"))
    parser.add_argument("--write", metavar="PATH", help="replace the table between the markers")
    args = parser.parse_args(argv)
    if args.reports:
        paths = [Path(p) for p in args.reports]
    else:
        tmp = Path(tempfile.mkdtemp(prefix="self-test-table-"))
        paths = [tmp / "default.json", tmp / "quick.json"]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        for path, quick in zip(paths, (False, True)):
            run_self_test(quick, path)
    default, quick = (json.loads(p.read_text()) for p in paths)
    text = table(default, quick)
    if args.write:
        write_between_markers(Path(args.write), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
