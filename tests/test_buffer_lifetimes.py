"""Buffer lifetimes (docs/engine.md): the prefetch and teardown paths, repeated under glibc's heap
checks, free every model, drop no collective unwaited, and compute what a plain model computes.

scripts/stress_lifetimes.py does the work on 2 ranks of its own: glibc reads ``MALLOC_*`` when a
process starts, so the ranks cannot come from tests/ranks.py's forkserver. Before the fixes it
checks, every model leaked (its units stayed alive after ``del`` and ``gc.collect()``), and once
they were freed, an all-gather prefetched for a block a no-grad forward skipped was dropped with
its receive still posted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.soak_matrix import HEAP_CHECKS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("perturb", ["165", "91"])
def test_prefetch_and_teardown_under_heap_checks_free_everything_and_drop_nothing(
    tmp_path, perturb
):
    out = tmp_path / "summary.json"
    env = dict(os.environ, **{**HEAP_CHECKS, "MALLOC_PERTURB_": perturb}, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "scripts" / "stress_lifetimes.py"), "--iterations", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary == {
        "rounds": 12,
        "max_abs_diff_vs_plain_model": 0.0,
        "collectives_dropped_unfinished": 0,
        "units_alive_after_drop": 0,
    }, summary
