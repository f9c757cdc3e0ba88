"""scripts/beyond_ram.py end to end at a tiny depth: it trains from disk, measures its floors and
reports what the run past RAM reports (benchmarks/results/beyond_ram_*)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_trains_from_disk_and_reports_rss_io_and_floors(tmp_path):
    offload = tmp_path / "offload"
    offload.mkdir()
    out = tmp_path / "beyond_ram"
    tiny = ["--blocks", "2", "--d-model", "256", "--floor-blocks", "1", "--dd-gib", "0.0625"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "beyond_ram.py"), "--dir", str(offload), *tiny]
        + ["--steps", "3", "--lr", "1e-3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["config"]["n_layers"] == 2 and result["args"]["steps"] == 3
    losses = [s["loss"] for s in result["disk"][0]["steps"]]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == 3, losses
    for rank in result["disk"]:
        assert rank["init_s"] > 0 and rank["shard_numel"] > 0
        for step in rank["steps"]:
            assert step["peak_rss"] > 0 and step["step_s"] > 0 and step["user_s"] >= 0
    summary = result["summary"]
    assert summary["io_floor_s"] > 0 and summary["compute_floor_s"] > 0
    assert 0 < summary["rss_ratio"] <= 1.1, summary  # the bound the script holds
    assert set(result["bandwidth"]) == {"read", "write"}
    text = out.with_suffix(".txt").read_text()
    assert "step / max(floors) = " in text and "I/O floor" in text and ", held" in text
    assert list(offload.iterdir()) == [], "the run removed its files"
