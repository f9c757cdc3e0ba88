"""Comparing a run with a previous one (``--compare-to previous.json``): regressions and improvements.

A CI job that judges an implementation with known failures (torch FSDP1 fails 12 cases) cannot
gate on "every case passed"; it gates on "nothing got worse". This file compares two JSON reports
(report.to_json, any schema version up to report.SCHEMA_VERSION) case by case and stage by stage,
by name, and says what got worse and what got better. Pure dictionaries in, dictionaries out: no
tensors and no collectives, so it runs on rank 0 after a run, or on two saved files.

A stage's *distance* to a reference is its ``max_rel`` (relative to the tensor's scale, so that
models of every size compare). Per case and stage:

  regression   the stage passed before and fails now; or its distance to either reference grew
               by more than ``factor`` (from 0, i.e. bitwise, to anything counts); or the case
               passed (or was failing with a comparison) and now raises, crashes (a rank died
               in it) or is unsupported, or a case the baseline does not have fails or crashes
  improvement  the stage failed before and passes now; or a distance shrank by more than
               ``factor`` (to 0 counts); or the case failed, crashed or was unsupported and
               passes now

A run where a rank died exits 4 whatever the comparison says (cli.py): the crashes are listed here
too, as regressions where the baseline ran the case to its end.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from conformance.report import SCHEMA_VERSION, json_number
from conformance.tolerances import STAGES

__all__ = [
    "DEFAULT_FACTOR",
    "EXIT_IMPROVED",
    "EXIT_REGRESSED",
    "EXIT_SAME",
    "Change",
    "Comparison",
    "compare_reports",
    "load_report",
]

DEFAULT_FACTOR = 10.0
# Exit statuses of a run with --compare-to (a run without one exits 1 when a case failed).
EXIT_SAME = 0  # nothing got worse or better beyond the factor (known failures may remain)
EXIT_REGRESSED = 2  # at least one regression
EXIT_IMPROVED = 3  # improvements and no regression: the baseline is stale, regenerate it
_REFERENCES = ("vs_ddp", "vs_single")
_STATUS_NAMES = {EXIT_SAME: "same", EXIT_REGRESSED: "regressed", EXIT_IMPROVED: "improved"}


@dataclass(frozen=True)
class Change:
    """One regression or improvement: a case, the stage (None: the case as a whole), what changed."""

    case: str
    stage: str | None
    what: str  # e.g. "passed, fails now" or "distance to ddp grew 1.2e-07 -> 3.4e-05 (x283)"

    def __str__(self) -> str:
        return f"{self.case}{'' if self.stage is None else f' [{self.stage}]'}: {self.what}"


@dataclass
class Comparison:
    """The outcome of comparing a run with a baseline report."""

    baseline: str  # where the baseline came from (a path)
    factor: float
    regressions: list[Change]
    improvements: list[Change]
    new_cases: list[str]  # in this run, not in the baseline
    missing_cases: list[str]  # in the baseline, not in this run (another --only, --shard, matrix)

    @property
    def exit_status(self) -> int:
        if self.regressions:
            return EXIT_REGRESSED
        return EXIT_IMPROVED if self.improvements else EXIT_SAME

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "factor": self.factor,
            "exit_status": self.exit_status,
            "regressions": [asdict(c) for c in self.regressions],
            "improvements": [asdict(c) for c in self.improvements],
            "new_cases": self.new_cases,
            "missing_cases": self.missing_cases,
        }

    def format(self) -> str:
        """The comparison for the terminal."""
        lines = [
            f"Compared with {self.baseline} (factor {self.factor:g}): "
            f"{len(self.regressions)} regressions, {len(self.improvements)} improvements, "
            f"{len(self.new_cases)} new cases, {len(self.missing_cases)} cases not run"
        ]
        for title, changes in (
            ("Regressions", self.regressions),
            ("Improvements", self.improvements),
        ):
            if changes:
                lines += [f"{title}:"] + [f"  {c}" for c in changes]
        lines.append(f"exit status {self.exit_status} ({_STATUS_NAMES[self.exit_status]})")
        return "\n".join(lines)

    def format_markdown(self) -> str:
        """The comparison as Markdown, after the summary table (``--markdown``)."""
        lines = [
            f"### Compared with `{self.baseline}`",
            "",
            f"{len(self.regressions)} regressions, {len(self.improvements)} improvements "
            f"(factor {self.factor:g}), {len(self.new_cases)} new cases, "
            f"{len(self.missing_cases)} cases not run: **{_STATUS_NAMES[self.exit_status]}**.",
        ]
        for title, changes in (
            ("regression", self.regressions),
            ("improvement", self.improvements),
        ):
            if changes:
                lines += ["", f"| {title} | stage | what |", "|---|---|---|"]
                lines += [
                    f"| {c.case} | {c.stage or '-'} | {c.what.replace('|', '/')} |" for c in changes
                ]
        return "\n".join(lines) + "\n"


def load_report(path: str) -> dict[str, Any]:
    """A JSON report from ``path``; refuses a schema newer than this suite writes."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)  # Python's parser also reads version 1's bare Infinity
    version = doc.get("schema_version")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {version!r}; this suite reads 1 to {SCHEMA_VERSION}"
        )
    return doc


def _distance(stage: dict[str, Any], ref: str) -> float:
    return float(json_number(stage.get(ref, {}).get("max_rel", 0.0)))


def _ratio(before: float, after: float) -> str:
    if before == 0:
        return "was bitwise" if after > 0 else ""
    if after == 0:
        return "now bitwise"
    return f"x{after / before:.3g}"


def _compare_case(name: str, before: dict, after: dict, factor: float):
    regressions: list[Change] = []
    improvements: list[Change] = []
    was, now = before["status"], after["status"]
    was_raised = (was == "failed" and before.get("traceback")) or was == "crashed"
    now_raised = now == "failed" and after.get("traceback")
    if was != "unsupported" and now == "unsupported":
        regressions.append(Change(name, None, f"{was}, unsupported now: {after.get('reason')}"))
        return regressions, improvements
    if now == "crashed" and was != "crashed":
        regressions.append(Change(name, None, f"{was}, crashes now: {after.get('reason')}"))
        return regressions, improvements
    if now_raised and not was_raised:
        regressions.append(Change(name, None, f"{was}, raises now: {after.get('reason')}"))
        return regressions, improvements
    if was in ("unsupported", "failed", "crashed") and now == "passed":
        improvements.append(Change(name, None, f"{was}, passes now"))
        return regressions, improvements
    if was_raised or was == "unsupported":
        return regressions, improvements  # nothing stage by stage to compare with
    for stage in STAGES:
        b, a = before["stages"].get(stage), after["stages"].get(stage)
        if b is None or a is None:
            continue
        if b["passed"] and not a["passed"]:
            regressions.append(Change(name, stage, "passed, fails now"))
            continue
        if not b["passed"] and a["passed"]:
            improvements.append(Change(name, stage, "failed, passes now"))
            continue
        for ref in _REFERENCES:
            d_before, d_after = _distance(b, ref), _distance(a, ref)
            where = f"distance to {ref[3:]} (max_rel)"
            if d_after > factor * d_before or (d_before == 0 and d_after > 0):
                what = f"{where} grew {d_before:.3g} -> {d_after:.3g} ({_ratio(d_before, d_after)})"
                regressions.append(Change(name, stage, what))
            elif d_before > factor * d_after or (d_after == 0 and d_before > 0):
                what = (
                    f"{where} shrank {d_before:.3g} -> {d_after:.3g} ({_ratio(d_before, d_after)})"
                )
                improvements.append(Change(name, stage, what))
    return regressions, improvements


def compare_reports(
    before: dict[str, Any], after: dict[str, Any], baseline: str, factor: float = DEFAULT_FACTOR
) -> Comparison:
    """Compare report ``after`` (this run) with ``before`` (the baseline), case by case by name."""
    if not (factor >= 1 and math.isfinite(factor)):
        raise ValueError(f"the regression factor must be a finite number >= 1, not {factor}")
    old = {c["name"]: c for c in before["cases"]}
    new = {c["name"]: c for c in after["cases"]}
    result = Comparison(
        baseline,
        factor,
        regressions=[],
        improvements=[],
        new_cases=[n for n in new if n not in old],
        missing_cases=[n for n in old if n not in new],
    )
    for name, case in new.items():
        if name not in old:
            if case["status"] in ("failed", "crashed"):
                what = "fails" if case["status"] == "failed" else "crashes"
                result.regressions.append(Change(name, None, f"new case, {what}: {case['reason']}"))
            continue
        regressions, improvements = _compare_case(name, old[name], case, factor)
        result.regressions += regressions
        result.improvements += improvements
    return result
