"""The README's whole script runs as a user runs it: torchrun, 2 ranks, exit 0, every step printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    scripts = [b for b in blocks if b.startswith("# train.py\n")]
    assert len(scripts) == 1, "README.md should hold one python block starting '# train.py'"
    return scripts[0]


def test_the_readme_script_trains_on_two_ranks_and_exits_cleanly(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_example())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "terminate called" not in out, out
    for rank in (0, 1):
        assert re.search(rf"rank {rank} step 4 loss \d", proc.stdout), out
