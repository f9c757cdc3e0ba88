"""``python -m conformance --coverage`` (issue 38 item 1): coverage of the judged implementation.

One run of four cases, as a user runs it, measures fsdp_lite in both ranks and writes the per-file
table; another kills a rank in its third case and checks that the dead launch's data and the fresh
ranks' data are both combined; a process measuring and stopped by SIGTERM (as torchrun stops the
other ranks) keeps its data. The rest checks the options and the table without starting ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import report
from conformance.cli import coverage_packages, parse_args
from tests.test_conformance_crash import _conformance  # ranks import the test's adapter

REPO = Path(__file__).resolve().parents[1]
# 4 cases: lm_untied, mlp, nested, unused (in that order)
SELECTION = ["--quick", "--only", "FULL_SHARD/fp32/plain"]

# Written into the test's directory and imported by the ranks from there (--impl module:Class).
DYING_ADAPTER = """
import contextlib
import os
import signal

import torch.distributed as dist

from conformance.adapters.lite import FsdpLiteAdapter


class DyingAdapter(FsdpLiteAdapter):
    name = "dying"

    @contextlib.contextmanager
    def case_context(self, case):
        self.case = case
        yield

    def full_params(self, model):
        if self.case.model == "nested" and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().full_params(model)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_table_covers_fsdp_lite_as_measured_in_both_ranks(tmp_path):
    proc = _conformance([*SELECTION, "--coverage", "cov"], tmp_path, timeout=240)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    doc = json.loads((tmp_path / "cov" / "coverage.json").read_text())
    table = (tmp_path / "cov" / "coverage.md").read_text()
    assert (tmp_path / "cov" / ".coverage").is_file()
    assert table in proc.stdout
    assert doc["packages"] == ["fsdp_lite"]
    assert doc["ranks"] == [0, 1] and doc["data_files"] == 2, doc["contexts"]
    assert doc["contexts"] == ["launch1/rank0", "launch1/rank1"]
    engine = {name: c for name, c in doc["files"].items() if name.startswith("fsdp_lite/engine/")}
    assert "fsdp_lite/engine/unit.py" in engine and "fsdp_lite/engine/param.py" in engine
    for name, c in doc["files"].items():
        assert 0 <= c["line_percent"] <= 100, name
        assert c["branch_percent"] is None or 0 <= c["branch_percent"] <= 100, name
        assert c["covered_lines"] + len(c["missing_lines"]) == c["statements"], name
        assert f"| {name} | {c['covered_lines']}/{c['statements']} |" in table
    unit = doc["files"]["fsdp_lite/engine/unit.py"]
    assert unit["line_percent"] > 0 and unit["branch_percent"] > 0
    # Never imported by a case: in the table at 0%, since coverage.py lists the whole package.
    assert doc["files"]["fsdp_lite/integrations/lightning.py"]["covered_lines"] == 0
    totals = doc["totals"]
    assert 0 < totals["line_percent"] < 100 and 0 < totals["branch_percent"] < 100
    assert totals["statements"] == sum(c["statements"] for c in doc["files"].values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_rank_keeps_what_it_measured_and_fresh_ranks_add_theirs(tmp_path):
    (tmp_path / "dying_adapter.py").write_text(DYING_ADAPTER)
    args = ["--impl", "dying_adapter:DyingAdapter", *SELECTION[1:], "--quick"]
    args += ["--coverage", "cov", "--coverage-source", "fsdp_lite", "--json", "r.json"]
    proc = _conformance(args, tmp_path, timeout=240)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 4, log  # a case crashed
    statuses = [c["status"] for c in json.loads((tmp_path / "r.json").read_text())["cases"]]
    assert statuses == ["passed", "passed", "crashed", "passed"], log
    doc = json.loads((tmp_path / "cov" / "coverage.json").read_text())
    # Both ranks of launch 1 saved at the end of its first two cases, before rank 1 died natively
    # (SIGSEGV) in the third; launch 2 ran the last case.
    assert doc["launches"] == 2 and doc["data_files"] == 4, doc
    assert doc["contexts"] == ["launch1/rank0", "launch1/rank1", "launch2/rank0", "launch2/rank1"]
    assert doc["files"]["fsdp_lite/engine/unit.py"]["line_percent"] > 0


@pytest.mark.timeout(120)
def test_a_rank_stopped_by_sigterm_saves_what_it_measured(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one dies: their open case is kept."""
    script = (
        "from conformance.launcher import start_coverage\n"
        f"start_coverage({str(tmp_path / 'launch3')!r}, ['fsdp_lite'])\n"
        "import fsdp_lite.names, time\n"
        "print('measuring', flush=True)\n"
        "time.sleep(100)\n"
    )
    env = dict(os.environ, RANK="1", PYTHONPATH=str(REPO))
    with subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout.readline() == "measuring\n"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == -signal.SIGTERM  # it still dies of the signal
        finally:
            proc.kill()
    import coverage

    (data_file,) = (tmp_path / "launch3" / "coverage").glob(".coverage.*")
    data = coverage.CoverageData(str(data_file))
    data.read()
    assert data.measured_contexts() == {"launch3/rank1"}
    names = [f for f in data.measured_files() if f.endswith("fsdp_lite/names.py")]
    assert names and data.lines(names[0])


def test_the_packages_measured_follow_the_implementations():
    assert coverage_packages(parse_args(["--coverage"])) == ["fsdp_lite"]
    args = parse_args(["--impl", "fsdp_lite", "fsdp_lite_fsdp2", "torch_fsdp2", "--coverage", "d"])
    assert args.coverage == "d"
    assert coverage_packages(args) == ["fsdp_lite", "conformance.adapters.fsdp2"]
    args = parse_args(["--impl", "my.adapters:Mine", "--coverage", "--coverage-source", "a,b.c"])
    assert args.coverage == "conformance-coverage"
    assert coverage_packages(args) == ["a", "b.c"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--coverage", "--self-test"], "--coverage does not take --self-test"),
        (["--coverage", "--world-sizes", "1,2"], "--coverage does not take --world-sizes"),
        (["--coverage-source", "fsdp_lite"], "--coverage-source needs --coverage"),
    ],
)
def test_the_coverage_options_are_checked_before_any_launch(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_under_torchrun_coverage_is_refused(monkeypatch, capsys):
    from conformance.cli import main

    monkeypatch.setenv("RANK", "0")
    assert main(["--coverage", "d"]) == 1
    assert "--coverage needs the ranks it launches" in capsys.readouterr().out


def test_the_markdown_table():
    counts = {"covered_lines": 3, "statements": 4, "line_percent": 75.0}
    doc = {
        "command": "python -m conformance --coverage",
        "packages": ["fsdp_lite"],
        "coverage_version": "7.18.0",
        "launches": 1,
        "data_files": 2,
        "ranks": [0, 1],
        "files": {
            "fsdp_lite/a.py": {
                **counts,
                "covered_branches": 1,
                "branches": 2,
                "branch_percent": 50.0,
            },
            "fsdp_lite/b.py": {
                **counts,
                "covered_branches": 0,
                "branches": 0,
                "branch_percent": None,
            },
        },
        "totals": {
            "covered_lines": 6,
            "statements": 8,
            "line_percent": 75.0,
            "covered_branches": 1,
            "branches": 2,
            "branch_percent": 50.0,
        },
    }
    assert report.coverage_markdown(doc).splitlines() == [
        "## Coverage of fsdp_lite",
        "",
        "`python -m conformance --coverage`: 2 data files from 1 launch, ranks 0, 1; "
        "coverage.py 7.18.0.",
        "",
        "| file | lines | line % | branches | branch % |",
        "|---|---:|---:|---:|---:|",
        "| fsdp_lite/a.py | 3/4 | 75.0 | 1/2 | 50.0 |",
        "| fsdp_lite/b.py | 3/4 | 75.0 | 0/0 | - |",
        "| **total** | 6/8 | 75.0 | 1/2 | 50.0 |",
    ]
