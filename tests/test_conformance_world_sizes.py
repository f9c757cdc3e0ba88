"""``python -m conformance --world-sizes``: the same cases at several world sizes, compared.

The command line runs as a user would (a subprocess, one launch per world size): fsdp_lite's
canonical mode must show 0 ulps at every stage, the plain implementations and DDP are reported
as measured, and an adapter that claims world-size invariance without having it fails the run.
The comparison itself (ulps, statuses, the exit status) is checked on made-up recordings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conformance.adapters.lite import FsdpLiteAdapter, FsdpLiteCanonicalAdapter
from conformance.cli import parse_args
from conformance.world_size import FEATURES, compare_runs, exit_status, format_table, ulps

REPO = Path(__file__).resolve().parents[1]
# The command's plumbing at two strategies (HYBRID_SHARD: a 2-D mesh at 4 ranks); every strategy
# of both fronts is bitwise across world sizes in tests/test_canonical.py.
CANONICAL_STRATEGIES = {"FULL_SHARD", "HYBRID_SHARD"}
assert set(FEATURES) == {"plain", "clip_grad_norm", "frozen_in_unit"}


class FalselyInvariantAdapter(FsdpLiteAdapter):
    """fsdp_lite's default mode claiming the same bits at every world size: it must fail."""

    name = "false_invariant"
    world_size_invariant = True


class LeftFoldCanonicalAdapter(FsdpLiteCanonicalAdapter):
    """A planted bug in the canonical mode: the N ranks' rows of a micro-step summed left to
    right, ((a + b) + c) + d, not in the tree, (a + b) + (c + d): the same at 1 and 2 ranks."""

    name = "bug_left_fold_canonical"

    @contextlib.contextmanager
    def case_context(self, case):
        from fsdp_lite.engine import canonical

        original = canonical.tree_sum
        canonical.tree_sum = lambda leaves: functools.reduce(torch.add, leaves)
        try:
            yield
        finally:
            canonical.tree_sum = original


@pytest.mark.slow
def test_cli_canonical_is_bitwise_across_world_sizes_and_the_others_are_measured(tmp_path):
    out = tmp_path / "ws.json"
    false_claim = "tests.test_conformance_world_sizes:FalselyInvariantAdapter"
    left_fold = "tests.test_conformance_world_sizes:LeftFoldCanonicalAdapter"
    args = [
        "--world-sizes",
        "1,2,4",
        "--steps",
        "2",
        "--impl",
        "fsdp_lite_canonical",
        "fsdp_lite",
        "torch_fsdp2",
        false_claim,
        left_fold,
        "--only",
        "fsdp_lite_canonical/FULL_SHARD/*",
        "--only",
        "fsdp_lite_canonical/HYBRID_SHARD/*",
        "--only",
        "*/FULL_SHARD/fp32/plain/*",
        "--only",
        "ddp/*/fp32/plain/*",
        "--json",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))
    env.pop("OMP_NUM_THREADS", None)  # the command fixes it for every launch
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert out.exists(), log
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["cases"]}
    # Only the false claim and the planted bug fail, so the command exits 1.
    assert proc.returncode == 1 == doc["exit_status"], log
    failed = [n for n, r in rows.items() if r["status"] not in ("passed", "measured")]
    assert sorted(failed) == [
        "bug_left_fold_canonical/FULL_SHARD/fp32/plain/lm_untied",
        "false_invariant/FULL_SHARD/fp32/plain/lm_untied",
    ], log
    # The bug shows where it sums more than 2 rows: at 4 ranks.
    bug = rows["bug_left_fold_canonical/FULL_SHARD/fp32/plain/lm_untied"]["world_sizes"]
    assert bug["2"]["grads"]["bitwise"] and not bug["4"]["grads"]["bitwise"], bug
    assert "FAILED false_invariant/FULL_SHARD/fp32/plain/lm_untied" in proc.stdout

    canonical = [r for r in rows.values() if r["impl"] == "fsdp_lite_canonical"]
    assert {r["strategy"] for r in canonical} == CANONICAL_STRATEGIES
    assert {r["precision"] for r in canonical} == {"fp32", "bf16r32"}
    assert {r["feature"] for r in canonical} == set(FEATURES)
    for r in canonical:
        assert r["status"] == "passed" and r["invariant"], r
        assert r["base_world_size"] == 1 and set(r["world_sizes"]) == {"2", "4"}, r
        for per_stage in r["world_sizes"].values():
            assert set(per_stage) == {"loss", "grads", "params", "optim_state"}
            for stage in per_stage.values():
                assert stage["bitwise"] and stage["max_ulps"] == 0 == stage["max_abs"], r
    for impl in ("ddp", "fsdp_lite", "torch_fsdp2"):
        strategy = "-" if impl == "ddp" else "FULL_SHARD"
        r = rows[f"{impl}/{strategy}/fp32/plain/lm_untied"]
        assert r["status"] == "measured" and not r["invariant"], r
        assert set(r["world_sizes"]) == {"2", "4"}, r
        for per_stage in r["world_sizes"].values():
            for stage in per_stage.values():
                assert isinstance(stage["max_ulps"], (int, float)), r
    assert len(rows) == 2 * 2 * len(FEATURES) + 5
    assert doc["config"]["world_sizes"] == [1, 2, 4] and doc["config"]["virtual_batches"] == 4
    assert set(doc["config"]["threads"].values()) == {1}
    assert re.search(r"\nfsdp_lite_canonical +HYBRID_SHARD +bf16r32 +plain +1->4 ", proc.stdout)


def test_ulps_count_representable_values_between():
    one = torch.tensor([1.0])
    assert ulps(torch.nextafter(one, torch.tensor([2.0])), one) == (1.0, 2.0**-23)
    assert ulps(torch.tensor([-1e-45]), torch.tensor([1e-45]))[0] == 2.0  # across zero
    special = torch.tensor([0.0, -0.0, math.inf, math.nan])
    assert ulps(special, torch.tensor([-0.0, 0.0, math.inf, math.nan])) == (0.0, 0.0)
    assert ulps(torch.tensor([1.0]), torch.tensor([math.nan]))[0] == math.inf
    bf16 = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert ulps(bf16 + torch.tensor([0.0, 2.0**-6], dtype=torch.bfloat16), bf16)[0] == 1.0
    assert ulps(one.double(), one)[0] == math.inf  # another dtype


def _run(params: dict[str, torch.Tensor]) -> dict:
    step = {"loss": {"loss": torch.tensor(1.0)}, "grads": {}, "params": params, "optim_state": {}}
    return {"status": "ran", "steps": [step, step]}


def test_comparison_fails_only_an_invariant_case_that_differs():
    a, b = {"w": torch.ones(3)}, {"w": torch.tensor([1.0, 1.0, 1.0 + 2.0**-22])}
    runs = {
        1: {"cases": {"inv/X/fp32/plain/m": _run(a), "plain/X/fp32/plain/m": _run(a)}},
        2: {"cases": {"inv/X/fp32/plain/m": _run(a), "plain/X/fp32/plain/m": _run(b)}},
        4: {
            "cases": {
                "inv/X/fp32/plain/m": _run(a),
                "plain/X/fp32/plain/m": {"status": "unsupported", "reason": "no"},
            }
        },
    }
    rows = compare_runs(runs, lambda impl: impl == "inv")
    assert [r["status"] for r in rows] == ["passed", "measured"]
    assert exit_status(rows) == 0
    assert rows[1]["world_sizes"]["2"]["params"]["max_ulps"] == 2.0
    assert rows[1]["world_sizes"]["2"]["params"]["first_step"] == 1
    assert rows[1]["unsupported"] == {"4": "no"}
    runs[4]["cases"]["inv/X/fp32/plain/m"] = _run(b)
    rows = compare_runs(runs, lambda impl: impl == "inv")
    assert rows[0]["status"] == "failed" and exit_status(rows) == 1
    assert "1->4" in format_table(rows) and "| inv |" in format_table(rows, markdown=True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-sizes", "2"], "two or more sizes"),
        (["--world-sizes", "1,2", "--virtual-batches", "6"], "power of two"),
        (["--virtual-batches", "4"], "needs --world-sizes"),
        (["--world-sizes", "1,2", "--self-test"], "does not take --self-test"),
    ],
)
def test_world_size_options_are_checked_before_any_launch(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_canonical_adapters_are_unsupported_in_the_ordinary_matrix():
    from conformance.adapters import get_adapter
    from conformance.matrix import Case

    adapter = get_adapter("fsdp_lite_fsdp2_canonical")
    case = Case(adapter.name, "FULL_SHARD", "fp32", "plain", "lm_untied", 2)
    assert "--world-sizes" in adapter.unsupported_reason(case)
    adapter.virtual_batches = 4
    assert adapter.unsupported_reason(case) is None
    assert "multiple" in adapter.unsupported_reason(dataclasses.replace(case, world_size=3))
