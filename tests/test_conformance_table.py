"""scripts/conformance_table.py: crashed cases get a column of their own, apart from failures, and
their features are listed beside the failing ones. The table is pinned with expecttest."""

import expecttest

from scripts.conformance_table import table


def _case(impl: str, feature: str, status: str, bitwise: bool = True) -> dict:
    stages = {"loss": {"bitwise": bitwise}} if status == "passed" else {}
    return {"impl": impl, "feature": feature, "status": status, "stages": stages}


class TestTable(expecttest.TestCase):
    def test_crashed_cases_are_counted_apart_from_failures(self):
        doc = {
            "world_size": 2,
            "backend": "gloo",
            "device": "cpu",
            "torch": "2.13.0+cpu",
            "seconds": 90.0,
            "cases": [
                _case("a", "plain", "passed"),
                _case("a", "no_sync", "passed", bitwise=False),
                _case("a", "no_sync", "failed"),
                _case("a", "meta_init", "crashed"),
                _case("b", "plain", "unsupported"),
                _case("b", "plain", "passed"),
            ],
        }
        self.assertExpectedInline(
            table(doc),
            """\
2 ranks, gloo on cpu, torch 2.13.0+cpu, 1.5 min for 6 cases.

| implementation | cases | passed | failed | crashed | unsupported | bitwise vs DDP (of passed) | failing or crashed (feature: cases) |
|---|---|---|---|---|---|---|---|
| a | 4 | 2 | 1 | 1 | 0 | 1 | meta_init: 1, no_sync: 1 |
| b | 2 | 1 | 0 | 0 | 1 | 1 | - |
""",
        )
