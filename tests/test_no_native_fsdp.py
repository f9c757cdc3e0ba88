"""The sharding is our own: nothing in fsdp_lite/ names torch's FSDP packages."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lite"
NATIVE = re.compile(r"torch\.distributed\.(fsdp|_composable)")


def test_fsdp_lite_never_mentions_native_fsdp_modules():
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if NATIVE.search(line)
    ]
    assert not hits, "fsdp_lite/ must not import or name native FSDP:\n" + "\n".join(hits)
