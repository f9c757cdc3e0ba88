"""The sharding is our own: nothing in fsdp_lite/ names torch's FSDP packages.

The one exception the project allows: fsdp_lite/fronts/interop.py imports torch's ``FSDPModule`` class, as
a base class for isinstance checks (tests/test_interop.py shows none of its code runs).
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lite"
NATIVE = re.compile(r"torch\.distributed\.(fsdp|_composable)")
ALLOWED = {
    "fsdp_lite/fronts/interop.py": {
        "from torch.distributed.fsdp import FSDPModule as TorchFSDPModule"
    }
}


def test_fsdp_lite_never_mentions_native_fsdp_modules():
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if NATIVE.search(line)
        and line.strip() not in ALLOWED.get(str(path.relative_to(PACKAGE.parent)), ())
    ]
    assert not hits, "fsdp_lite/ must not import or name native FSDP:\n" + "\n".join(hits)
