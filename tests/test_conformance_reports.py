"""The suite's JSON and JUnit reports parse with strict parsers, whatever the results hold.

A NaN on one side of a comparison is an infinite error, which Python's json module would write as a
bare ``Infinity`` (not JSON); an exception message may carry terminal colour escapes or a NUL, which
XML 1.0 forbids. Both come from real results here: ``compare`` on a NaN against a number, and a
failure reason and traceback with control characters. No ranks are started.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from conformance import report
from conformance.compare import StageTally, compare
from conformance.matrix import Case
from conformance.runner import CaseResult
from conformance.tolerances import STAGES, tolerance

CONTROL = "\x1b[31mred\x1b[0m, a NUL \x00 and a bell \x07"


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _results() -> list[CaseResult]:
    nan_case = Case("impl", "FULL_SHARD", "fp32", "plain", "mlp", 2)
    failed = CaseResult(nan_case, "passed", seconds=1.25)
    failed.stages = {
        stage: {ref: StageTally(tolerance(nan_case, ref, stage)) for ref in ("ddp", "single")}
        for stage in STAGES
    }
    # A NaN in the implementation's gradient against the reference's number: an infinite error.
    nan_vs_number = compare(
        {"fc1.weight": torch.tensor([math.nan, 1.0])},
        {"fc1.weight": torch.tensor([0.5, 1.0])},
        tolerance(nan_case, "ddp", "grads"),
    )
    for ref in ("ddp", "single"):
        failed.stages["grads"][ref].add(1, nan_vs_number)
    failed.status = "failed"
    failed.reason = f"grads differs from the references (first at step 1) {CONTROL}"

    raised = CaseResult(
        Case("impl", "NO_SHARD", "fp32", "plain", "mlp", 2),
        "failed",
        reason=f"rank 0 raised in step 1: RuntimeError: {CONTROL}",
        traceback=f"Traceback (most recent call last):\nRuntimeError: {CONTROL}",
        seconds=0.5,
    )
    skipped = CaseResult(
        Case("impl", "SHARD_GRAD_OP", "fp32", "plain", "mlp", 2),
        "unsupported",
        reason=f"declined {CONTROL}",
    )
    return [failed, raised, skipped]


def test_nan_against_a_number_is_an_infinite_error_in_strict_json():
    results = _results()
    assert results[0].stages["grads"]["ddp"].max_abs == math.inf
    doc = _strict_json(report.to_json(results, {"world_size": 2}))
    assert doc["schema_version"] == report.SCHEMA_VERSION == 3
    grads = doc["cases"][0]["stages"]["grads"]
    assert grads["max_abs"] == "Infinity" and grads["vs_single"]["max_rel"] == "Infinity"
    assert report.json_number(grads["max_abs"]) == math.inf
    assert grads["passed"] is False
    assert doc["cases"][0]["seconds"] == 1.25  # per-case wall time
    assert doc["cases"][0]["reason"].endswith(CONTROL)  # JSON escapes control characters itself


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1.5, 0.0])
def test_json_numbers_round_trip(value):
    text = report.to_json([], {"x": value, "nested": [{"y": value}]})
    doc = _strict_json(text)
    for got in (doc["x"], doc["nested"][0]["y"]):
        back = report.json_number(got)
        assert (math.isnan(back) and math.isnan(value)) or back == value


def test_control_characters_in_a_reason_and_a_traceback_leave_junit_parseable():
    xml = report.to_junit(_results())
    root = ET.fromstring(xml)  # expat: rejects any character XML 1.0 forbids
    cases = list(root.iter("testcase"))
    failure = cases[0].find("failure")
    assert failure.get("type") == "grads"
    assert "\\x1b[31mred\\x1b[0m, a NUL \\x00 and a bell \\x07" in failure.get("message")
    assert "max_abs=inf" in failure.text
    error = cases[1].find("error")
    assert "\\x00" in error.text and "\x00" not in error.text
    assert "\\x07" in cases[2].find("skipped").get("message")
    assert [c.get("time") for c in cases] == ["1.250", "0.500", "0.000"]


def test_the_terminal_and_markdown_reports_take_the_same_results():
    results = _results()
    summary = report.format_summary(results)
    assert "grads (step 1)" in summary and "inf" in summary
    markdown = report.to_markdown(results)
    assert (
        "| impl | FULL_SHARD | fp32 | plain | mlp | ❌ failed | grads (step 1) | inf |" in markdown
    )
