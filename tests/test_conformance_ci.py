"""The suite as a CI owner uses it: the pytest plugin, ``--model``, ``--compare-to``, ``--shard``.

Each runs as a user would, in a subprocess from a directory of the user's own (a tmp dir holding a
conftest.py, a test file, a module with a broken adapter or a model factory), never from the
repository root; the repository reaches it only as the installed package would (PYTHONPATH). The
comparison's rules are also checked on small hand-written reports, which need no ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance import baseline, cli

REPO = Path(__file__).resolve().parents[1]
MLP_CASES = ["--only", "*/FULL_SHARD/fp32/plain/mlp/*", "--only", "*/NO_SHARD/fp32/plain/mlp/*"]

# A broken fsdp_lite under fsdp_lite's own name, so that its case names match a clean baseline's.
BROKEN_ADAPTERS = '''
from conformance.adapters.lite import FsdpLiteAdapter


class HalfGrads(FsdpLiteAdapter):
    """Halves every gradient before the step: grads are right, params go wrong at step 1."""

    name = "half_grads"

    def step(self, model, optim):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
        super().step(model, optim)


class HalfGradsAsFsdpLite(HalfGrads):
    name = "fsdp_lite"
'''


def _run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, *command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _conformance(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return _run(["-m", "conformance", *args], cwd, timeout)


def _fill_user_tree(tree: Path) -> Path:
    (tree / "my_adapters.py").write_text(BROKEN_ADAPTERS)
    (tree / "test_mine.py").write_text("def test_my_own_test():\n    assert True\n")
    return tree


@pytest.fixture
def user_tree(tmp_path: Path) -> Path:
    return _fill_user_tree(tmp_path)


@pytest.fixture(scope="module")
def mlp_reports(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A user tree holding clean.json (fsdp_lite on MLP_CASES) and broken.json (HalfGrads under
    fsdp_lite's name, compared to clean.json): the baselines of --compare-to and of the plugin."""
    tree = _fill_user_tree(tmp_path_factory.mktemp("user"))
    clean = _conformance([*MLP_CASES, "--json", "clean.json"], tree)
    assert clean.returncode == 0, clean.stdout[-3000:]
    broken = _conformance(
        ["--impl", "my_adapters:HalfGradsAsFsdpLite", *MLP_CASES]
        + ["--compare-to", "clean.json", "--json", "broken.json", "--markdown", "broken.md"],
        tree,
    )
    return tree, broken


# ---- the pytest plugin -----------------------------------------------------------------------


@pytest.mark.slow
def test_pytest_plugin_gives_one_test_per_case_with_stages_in_the_failure(user_tree):
    (user_tree / "conftest.py").write_text('pytest_plugins = ["conformance.pytest_plugin"]\n')
    proc = _run(
        [
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--junitxml=out.xml",
            "--conformance-impl",
            "fsdp_lite",
            "--conformance-impl",
            "my_adapters:HalfGrads",
            "--conformance-only",
            "*/FULL_SHARD/fp32/plain/mlp/*",
        ],
        user_tree,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    cases = {
        tc.get("name"): tc for tc in ET.parse(user_tree / "out.xml").getroot().iter("testcase")
    }
    assert set(cases) == {
        "test_my_own_test",
        "fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2",
        "half_grads/FULL_SHARD/fp32/plain/mlp/ws2",
    }
    assert cases["test_my_own_test"].find("failure") is None
    assert cases["fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2"].find("failure") is None
    failure = cases["half_grads/FULL_SHARD/fp32/plain/mlp/ws2"].find("failure")
    assert failure.get("message").startswith(
        "Failed: half_grads/FULL_SHARD/fp32/plain/mlp/ws2: failed"
    )
    lines = failure.text.splitlines()
    # Step 1's gradients were right; its step went wrong, and everything after it.
    assert any(ln.startswith("  params vs ddp: max abs") and "step 1)" in ln for ln in lines)
    assert any(ln.startswith("  grads vs ddp: max abs") and "step 2)" in ln for ln in lines)
    seconds = {
        p.get("name"): float(p.get("value"))
        for p in cases["fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2"].iter("property")
    }
    assert seconds["conformance_seconds"] > 0  # the case's own wall time, from the suite


@pytest.mark.slow
def test_pytest_plugin_by_p_runs_only_what_k_selects_and_marks_baseline_failures_xfail(
    mlp_reports, capsys
):
    user_tree, _ = mlp_reports
    assert cli.main(["--list", "--impl", "fsdp_lite", *MLP_CASES]) == 0
    assert capsys.readouterr().out.split() == [
        "fsdp_lite/NO_SHARD/fp32/plain/mlp/ws2",
        "fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2",
    ]
    # A baseline in which the FULL_SHARD case failed (broken.json): a failure known there is an
    # xfail, and the NO_SHARD case (deselected by -k) must not run at all.
    proc = _run(
        [
            "-m",
            "pytest",
            "-p",
            "conformance.pytest_plugin",
            "-p",
            "no:cacheprovider",
            "-rA",
            "--conformance-impl",
            "my_adapters:HalfGradsAsFsdpLite",
            *(arg.replace("--only", "--conformance-only") for arg in MLP_CASES),
            "--conformance-compare-to",
            "broken.json",
            "--conformance-json",
            "now.json",
            "-k",
            "FULL_SHARD",
        ],
        user_tree,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "XFAIL conformance::fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2" in proc.stdout
    assert "2 deselected, 1 xfailed" in proc.stdout  # test_mine and the NO_SHARD case
    now = json.loads((user_tree / "now.json").read_text())
    assert [c["name"] for c in now["cases"]] == ["fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2"]
    assert now["comparison"]["regressions"] == []


# ---- --model -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_model_option_judges_the_documented_hf_llama_factory(tmp_path):
    pytest.importorskip("transformers")
    shutil.copy(REPO / "docs" / "examples" / "my_models.py", tmp_path)
    proc = _conformance(
        [
            "--model",
            "my_models:tiny_llama",
            "--quick",
            "--only",
            "*/FULL_SHARD/*",
            "--json",
            "o.json",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["model"] == "my_models:tiny_llama"
    assert [c["name"] for c in doc["cases"]] == [
        "fsdp_lite/FULL_SHARD/fp32/plain/tiny_llama/ws2",
        "fsdp_lite/FULL_SHARD/fp32/no_sync/tiny_llama/ws2",
        "fsdp_lite/FULL_SHARD/fp32/clip_grad_norm/tiny_llama/ws2",
        "fsdp_lite/FULL_SHARD/bf16/plain/tiny_llama/ws2",
    ]
    assert all(c["status"] == "passed" for c in doc["cases"])
    assert all(c["stages"]["grads"]["bitwise"] for c in doc["cases"][:2])


def test_model_factory_errors_name_the_factory(tmp_path, monkeypatch):
    from conformance.zoo import spec_from_factory

    (tmp_path / "bad_models.py").write_text(
        textwrap.dedent(
            """
            import torch

            def not_a_recipe():
                return torch.nn.Linear(2, 2)

            def stray_unit():
                model = torch.nn.Sequential(torch.nn.Linear(2, 2))
                return model, [torch.nn.Linear(2, 2)], lambda g: (torch.randn(1, 2), torch.randn(1, 2))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="bad_models:not_a_recipe returned Linear"):
        spec_from_factory("bad_models:not_a_recipe")
    with pytest.raises(ValueError, match="units must be submodules"):
        spec_from_factory("bad_models:stray_unit")
    with pytest.raises(ValueError, match="package.module:factory"):
        spec_from_factory("bad_models")


# ---- --shard -----------------------------------------------------------------------------------


def test_shards_split_the_matrix_into_disjoint_deterministic_parts(tmp_path, capsys):
    # Listing launches no rank: the command's main runs in this process (a subprocess per call
    # would only add an interpreter start); the last call goes through the command line.
    def listed(*args: str) -> str:
        assert cli.main(["--list", *args]) == 0
        return capsys.readouterr().out

    whole = listed("--quick").split()
    parts = [listed("--quick", "--shard", f"{i}/2") for i in (1, 2)]
    names = [[line for line in part.splitlines() if not line.startswith("note:")] for part in parts]
    assert names == [whole[0::2], whole[1::2]]  # round robin over the listed order
    assert parts[0].startswith(f"note: shard 1/2: {len(names[0])} cases of {len(whole)}")
    bad = _conformance(["--list", "--shard", "3/2"], tmp_path, timeout=60)
    assert bad.returncode == 2 and "1 <= i <= n" in bad.stderr


# ---- --compare-to ------------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_to_exits_2_on_regressions_and_3_on_improvements(mlp_reports):
    user_tree, broken = mlp_reports
    assert broken.returncode == baseline.EXIT_REGRESSED, broken.stdout[-3000:]
    doc = json.loads((user_tree / "broken.json").read_text())
    assert doc["exit_status"] == 2 and doc["comparison"]["exit_status"] == 2
    regressed = {(c["case"], c["stage"]) for c in doc["comparison"]["regressions"]}
    assert ("fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2", "params") in regressed
    assert "regressions, 0 improvements" in broken.stdout
    assert "| regression | stage | what |" in (user_tree / "broken.md").read_text()
    # Back to the clean implementation, against the broken run: every change is an improvement.
    fixed = _conformance([*MLP_CASES, "--compare-to", "broken.json"], user_tree)
    assert fixed.returncode == baseline.EXIT_IMPROVED, fixed.stdout[-3000:]
    assert "0 regressions" in fixed.stdout and "exit status 3 (improved)" in fixed.stdout


def _report(stages: dict[str, tuple[bool, float]], status: str = "passed", **case) -> dict:
    """A one-case report: per stage (passed, max_rel vs DDP and vs the single process)."""
    return {
        "schema_version": 2,
        "cases": [
            {
                "name": "impl/FULL_SHARD/fp32/plain/mlp/ws2",
                "status": status,
                "reason": case.get("reason"),
                "traceback": case.get("traceback"),
                "stages": {
                    stage: {
                        "passed": passed,
                        "vs_ddp": {"max_rel": rel},
                        "vs_single": {"max_rel": rel},
                    }
                    for stage, (passed, rel) in stages.items()
                },
            }
        ],
    }


@pytest.mark.parametrize(
    "before, after, expect",
    [
        ({"grads": (True, 1e-7)}, {"grads": (True, 5e-7)}, "same"),  # x5 < factor 10
        ({"grads": (True, 1e-7)}, {"grads": (True, 2e-6)}, "grads: distance to ddp"),
        ({"grads": (True, 0.0)}, {"grads": (True, 1e-9)}, "grads: distance to ddp (max_rel) grew"),
        ({"grads": (True, 0.0)}, {"grads": (False, 0.5)}, "grads: passed, fails now"),
        ({"grads": (False, 0.5)}, {"grads": (True, 0.0)}, "improved grads: failed, passes now"),
        ({"grads": (True, 1e-6)}, {"grads": (True, 0.0)}, "improved grads: distance to ddp"),
        ({"grads": (True, "Infinity")}, {"grads": (True, "Infinity")}, "same"),
    ],
)
def test_comparison_rules_stage_by_stage(before, after, expect):
    result = baseline.compare_reports(_report(before), _report(after), "base.json", factor=10)
    if expect == "same":
        assert not result.regressions and not result.improvements
        assert result.exit_status == baseline.EXIT_SAME
    elif expect.startswith("improved "):
        assert not result.regressions and result.exit_status == baseline.EXIT_IMPROVED
        stage, what = expect[len("improved ") :].split(": ", 1)
        assert result.improvements[0].stage == stage
        assert result.improvements[0].what.startswith(what)
    else:
        assert result.exit_status == baseline.EXIT_REGRESSED
        stage, what = expect.split(": ", 1)
        assert result.regressions[0].stage == stage
        assert result.regressions[0].what.startswith(what)


def test_comparison_of_whole_cases():
    passing = _report({"grads": (True, 0.0)})
    raising = _report({}, "failed", reason="rank 0 raised", traceback="Traceback ...")
    unsupported = _report({}, "unsupported", reason="not built")
    assert (
        baseline.compare_reports(passing, raising, "b")
        .regressions[0]
        .what.startswith("passed, raises now")
    )
    assert baseline.compare_reports(passing, unsupported, "b").exit_status == 2
    assert baseline.compare_reports(raising, passing, "b").improvements[0].what == (
        "failed, passes now"
    )
    # A failure the baseline had too is no regression; a new failing case is one.
    assert baseline.compare_reports(raising, raising, "b").exit_status == 0
    empty = {"schema_version": 2, "cases": []}
    result = baseline.compare_reports(empty, raising, "b")
    assert result.new_cases == ["impl/FULL_SHARD/fp32/plain/mlp/ws2"] and result.regressions
    assert baseline.compare_reports(passing, empty, "b").missing_cases == result.new_cases


def test_a_baseline_of_an_unknown_schema_is_refused(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"schema_version": 99, "cases": []}))
    with pytest.raises(ValueError, match="schema_version 99"):
        baseline.load_report(str(path))
