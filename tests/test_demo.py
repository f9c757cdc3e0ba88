"""The main job, `python -m fsdp_lite.demo`, end to end: launch, train every mode, print the table."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MODES = ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
STEPS = 3


def _table_rows(stdout: str) -> dict[str, dict[str, str]]:
    """Parse the report table: columns are separated by two or more spaces."""
    lines = stdout.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    header = re.split(r"\s{2,}", lines[header_at].strip())
    rows = {}
    for line in lines[header_at + 2 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in MODES:
            assert len(cells) == len(header), (
                f"row has {len(cells)} cells, header {len(header)}: {line!r}"
            )
            rows[cells[0]] = dict(zip(header, cells))
    return rows


@pytest.mark.slow
def test_demo_launches_two_ranks_and_every_strategy_matches_ddp_bitwise():
    # Without torchrun's variables the demo must launch its own ranks, as the README's command does.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "fsdp_lite.demo", "--nproc", "2", "--steps", str(STEPS),
           "--layers", "1", "--d-model", "32", "--seq-len", "32", "--batch", "4"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"demo exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )

    rows = _table_rows(proc.stdout)
    assert list(rows) == list(MODES), f"table rows {list(rows)}\n{proc.stdout}"
    for mode in MODES[1:]:
        # fp32 at world size 2 sums in the same order as DDP: equal bitwise, not merely close.
        assert rows[mode]["loss diff"] == "0", f"{mode} loss differs from DDP's\n{proc.stdout}"
        assert rows[mode]["param diff"] == "0", f"{mode} params differ from DDP's\n{proc.stdout}"
    # Only rank 0 reports: each progress line appears once, not once per rank.
    for mode in MODES:
        last = re.findall(rf"^{mode}\s+step\s+{STEPS}/{STEPS}\s+loss", proc.stdout, flags=re.M)
        assert len(last) == 1, (
            f"{mode}'s last progress line appears {len(last)} times\n{proc.stdout}"
        )
