"""A 7.5B model sharded for 1024 ranks in one process gives the planner's per-rank bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_7b_model_on_1024_fake_ranks_shards_to_the_planned_bytes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dry_run.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["params"] > 7.4e9 and result["world_size"] == 1024
    # The planner counts psi/N per rank; rank 3 really holds ceil(dim0 / 1024) rows of each param
    # (see param.py Note [Padding]), so it may only hold more, by under one row per param: 0.05 %.
    planned, real = result["planner_param_nbytes"], result["shard_nbytes"]
    assert planned <= real <= planned * 1.001, result
