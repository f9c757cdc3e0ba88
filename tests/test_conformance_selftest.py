"""The bug catalog and ``python -m conformance --self-test``.

Every entry's anchors must be in fsdp_lite's source exactly once (a refactoring that moves one
fails here, naming the entry to re-anchor); a stale entry stops the self-test before any rank
starts; and a few entries run end to end as a user runs them, on the quick matrix, each caught at
the case and stage the table prints, with the clean copy passing those cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from expecttest import assert_expected_inline

from conformance import catalog, selftest
from conformance.catalog import CATALOG, Bug, Patch
from conformance.matrix import Case

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fsdp_lite"

# Classes caught on the quick matrix's first cases, each a different stage and unit kind; the
# last only by reading its sharded checkpoint whole (a round trip at its own layout passes).
CI_ENTRIES = [
    "divide_post_factor_doubled",
    "reduce_scatter_sends_own_row",
    "clip_norm_counts_replicated_per_rank",
    "sharded_state_dict_saves_padded_shards",
]


def test_the_catalog_has_forty_entries_each_anchored_once_in_the_current_source():
    assert len(CATALOG) >= 40
    assert len({b.name for b in CATALOG}) == len(CATALOG)
    assert selftest.stale_patches(list(CATALOG), PACKAGE) == []
    for bug in CATALOG:
        assert bug.patches and bug.what and bug.bug_class, bug.name
        assert bug.world_size in (2, 3, 4), bug.name
        for patch in bug.patches:
            assert patch.anchor != patch.replacement, bug.name
            assert "planted" in patch.replacement, f"{bug.name}: mark the planted line"


def test_planting_copies_the_package_and_leaves_the_source_alone(tmp_path):
    bug = next(b for b in CATALOG if b.name == "divide_post_factor_doubled")
    before = (PACKAGE / "engine" / "collectives.py").read_text()
    root = selftest.plant(bug, PACKAGE, tmp_path / "bug")
    planted = (root / "fsdp_lite" / "engine" / "collectives.py").read_text()
    assert planted == before.replace(bug.patches[0].anchor, bug.patches[0].replacement)
    assert (PACKAGE / "engine" / "collectives.py").read_text() == before
    assert not list((root / "fsdp_lite").rglob("__pycache__"))


STALE = Bug(
    "stale_example",
    "divide factors",
    "an anchor the refactoring moved",
    "",
    (Patch("engine/collectives.py", "def grad_divide_factors(world_size):\n", "planted"),),
)


def test_a_stale_entry_is_named_and_stops_the_self_test_before_any_launch(
    tmp_path, monkeypatch, capsys
):
    problems = selftest.stale_patches([STALE], PACKAGE)
    assert problems == [
        "stale_example: fsdp_lite/engine/collectives.py: anchor 'def grad_divide_factors("
        "world_size):' found 0 times; re-anchor the entry in conformance/catalog.py"
    ]
    with pytest.raises(selftest.StaleEntry, match="stale_example"):
        selftest.plant(STALE, PACKAGE, tmp_path / "stale")
    monkeypatch.setattr(catalog, "CATALOG", (*CATALOG[:1], STALE))
    launches = []
    args = Namespace(only=[], quick=True, steps=3, timeout=20.0, json=None, markdown=None)
    assert selftest.run(args, lambda nproc, argv: launches.append(argv)) == 2
    assert launches == []
    assert "stale catalog entries" in capsys.readouterr().out


def test_likely_killers_run_first_then_the_rest_in_matrix_order():
    cases = [
        Case("fsdp_lite", strategy, "fp32", feature, "lm_untied", 2)
        for strategy in ("NO_SHARD", "FULL_SHARD")
        for feature in ("plain", "no_sync", "clip_grad_norm")
    ]
    ordered = selftest.order_cases(cases, ("*/no_sync/*",))
    assert [f"{c.strategy}/{c.feature}" for c in ordered] == [
        "NO_SHARD/no_sync",
        "FULL_SHARD/no_sync",
        "FULL_SHARD/plain",  # DEFAULT_FIRST
        "NO_SHARD/plain",
        "NO_SHARD/clip_grad_norm",
        "FULL_SHARD/clip_grad_norm",
    ]


@pytest.mark.slow
def test_self_test_catches_planted_bugs_and_prints_the_kill_table(tmp_path):
    out = tmp_path / "self_test.json"
    command = [sys.executable, "-m", "conformance", "--self-test", "--quick"]
    for name in CI_ENTRIES:
        command += ["--only", name]
    proc = subprocess.run(
        [*command, "--json", str(out), "--markdown", str(tmp_path / "table.md")],
        cwd=tmp_path,  # not the repository: the package comes from the install, as for a user
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "4 planted bugs: 4 caught, 0 missed" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "conformance-self-test" and doc["schema_version"] == 1
    assert doc["summary"]["caught"] == 4 and doc["summary"]["false kill"] == 0
    kills = [
        selftest.Kill(**{k: e[k] for k in selftest.Kill.__dataclass_fields__})
        for e in doc["entries"]
    ]
    assert_expected_inline(
        selftest.format_table(kills, times=False),
        """\
entry                                   class           ws  result  caught by (case: stage)                                            cases
--------------------------------------  --------------  --  ------  -----------------------------------------------------------------  -----
divide_post_factor_doubled              divide factors  2   caught  SHARD_GRAD_OP/fp32/plain/lm_untied: grads (step 1)                 1
reduce_scatter_sends_own_row            collectives     2   caught  FULL_SHARD/fp32/plain/mlp: grads (step 1)                          1
clip_norm_counts_replicated_per_rank    clip norms      2   caught  NO_SHARD/fp32/clip_grad_norm/lm_untied: grads (step 1)             1
sharded_state_dict_saves_padded_shards  resharding      2   caught  FULL_SHARD/fp32/sharded_checkpoint/lm_untied: state_dict (step 4)  1

4 planted bugs: 4 caught, 0 missed""",
    )
    table = (tmp_path / "table.md").read_text()
    assert "| `divide_post_factor_doubled`: the post-reduction divide factor" in table
    assert "`engine/collectives.py`" in table and "facebookresearch/fairscale#565" in table
