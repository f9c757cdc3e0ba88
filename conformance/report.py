"""Turning results into what people and CI systems read: progress lines, a table, JSON, JUnit, Markdown.

Everything here is pure formatting of ``CaseResult``s (runner.py) and the tolerance table; the CLI
prints on rank 0 only. The JSON schema is documented (and versioned, ``SCHEMA_VERSION``) in
docs/conformance.md: one object with a ``cases`` list; each case's ``stages`` maps a stage to its
verdict and its two comparisons. Both machine-readable reports parse with strict parsers: JSON has
no NaN/Infinity literals (non-finite numbers are strings), JUnit XML no characters XML 1.0 forbids.
"""

from __future__ import annotations

import json
import math
import platform
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from conformance.compare import StageTally
from conformance.results import CaseResult
from conformance.tolerances import STAGES, TABLE

__all__ = [
    "EXIT_CRASHED",
    "EXIT_FAILED",
    "EXIT_PASSED",
    "NON_FINITE",
    "case_json",
    "coverage_markdown",
    "describe_case",
    "SCHEMA_VERSION",
    "exit_status",
    "format_progress",
    "format_summary",
    "json_number",
    "json_safe",
    "to_json",
    "to_junit",
    "to_markdown",
    "tolerance_markdown",
    "xml_text",
]

# 1: the first schema. 2: non-finite numbers are the strings in NON_FINITE (JSON has no NaN or
# Infinity; Python's json module writes them as bare literals that strict parsers reject).
# 3: a case may be "crashed" (a rank died in it), with a "crash" object; "summary" counts them;
# "crashes_outside_cases" lists the ranks that died between cases (launcher.py).
SCHEMA_VERSION = 3
# Exit statuses of a run (with --compare-to, baseline.py's 0, 2 and 3 replace the first two).
EXIT_PASSED = 0  # every case passed or is unsupported
EXIT_FAILED = 1  # a case failed: a comparison, or it raised
EXIT_CRASHED = 4  # a rank died (signal, native abort, exit, hang), in a case or outside any
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_COLUMNS = (
    "impl",
    "strategy",
    "precision",
    "feature",
    "model",
    "status",
    "worst stage",
    "vs DDP",
    "vs single",
    "time",
)


def exit_status(results: Sequence[CaseResult], outside: Sequence[dict[str, Any]] = ()) -> int:
    """EXIT_CRASHED if a rank died (in a case, or ``outside`` any), else EXIT_FAILED if a case
    failed, else EXIT_PASSED (unsupported is not a failure)."""
    if outside or any(r.status == "crashed" for r in results):
        return EXIT_CRASHED
    return EXIT_FAILED if any(r.status == "failed" for r in results) else EXIT_PASSED


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.1e}"


def _worst_stage(r: CaseResult) -> str:
    """The failing stage (and step), or for a passing case the stage furthest from DDP."""
    if r.status == "unsupported":
        return "-"
    if r.status == "crashed":
        return "hung" if (r.crash or {}).get("kind") == "hang" else "rank died"
    first = r.first_failure()
    if first is not None:
        step, stage = first
        return f"{stage} (step {step})"
    if r.traceback is not None:
        return "raised"
    compared = [(t["ddp"].max_abs, s) for s, t in r.stages.items() if t["ddp"].compared]
    if not compared or max(compared)[0] == 0:
        return "-"
    return max(compared)[1]


def _vs(r: CaseResult, ref: str) -> str:
    tallies = [per[ref] for per in r.stages.values() if per[ref].compared]
    if not tallies:
        return "-"
    if all(t.bitwise for t in tallies):
        return "bitwise"
    return _num(max(t.max_abs for t in tallies))


def _row(r: CaseResult) -> list[str]:
    c = r.case
    return [
        c.impl,
        c.strategy,
        c.precision,
        c.feature if c.optimizer == "sgd" else f"{c.feature} [{c.optimizer}]",
        c.model,
        r.status,
        _worst_stage(r),
        _vs(r, "ddp"),
        _vs(r, "single"),
        f"{r.seconds:.1f}s",
    ]


def format_progress(index: int, total: int, r: CaseResult) -> str:
    """One line per finished case, e.g. ``[  3/20] passed       fsdp_lite/FULL_SHARD/... 0.9s``."""
    width = len(str(total))
    line = f"[{index + 1:>{width}}/{total}] {r.status:<11} {r.case.name}  {r.seconds:.1f}s"
    if r.status != "passed" and r.reason:
        line += f"  ({r.reason.splitlines()[0][:160]})"
    return line


def _counts(results: Sequence[CaseResult]) -> str:
    """``N cases: a passed, b failed, c unsupported`` (and ``, d crashed`` when some did)."""
    counts = Counter(r.status for r in results)
    text = (
        f"{len(results)} cases: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['unsupported']} unsupported"
    )
    return text + (f", {counts['crashed']} crashed" if counts["crashed"] else "")


def _crash_lines(crash: dict[str, Any], indent: str) -> list[str]:
    """A crash's retries and the last lines of the dead rank's stderr, for the terminal."""
    lines = []
    if crash.get("verdict"):
        lines.append(f"{indent}{crash['verdict']} crash: crashed in {crash['crashed_runs']} runs")
        for i, run in enumerate(crash.get("runs", []), start=1):
            lines.append(f"{indent}  run {i}: {run}")
    tail = [ln for ln in (crash.get("stderr_tail") or "").splitlines() if ln.strip()]
    if tail:
        who = "its" if crash.get("rank") is not None else "the ranks'"
        # The tail starts at the native message when there is one (launcher.py); a Python
        # traceback says most at its end.
        first = tail[0].strip() == crash.get("native") or crash.get("kind") == "hang"
        shown = tail[:8] if first else tail[-8:]
        which = "first" if first else "last"
        lines.append(f"{indent}{who} stderr (the {which} lines; {len(tail)} in --json):")
        lines += [f"{indent}  {ln[:200]}" for ln in shown]
    return lines


def format_summary(results: Sequence[CaseResult], outside: Sequence[dict[str, Any]] = ()) -> str:
    """The terminal table (one row per case), the counts, and what failed, crashed or was
    unsupported."""
    rows = [list(_COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        _counts(results),
        "vs DDP / vs single: 'bitwise', or the largest absolute difference over all stages and steps.",
    ]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["", "Failures:"]
        for r in failed:
            lines.append(f"  {r.case.name}: {r.reason}")
            for stage in STAGES:
                per_ref = r.stages.get(stage, {})
                bad = [(ref, t) for ref, t in per_ref.items() if not t.passed]
                if bad:
                    parts = [
                        f"vs {ref} max abs {_num(t.max_abs)}, rel {_num(t.max_rel)} > rtol "
                        f"{t.tolerance.rtol:g} (from step {t.first_failed_step})"
                        for ref, t in bad
                    ]
                    lines.append(f"    {stage}: " + "; ".join(parts))
                    lines += [f"      {p}" for p in bad[0][1].problems[:2]]
            if r.traceback:
                last = [ln for ln in r.traceback.strip().splitlines() if ln.strip()][-1]
                lines.append(f"    raised: {last.strip()[:300]} (full traceback in --json)")
    crashed = [r for r in results if r.status == "crashed"]
    if crashed:
        lines += ["", "Crashed (a rank died; the cases after it ran in fresh ranks):"]
        for r in crashed:
            lines.append(f"  {r.case.name}: {r.reason}")
            lines += _crash_lines(r.crash or {}, "    ")
    if outside:
        lines += ["", "Ranks that died outside any case:"]
        for crash in outside:
            lines.append(f"  {crash.get('where', '?')}: {crash['summary']}")
            lines += _crash_lines(crash, "    ")
    unsupported = Counter((r.case.impl, r.reason) for r in results if r.status == "unsupported")
    if unsupported:
        lines += ["", "Unsupported (cases: reason):"]
        for (impl, reason), n in sorted(unsupported.items(), key=lambda kv: (kv[0][0], -kv[1])):
            lines.append(f"  {impl} x{n}: {(reason or '').splitlines()[0][:200]}")
    return "\n".join(lines)


def _tally_json(t: StageTally) -> dict[str, Any]:
    return {
        "max_abs": t.max_abs,
        "max_rel": t.max_rel,
        "bitwise": t.bitwise,
        "tolerance": {"atol": t.tolerance.atol, "rtol": t.tolerance.rtol},
        "passed": t.passed,
        "first_failed_step": t.first_failed_step,
        "worst": t.worst,
        "problems": list(t.problems),
    }


def case_json(r: CaseResult) -> dict[str, Any]:
    """One case of the JSON report (results.case_from_json reads it back)."""
    c = r.case
    stages = {}
    for stage in STAGES:
        per_ref = r.stages.get(stage)
        if not per_ref or not any(t.compared for t in per_ref.values()):
            continue  # the case ended (raised or unsupported) before this stage
        ddp, single = _tally_json(per_ref["ddp"]), _tally_json(per_ref["single"])
        stages[stage] = {
            # The verdict for the stage, with the DDP comparison's numbers at top level.
            "max_abs": ddp["max_abs"],
            "max_rel": ddp["max_rel"],
            "bitwise": ddp["bitwise"],
            "tolerance": ddp["tolerance"],
            "passed": ddp["passed"] and single["passed"],
            "vs_ddp": ddp,
            "vs_single": single,
        }
    first = r.first_failure()
    doc = {
        "name": c.name,
        "impl": c.impl,
        "strategy": c.strategy,
        "precision": c.precision,
        "feature": c.feature,
        "model": c.model,
        "world_size": c.world_size,
        "optimizer": c.optimizer,
        "status": r.status,
        "reason": r.reason,
        "first_failure": None if first is None else {"step": first[0], "stage": first[1]},
        "traceback": r.traceback,
        "seconds": round(r.seconds, 3),
        "stages": stages,
        "crash": r.crash,
    }
    if r.curves is not None:  # recorded by the CLI (conformance/curves.py)
        doc["curves"] = r.curves
    return doc


def to_json(
    results: Sequence[CaseResult],
    meta: dict[str, Any],
    outside: Sequence[dict[str, Any]] = (),
) -> str:
    """The whole run as one JSON object (schema in docs/conformance.md)."""
    counts = Counter(r.status for r in results)
    doc = {
        "schema_version": SCHEMA_VERSION,
        **meta,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "summary": {s: counts[s] for s in ("passed", "failed", "unsupported", "crashed")},
        "exit_status": exit_status(results, outside),
        "crashes_outside_cases": list(outside),
        "tolerance_table": [
            {
                "precision": row.precision,
                "reference": row.reference,
                "when": row.when,
                "tolerances": {s: {"atol": t.atol, "rtol": t.rtol} for s, t in row.stages.items()},
                "why": row.why,
            }
            for row in TABLE
        ],
        "cases": [case_json(r) for r in results],
    }
    # allow_nan=False: a non-finite float that escaped json_safe raises here instead of writing
    # a report that strict parsers reject.
    return json.dumps(json_safe(doc), indent=2, default=str, allow_nan=False)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its string in ``NON_FINITE``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_number(value: Any) -> Any:
    """A number as ``to_json`` wrote it, back as a float: the strings of ``NON_FINITE`` too."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return value


# XML 1.0 allows tab, newline, carriage return and the ranges below; anything else (terminal
# colour escapes in an exception message, a NUL) makes the whole report unparseable.
_XML_ILLEGAL = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: str | None) -> str | None:
    """``text`` with each character XML 1.0 forbids written as its escape, e.g. ``\\x1b``."""
    if text is None:
        return None
    return _XML_ILLEGAL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def describe_case(case: dict[str, Any]) -> str:
    """A case of the JSON report in words: its verdict, then each failing comparison with its
    first problems, then the traceback if it raised (the pytest plugin's failure message)."""
    lines = [f"{case['name']}: {case['status']} ({case['seconds']:.1f}s)"]
    if case.get("reason"):
        lines[0] += f": {case['reason']}"
    if case.get("crash"):
        lines += _crash_lines(case["crash"], "  ")
    for stage, verdict in case.get("stages", {}).items():
        for ref in ("vs_ddp", "vs_single"):
            t = verdict[ref]
            if t["passed"]:
                continue
            tol = t["tolerance"]
            lines.append(
                f"  {stage} vs {ref[3:]}: max abs {_num(json_number(t['max_abs']))}, rel "
                f"{_num(json_number(t['max_rel']))} > atol {tol['atol']:g} + rtol {tol['rtol']:g}"
                f" (first at step {t['first_failed_step']})"
            )
            lines += [f"    {p}" for p in t["problems"][:3]]
    if case.get("traceback"):
        lines += ["", case["traceback"].rstrip()]
    return "\n".join(lines)


def to_junit(
    results: Sequence[CaseResult],
    suite_name: str = "conformance",
    outside: Sequence[dict[str, Any]] = (),
) -> str:
    """JUnit XML: a testcase per case, <failure> naming the stage, <error> for an exception
    (type "exception") or a rank that died (type "crashed"), <skipped> for unsupported; a rank
    that died outside any case is a testcase of its own with an <error>."""
    counts = Counter(r.status for r in results)
    raised = sum(1 for r in results if r.status == "failed" and r.traceback)
    errors = raised + counts["crashed"] + len(outside)
    root = ET.Element("testsuites")
    suite = ET.SubElement(
        root,
        "testsuite",
        name=suite_name,
        tests=str(len(results) + len(outside)),
        failures=str(counts["failed"] - raised),
        errors=str(errors),
        skipped=str(counts["unsupported"]),
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    for r in results:
        c = r.case
        case_el = ET.SubElement(
            suite,
            "testcase",
            classname=f"{suite_name}.{c.impl}",
            name=c.name.split("/", 1)[1],
            time=f"{r.seconds:.3f}",
        )
        if r.status == "unsupported":
            ET.SubElement(case_el, "skipped", message=f"unsupported: {r.reason}")
        elif r.status == "crashed":
            err = ET.SubElement(case_el, "error", message=r.reason or "crashed", type="crashed")
            err.text = (
                "\n".join(_crash_lines(r.crash or {}, ""))
                + "\n\n"
                + ((r.crash or {}).get("stderr_tail") or "")
            )
        elif r.status == "failed" and r.traceback:
            err = ET.SubElement(case_el, "error", message=r.reason or "raised", type="exception")
            err.text = r.traceback
        elif r.status == "failed":
            first = r.first_failure()
            stage = first[1] if first else "comparison"
            fail = ET.SubElement(case_el, "failure", message=r.reason or "", type=stage)
            fail.text = "\n".join(
                f"{s} vs {ref}: max_abs={t.max_abs:.3g} max_rel={t.max_rel:.3g} "
                f"tolerance atol={t.tolerance.atol:g} rtol={t.tolerance.rtol:g}\n  "
                + "\n  ".join(t.problems)
                for s, per in r.stages.items()
                for ref, t in per.items()
                if not t.passed
            )
        out = ET.SubElement(case_el, "system-out")
        out.text = "\n".join(
            f"{s}: vs DDP max_abs={per['ddp'].max_abs:.3g} bitwise={per['ddp'].bitwise}; "
            f"vs single max_abs={per['single'].max_abs:.3g}"
            for s, per in r.stages.items()
            if per["ddp"].compared
        )
    for crash in outside:
        case_el = ET.SubElement(
            suite,
            "testcase",
            classname=f"{suite_name}.launch",
            name=f"a rank died {crash.get('where', 'outside any case')}",
            time="0.000",
        )
        err = ET.SubElement(case_el, "error", message=crash["summary"], type="crashed")
        err.text = crash.get("stderr_tail") or ""
    for el in root.iter():  # messages and tracebacks may carry terminal escapes: see xml_text
        el.text = xml_text(el.text)
        for key, value in el.attrib.items():
            el.set(key, xml_text(value))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def to_markdown(
    results: Sequence[CaseResult],
    title: str = "Conformance",
    outside: Sequence[dict[str, Any]] = (),
) -> str:
    """The summary table as Markdown, then the reasons, then the crashes."""
    lines = [
        f"## {title}",
        "",
        f"{_counts(results)}.",
        "",
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    for r in results:
        cells = _row(r)
        cells[5] = {
            "passed": "✅ passed",
            "failed": "❌ failed",
            "unsupported": "➖ unsupported",
            "crashed": "💥 crashed",
        }[r.status]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    notes = [r for r in results if r.status != "passed" and r.reason]
    if notes:
        lines += ["", "| case | reason |", "|---|---|"]
        lines += [
            f"| {r.case.name} | {r.reason.splitlines()[0].replace('|', '/')} |" for r in notes
        ]
    crashes = [(r.case.name, r.crash or {}) for r in results if r.status == "crashed"]
    crashes += [(f"(no case: {c.get('where', '?')})", c) for c in outside]
    if crashes:
        lines += [
            "",
            "### Crashed: a rank died",
            "",
            "| case | rank | signal or exit code | after stage | native message | retries |",
            "|---|---|---|---|---|---|",
        ]
        for name, crash in crashes:
            how = {
                "signal": f"{crash.get('signal')} ({crash.get('signal_number')})",
                "exit": f"exit code {crash.get('exit_code')}",
                "hang": f"hung {crash.get('seconds') or 0:.0f} s",
            }.get(crash.get("kind"), "-")
            retries = (
                f"{crash['verdict']}: crashed in {crash['crashed_runs']} runs"
                if crash.get("verdict")
                else "-"
            )
            cells = [
                name,
                "-" if crash.get("rank") is None else str(crash["rank"]),
                how,
                crash.get("after") or "-",
                f"`{crash['native']}`" if crash.get("native") else "-",
                retries,
            ]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def coverage_markdown(doc: dict[str, Any]) -> str:
    """``--coverage``'s table (launcher.combine_coverage's dict): per file its covered lines and
    branches and their percentages, then the total."""

    def cells(name: str, c: dict[str, Any]) -> str:
        branch = "-" if c["branch_percent"] is None else f"{c['branch_percent']:.1f}"
        return (
            f"| {name} | {c['covered_lines']}/{c['statements']} | {c['line_percent']:.1f} "
            f"| {c['covered_branches']}/{c['branches']} | {branch} |"
        )

    ranks = ", ".join(map(str, doc["ranks"])) or "none"
    launches = "1 launch" if doc["launches"] == 1 else f"{doc['launches']} launches"
    lines = [
        f"## Coverage of {', '.join(doc['packages'])}",
        "",
        f"`{doc['command']}`: {doc['data_files']} data files from {launches}, ranks {ranks}; "
        f"coverage.py {doc['coverage_version']}.",
        "",
        "| file | lines | line % | branches | branch % |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [cells(name, c) for name, c in doc["files"].items()]
    lines.append(cells("**total**", doc["totals"]))
    return "\n".join(lines) + "\n"


def tolerance_markdown() -> str:
    """The tolerance table as Markdown (docs/conformance.md pastes this)."""
    lines = [
        "| precision | vs | when | " + " | ".join(STAGES) + " | why |",
        "|---|---|---|" + "---|" * len(STAGES) + "---|",
    ]
    for row in TABLE:
        cells = []
        for stage in STAGES:
            t = row.stages.get(stage)
            if t is None or (t.atol == 0 and t.rtol == 0):
                cells.append("0")
            else:
                cells.append(
                    " + ".join(
                        x for x in (t.atol and f"{t.atol:g}", t.rtol and f"{t.rtol:g}·max") if x
                    )
                )
        lines.append(
            f"| {row.precision} | {row.reference} | {row.when} | "
            + " | ".join(cells)
            + f" | {row.why} |"
        )
    return "\n".join(lines)
