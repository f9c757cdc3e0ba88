"""The construction paths and FSDP2 setters in the default matrix (docs/conformance.md, "The
matrix"): each trains as DDP does on both of fsdp_lite's fronts, and an API family without the
feature reports it unsupported, never passed. The planted bugs these features catch are in the
self-test's catalog ("construction paths")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conformance.matrix import DEFAULT_MATRIX, FEATURES

REPO = Path(__file__).resolve().parents[1]
SURFACE = (
    "sync_module_states",
    "meta_init",
    "shard_dim1",
    "keep_after_backward",
    "apply",
    "summon_writeback",
    "policy_override",
    "mixed_reshard",
)


def test_every_surface_feature_is_in_the_default_matrix():
    in_default = {f for part in DEFAULT_MATRIX for f in part.features}
    for name in SURFACE:
        assert FEATURES[name].wrap_variant == name
        assert name in in_default, name


def test_surface_features_train_as_ddp_on_both_fronts(tmp_path):
    report = tmp_path / "report.json"
    only = [a for f in SURFACE for a in ("--only", f"*/FULL_SHARD/fp32/{f}/*")]
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--impl", "fsdp_lite", "fsdp_lite_fsdp2"]
        + only
        + ["--json", str(report)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cases = {c["name"]: c["status"] for c in json.loads(report.read_text())["cases"]}
    expected = {
        # FSDP1's API: sync_module_states, meta init, apply, summon's writeback and a policy's
        # per-unit override; FSDP2's: meta init, the two setters and per-unit reshard configs.
        "fsdp_lite": {
            "sync_module_states",
            "meta_init",
            "apply",
            "summon_writeback",
            "policy_override",
        },
        "fsdp_lite_fsdp2": {"meta_init", "shard_dim1", "keep_after_backward", "mixed_reshard"},
    }
    for impl, supported in expected.items():
        for feature in SURFACE:
            models = (
                ("lm_untied", "bufnet")
                if feature in ("sync_module_states", "meta_init")
                else ("lm_untied",)
            )
            for model in models:
                name = f"{impl}/FULL_SHARD/fp32/{feature}/{model}/ws2"
                want = "passed" if feature in supported else "unsupported"
                assert cases.get(name) == want, (name, cases.get(name))
