"""scripts/cost_curves.py on a tiny model at one rank: its rows, ZeRO's prediction, its plot."""

from __future__ import annotations

import pytest

from scripts import cost_curves
from tests.test_bench import run_bench


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    systems = ",".join(("single",) + cost_curves.SYSTEMS)
    out = tmp_path_factory.mktemp("cost") / "world_1.json"
    return run_bench(out, "--world-size", "1", "--systems", systems)


def test_at_one_rank_every_system_holds_the_model_states_zero_predicts(report):
    rows = cost_curves.summarize(report, "world", 1)
    assert [r["system"] for r in rows] == list(cost_curves.SYSTEMS)
    psi = report["config"]["params"]
    for row in rows:
        assert row["zero_states_nbytes"] == 16 * psi  # one rank: ZeRO-3's share is everything
        # AdamW's "step" counters (4 bytes a parameter tensor) are the only bytes beyond 16 psi.
        assert 0 <= row["state_nbytes"] - 16 * psi <= 4 * 64, row
        assert row["peak_nbytes"] >= row["state_nbytes"]


def test_the_plot_is_a_png_and_the_table_has_a_row_per_system(report, tmp_path):
    pytest.importorskip("matplotlib")
    rows = cost_curves.summarize(report, "world", 1)
    cost_curves.plot(rows, "world", tmp_path / "cost_world.png")
    assert (tmp_path / "cost_world.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(cost_curves.table(rows).splitlines()) == 2 + len(cost_curves.SYSTEMS)
