"""docs/conformance.md's feature -> cases table is what scripts/feature_cases.py counts today,
and every row names either cases or the tests that stand in for them."""

from __future__ import annotations

from pathlib import Path

from scripts import feature_cases

DOC = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


def test_the_docs_table_is_the_scripts_output():
    table = feature_cases.markdown(feature_cases.counts())
    assert table in DOC.read_text(), (
        "docs/conformance.md's feature table is stale: paste `python scripts/feature_cases.py`"
    )


def test_every_row_has_cases_or_names_the_tests_instead():
    repo = DOC.parents[1]
    counted = feature_cases.counts()
    for row in feature_cases.FEATURES:
        assert (repo / row.doc).exists(), row
        if row.patterns:
            n = counted[row.feature]
            assert n["default"] + n["ranks4"] + n["optimizers"] > 0, row  # matches nothing
        else:
            named = [w.strip(",;") for w in row.why.split() if w.startswith("tests/")]
            assert named and all((repo / t).exists() for t in named), row
