"""A case's outcome (``CaseResult``), and reading one back from the JSON the reports write.

Its own module, light to import (no DTensor, no DCP), because the process that launches the ranks
assembles the run's reports from the results the ranks wrote to disk case by case (launcher.py,
Note [Results that survive a rank]) and should not pay for what the ranks import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.compare import StageTally
from conformance.matrix import Case
from conformance.tolerances import STAGES, Tolerance

__all__ = ["STATUSES", "CaseResult", "case_from_json"]

# "crashed": a rank died (a signal, a native abort, an exit, or a hang the launcher ended) while
# the case ran, so nothing of its comparisons survived; ``CaseResult.crash`` says how.
STATUSES = ("passed", "failed", "unsupported", "crashed")


@dataclass
class CaseResult:
    """The outcome of one case, the same on every rank."""

    case: Case
    status: str  # one of STATUSES
    reason: str | None = None  # why unsupported, the error that failed the case, or the crash
    traceback: str | None = None  # the failing rank's traceback, when a case raised
    stages: dict[str, dict[str, StageTally]] = field(default_factory=dict)  # stage -> ref -> tally
    seconds: float = 0.0
    # crashed only: which rank died and how, its native stderr, the retries (launcher.py)
    crash: dict[str, Any] | None = None
    # per-step loss and gradient norm of the implementation and the references, recorded on
    # rank 0 (conformance/curves.py); for the HTML report
    curves: dict[str, Any] | None = None

    def first_failure(self) -> tuple[int, str] | None:
        """(1-based step, stage) of the earliest failed comparison, or None."""
        found = [
            (t.first_failed_step, STAGES.index(stage), stage)
            for stage, per_ref in self.stages.items()
            for t in per_ref.values()
            if t.first_failed_step is not None
        ]
        if not found:
            return None
        step, _, stage = min(found)
        return step, stage

    def failed_stages(self) -> list[str]:
        return [
            s for s, per_ref in self.stages.items() if not all(t.passed for t in per_ref.values())
        ]


def _number(value: Any) -> float:
    """A float as report.json_safe wrote it (non-finite ones are strings)."""
    return float(value) if isinstance(value, str) else value


def _tally(doc: dict[str, Any]) -> StageTally:
    tol = doc["tolerance"]
    return StageTally(
        Tolerance(tol["atol"], tol["rtol"]),
        max_abs=_number(doc["max_abs"]),
        max_rel=_number(doc["max_rel"]),
        bitwise=doc["bitwise"],
        passed=doc["passed"],
        first_failed_step=doc["first_failed_step"],
        worst=doc["worst"],
        problems=list(doc["problems"]),
        compared=True,  # report._case_json writes only the stages that were compared
    )


def case_from_json(doc: dict[str, Any]) -> CaseResult:
    """The ``CaseResult`` that report's ``_case_json`` wrote as ``doc``: the same reports come
    from it (seconds as written, to the millisecond)."""
    case = Case(
        doc["impl"],
        doc["strategy"],
        doc["precision"],
        doc["feature"],
        doc["model"],
        doc["world_size"],
        doc.get("optimizer", "sgd"),
    )
    stages = {
        stage: {"ddp": _tally(verdict["vs_ddp"]), "single": _tally(verdict["vs_single"])}
        for stage, verdict in doc.get("stages", {}).items()
    }
    return CaseResult(
        case,
        doc["status"],
        reason=doc.get("reason"),
        traceback=doc.get("traceback"),
        stages=stages,
        seconds=doc.get("seconds", 0.0),
        crash=doc.get("crash"),
        curves=doc.get("curves"),
    )
