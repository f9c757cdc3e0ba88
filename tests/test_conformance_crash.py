"""No result lost (issue 37 part 1): a rank that dies ends only its case.

One command line run, as a user runs it, judges an adapter whose cases kill their rank natively
in the middle of the run: a SIGSEGV on rank 1 every time (a deterministic crash), glibc aborting on
a double free on rank 0 the first time only (flaky), a sleep on rank 1 the first time only (a hang
the launcher ends), and a ``BaseException`` that is not an ``Exception`` (as DCP's
``CheckpointException``), which is that case's error and no crash. Every other case runs and is
reported; each crashed case is listed with its rank, signal and native message in the JSON, JUnit
and Markdown reports and in the events file written case by case; the exit status is 4. The same
for ``--world-sizes`` (an ``os.abort()`` at world size 2). The rest checks the pieces without
starting ranks: reports read back from the events equal those made in memory, the comparison
with a baseline, the self-test's record of a death, and what the launcher reads in a stderr file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from expecttest import assert_expected_inline

from conformance import baseline, report, selftest
from conformance.catalog import Bug, Patch
from conformance.launcher import Death, _current_thread, _native, _tail
from conformance.matrix import Case
from conformance.results import CaseResult, case_from_json
from tests.test_conformance_reports import _results

REPO = Path(__file__).resolve().parents[1]

# Written into the test's directory and imported by the ranks from there (--impl module:Class).
CRASHING_ADAPTERS = '''
"""fsdp_lite's adapter with a death planted in some cases, at step 2 after its gradients."""

import contextlib
import ctypes
import os
import signal
import time

import torch.distributed as dist

from conformance.adapters.lite import FsdpLiteAdapter


class Interrupted(BaseException):
    """Not an Exception, as DCP's CheckpointException."""


def _double_free():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    block = ctypes.c_void_p(libc.malloc(64))
    libc.free(block)
    libc.free(block)  # glibc: "free(): double free detected in tcache 2", then SIGABRT


def _first_time(marker):
    """True the first time in this directory: a retry in fresh ranks finds the marker."""
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


class CrashingAdapter(FsdpLiteAdapter):
    name = "crashing"

    @contextlib.contextmanager
    def case_context(self, case):
        self.case, self.reads = case, 0
        yield

    def full_params(self, model):
        self.reads += 1
        rank, model_name = dist.get_rank(), self.case.model
        if self.reads == 2:
            if model_name == "frozen" and rank == 1:
                os.kill(os.getpid(), signal.SIGSEGV)
            if model_name == "nested" and rank == 0 and _first_time("nested.crashed"):
                _double_free()
            if model_name == "unused":
                raise Interrupted("planted BaseException on every rank")
        params = super().full_params(model)  # its all-gathers done: rank 0 goes on to wait
        if self.reads == 2 and model_name == "bufnet" and rank == 1:
            if _first_time("bufnet.hung"):
                time.sleep(3600)
        return params


class AbortingAdapter(CrashingAdapter):
    name = "aborting"

    def full_params(self, model):
        case = self.case
        if case.world_size == 2 and case.feature == "frozen_in_unit" and dist.get_rank() == 1:
            os.abort()
        return FsdpLiteAdapter.full_params(self, model)
'''

# In the matrix's order; the deterministic crash last, since its retry is a launch of its own.
CASES = [
    "crashing/FULL_SHARD/fp32/plain/unused/ws2",  # BaseException on every rank: failed
    "crashing/FULL_SHARD/bf16/plain/bufnet/ws2",  # rank 1 hangs, the first time
    "crashing/FULL_SHARD/fp32/plain/mlp/ws2",  # passes
    "crashing/FULL_SHARD/fp32/plain/nested/ws2",  # double free on rank 0, the first time
    "crashing/FULL_SHARD/fp32/plain/frozen/ws2",  # SIGSEGV on rank 1, every time
]
UNUSED, BUFNET, MLP, NESTED, FROZEN = CASES


def _conformance(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(cwd), str(REPO)]))
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crashes")
    (tmp / "crashing_adapters.py").write_text(CRASHING_ADAPTERS)
    args = ["--impl", "crashing_adapters:CrashingAdapter", "--retry-crashed", "1"]
    for name in CASES:
        args += ["--case", name]
    # --timeout 5: the hang is ended after 10 s without progress (2 x the collective timeout)
    args += ["--timeout", "5", "--json", "r.json", "--junit", "r.xml", "--markdown", "r.md"]
    proc = _conformance([*args, "--jsonl", "r.jsonl"], tmp, timeout=400)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert (tmp / "r.json").exists(), log
    doc = json.loads((tmp / "r.json").read_text())
    return proc, doc, tmp, log


def _by_name(doc) -> dict[str, dict]:
    return {c["name"]: c for c in doc["cases"]}


@pytest.mark.slow
def test_every_other_case_runs_and_the_exit_status_says_crashed(crashed_run):
    proc, doc, _, log = crashed_run
    assert proc.returncode == report.EXIT_CRASHED == doc["exit_status"] == 4, log
    cases = _by_name(doc)
    assert list(cases) == CASES, log
    assert {n: c["status"] for n, c in cases.items()} == {
        UNUSED: "failed",
        BUFNET: "crashed",
        MLP: "passed",
        NESTED: "crashed",
        FROZEN: "crashed",
    }, log
    assert doc["summary"] == {"passed": 1, "failed": 1, "unsupported": 0, "crashed": 3}
    assert doc["crashes_outside_cases"] == []
    # unused and bufnet's hang; bufnet's retry, mlp and nested's abort; nested's retry and
    # frozen's SIGSEGV; frozen's retry
    assert doc["launches"] == 4, log
    assert "5 cases: 1 passed, 1 failed, 0 unsupported, 3 crashed" in proc.stdout


@pytest.mark.slow
def test_a_native_death_is_recorded_with_its_rank_signal_and_native_message(crashed_run):
    _, doc, _, log = crashed_run
    segv, abort = _by_name(doc)[FROZEN], _by_name(doc)[NESTED]
    crash = segv["crash"]
    assert (crash["kind"], crash["rank"], crash["signal"], crash["signal_number"]) == (
        "signal",
        1,
        "SIGSEGV",
        11,
    ), log
    assert crash["after"] == "step 2, comparing grads"  # the last stage every rank passed
    assert crash["native"] == "Fatal Python error: Segmentation fault"
    assert "in full_params" in crash["stderr_tail"]  # faulthandler's stack of the dead rank
    assert crash["verdict"] == "deterministic" and crash["crashed_runs"] == "2 of 2"
    assert segv["reason"] == (
        "rank 1 died: Signal 11 (SIGSEGV), after 'step 2, comparing grads': Fatal Python error: "
        "Segmentation fault; deterministic: crashed in 2 of 2 runs"
    )
    crash = abort["crash"]
    assert (crash["rank"], crash["signal"]) == (0, "SIGABRT"), log
    assert crash["native"] == "free(): double free detected in tcache 2"
    assert crash["stderr_tail"].startswith("free(): double free detected in tcache 2")
    assert crash["verdict"] == "flaky" and crash["crashed_runs"] == "1 of 2"
    assert crash["retry_result"] == {"status": "passed", "reason": None}


@pytest.mark.slow
def test_a_hang_is_ended_and_names_the_rank_that_hung(crashed_run):
    _, doc, _, log = crashed_run
    crash = _by_name(doc)[BUFNET]["crash"]
    assert (crash["kind"], crash["rank"], crash["after"]) == (
        "hang",
        1,
        "step 2, comparing grads",
    ), log
    assert crash["native"].endswith("in full_params"), crash["native"]  # where it slept
    assert 10 <= crash["seconds"] < 20
    assert crash["verdict"] == "flaky"


@pytest.mark.slow
def test_a_base_exception_is_the_cases_error_not_the_runs_end(crashed_run):
    _, doc, _, _ = crashed_run
    case = _by_name(doc)[UNUSED]
    assert case["status"] == "failed" and case["crash"] is None
    assert (
        case["reason"]
        == "rank 0 raised in step 2: Interrupted: planted BaseException on every rank"
    )
    assert "crashing_adapters.Interrupted" in case["traceback"]


@pytest.mark.slow
def test_junit_and_markdown_list_the_crashes_as_errors(crashed_run):
    _, _, tmp, _ = crashed_run
    suite = ET.parse(tmp / "r.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("5", "0", "4")
    errors = {
        c.get("name"): c.find("error")
        for c in suite.findall("testcase")
        if c.find("error") is not None
    }
    assert errors["FULL_SHARD/fp32/plain/unused/ws2"].get("type") == "exception"
    segv = errors["FULL_SHARD/fp32/plain/frozen/ws2"]
    assert segv.get("type") == "crashed"
    assert segv.get("message").startswith("rank 1 died: Signal 11 (SIGSEGV)")
    assert "Fatal Python error: Segmentation fault" in segv.text
    assert (
        "free(): double free detected in tcache 2"
        in errors["FULL_SHARD/fp32/plain/nested/ws2"].text
    )
    markdown = (tmp / "r.md").read_text()
    assert "5 cases: 1 passed, 1 failed, 0 unsupported, 3 crashed." in markdown
    assert (
        "| crashing/FULL_SHARD/fp32/plain/nested/ws2 | 0 | SIGABRT (6) | step 2, comparing grads | "
        "`free(): double free detected in tcache 2` | flaky: crashed in 1 of 2 runs |"
    ) in markdown
    assert (
        "| crashing/FULL_SHARD/bf16/plain/bufnet/ws2 | 1 | hung 10 s | step 2, comparing grads |"
    ) in markdown
    assert "| 💥 crashed |" in markdown


@pytest.mark.slow
def test_each_result_is_on_disk_as_soon_as_it_is_known(crashed_run):
    _, doc, tmp, _ = crashed_run
    events = [json.loads(line) for line in (tmp / "r.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e.get("index")) for e in events if e["event"] != "run"]
    # the SIGSEGV's first line is there before its retry started, the verdict after the retry
    first_crash = kinds.index(("crashed", 4))
    assert kinds.index(("start", 4)) < first_crash
    assert [k for k in kinds[first_crash:] if k[0] == "start"] == [("start", 4)]  # the retry
    assert kinds.count(("crashed", 4)) == 2 and kinds[-1] == ("crashed", 4)
    final = {}
    for e in events:
        if e["event"] in ("case", "crashed"):
            final[e["index"]] = "crashed" if e["event"] == "crashed" else e["status"]
    assert [final[i] for i in range(5)] == [c["status"] for c in doc["cases"]]


# ---- --world-sizes -------------------------------------------------------------------------------


@pytest.mark.slow
def test_world_sizes_keep_what_ran_before_a_crash_and_report_it(tmp_path):
    # The crash in the last case: one launch per world size (fresh ranks after a crash are the
    # run above's business), and the case before it is compared across world sizes.
    (tmp_path / "crashing_adapters.py").write_text(CRASHING_ADAPTERS)
    args = ["--world-sizes", "1,2", "--steps", "2", "--impl", "crashing_adapters:AbortingAdapter"]
    args += ["--only", "aborting/FULL_SHARD/fp32/plain/*"]
    args += ["--only", "aborting/FULL_SHARD/fp32/frozen_in_unit/*", "--json", "ws.json"]
    proc = _conformance(args, tmp_path, timeout=300)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert (tmp_path / "ws.json").exists(), log
    doc = json.loads((tmp_path / "ws.json").read_text())
    assert proc.returncode == 4 == doc["exit_status"], log
    assert doc["schema"] == "conformance-world-sizes/2"
    rows = {r["name"]: r for r in doc["cases"]}
    crashed = rows["aborting/FULL_SHARD/fp32/frozen_in_unit/lm_untied"]
    assert crashed["status"] == "crashed", log
    crash = crashed["crashes"]["2"]
    assert (crash["rank"], crash["signal"], crash["native"]) == (
        1,
        "SIGABRT",
        "Fatal Python error: Aborted",
    ), log
    plain = rows["aborting/FULL_SHARD/fp32/plain/lm_untied"]
    assert plain["status"] == "measured" and set(plain["world_sizes"]) == {"2"}, plain
    assert (
        "CRASHED aborting/FULL_SHARD/fp32/frozen_in_unit/lm_untied at world size 2: rank 1 died: "
        "Signal 6 (SIGABRT)"
    ) in proc.stdout, log


# ---- the pieces, without ranks ------------------------------------------------------------------


def _crashed(case: Case, **crash) -> CaseResult:
    record = {
        "kind": "signal",
        "rank": 1,
        "signal": "SIGSEGV",
        "signal_number": 11,
        "exit_code": None,
        "after": "step 1, comparing loss",
        "native": "Fatal Python error: Segmentation fault",
        "stderr_tail": "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most "
        'recent call first):\n  File "x.py", line 3 in f',
        "summary": "rank 1 died: Signal 11 (SIGSEGV), after 'step 1, comparing loss': Fatal "
        "Python error: Segmentation fault",
        "case_seconds": 0.25,
        **crash,
    }
    return CaseResult(case, "crashed", record["summary"], seconds=0.25, crash=record)


def test_reports_read_back_from_the_events_are_the_reports_made_in_memory():
    results = [*_results(), _crashed(Case("impl", "FULL_SHARD", "bf16", "plain", "mlp", 2))]
    again = [case_from_json(json.loads(json.dumps(report.case_json(r)))) for r in results]
    assert report.to_json(again, {}) == report.to_json(results, {})
    assert report.to_junit(again) == report.to_junit(results)
    assert report.to_markdown(again) == report.to_markdown(results)
    assert report.format_summary(again) == report.format_summary(results)


def test_exit_statuses():
    case = Case("impl", "FULL_SHARD", "fp32", "plain", "mlp", 2)
    passed = CaseResult(case, "passed")
    failed = CaseResult(case, "failed", "x")
    unsupported = CaseResult(case, "unsupported", "x")
    assert report.exit_status([passed, unsupported]) == report.EXIT_PASSED == 0
    assert report.exit_status([passed, failed]) == report.EXIT_FAILED == 1
    assert report.exit_status([failed, _crashed(case)]) == report.EXIT_CRASHED == 4
    assert report.exit_status([passed], outside=[{"summary": "a rank died"}]) == 4


def test_the_terminal_and_markdown_show_a_crash():
    results = [_crashed(Case("impl", "FULL_SHARD", "fp32", "plain", "mlp", 2))]
    summary = report.format_summary(results)
    assert_expected_inline(
        summary[summary.index("\n\n") :],
        """\


1 cases: 0 passed, 0 failed, 0 unsupported, 1 crashed
vs DDP / vs single: 'bitwise', or the largest absolute difference over all stages and steps.

Crashed (a rank died; the cases after it ran in fresh ranks):
  impl/FULL_SHARD/fp32/plain/mlp/ws2: rank 1 died: Signal 11 (SIGSEGV), after 'step 1, comparing loss': Fatal Python error: Segmentation fault
    its stderr (the first lines; 3 in --json):
      Fatal Python error: Segmentation fault
      Current thread 0x1 (most recent call first):
        File "x.py", line 3 in f""",
    )
    markdown = report.to_markdown(results)
    assert_expected_inline(
        markdown[markdown.index("### Crashed") :],
        """\
### Crashed: a rank died

| case | rank | signal or exit code | after stage | native message | retries |
|---|---|---|---|---|---|
| impl/FULL_SHARD/fp32/plain/mlp/ws2 | 1 | SIGSEGV (11) | step 1, comparing loss | `Fatal Python error: Segmentation fault` | - |
""",
    )


def test_a_crash_is_a_regression_against_a_baseline_that_ran_the_case():
    case = Case("impl", "FULL_SHARD", "fp32", "plain", "mlp", 2)
    passed = json.loads(report.to_json([CaseResult(case, "passed")], {}))
    crashed = json.loads(report.to_json([_crashed(case)], {}))
    comparison = baseline.compare_reports(passed, crashed, "b")
    assert [str(c) for c in comparison.regressions] == [
        "impl/FULL_SHARD/fp32/plain/mlp/ws2: passed, crashes now: rank 1 died: Signal 11 (SIGSEGV), "
        "after 'step 1, comparing loss': Fatal Python error: Segmentation fault"
    ]
    assert baseline.compare_reports(crashed, passed, "b").exit_status == baseline.EXIT_IMPROVED
    assert baseline.compare_reports(crashed, crashed, "b").exit_status == baseline.EXIT_SAME
    new = baseline.compare_reports({"cases": []}, crashed, "b")
    assert new.regressions[0].what.startswith("new case, crashes: rank 1 died")


def test_the_self_test_records_how_a_rank_died_and_in_which_case(tmp_path):
    bug = Bug("kills_a_rank", "native", "a planted native death", "", (Patch("x.py", "a", "b"),))
    death = Death("signal", 1, signal="SIGABRT", signal_number=6, native="free(): invalid pointer")

    def launch(nproc, argv):
        plan = json.loads(Path(argv[argv.index("--self-test-plan") + 1]).read_text())
        lines = [
            {"event": "start", "name": "kills_a_rank"},
            {
                "event": "case_start",
                "name": "kills_a_rank",
                "case": "fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2",
            },
        ]
        Path(plan["results"]).write_text("".join(json.dumps(e) + "\n" for e in lines))
        return death

    args = type("Args", (), {"quick": True, "steps": 3, "timeout": 20.0})()
    kills = selftest._run_group(args, launch, tmp_path, [bug], {bug.name: "root"}, "clean", 2)
    kill = kills["kills_a_rank"]
    assert (kill.status, kill.case) == ("caught", None)  # the clean copy does not rerun it
    assert kill.stage == (
        "a rank died in FULL_SHARD/fp32/plain/mlp: rank 1 died: Signal 6 (SIGABRT): free(): "
        "invalid pointer"
    )


def test_the_launcher_reads_the_native_message_and_the_stack_of_the_thread_that_stopped():
    text = (
        "[rank1]: a warning from earlier\n"
        "free(): double free detected in tcache 2\n"
        "Fatal Python error: Aborted\n\n"
        "Thread 0x2 (most recent call first):\n"
        '  File "threading.py", line 1 in _bootstrap\n\n'
        "Current thread 0x1 (most recent call first):\n"
        '  File "adapters.py", line 9 in full_params\n'
        '  File "conformance/runner.py", line 5 in run_cases\n\n'
        "Extension modules: torch._C (total: 1)\n"
    )
    assert _native(text) == "free(): double free detected in tcache 2"
    assert _native("Fatal Python error: Segmentation fault\n\nmore\n") == (
        "Fatal Python error: Segmentation fault"
    )
    assert _native("Traceback ...\nValueError: no adapter\n") == "ValueError: no adapter"
    assert _tail(text, _native(text)).splitlines()[0] == "free(): double free detected in tcache 2"
    assert _current_thread(text) == [
        "Current thread 0x1 (most recent call first):",
        'File "adapters.py", line 9 in full_params',
        'File "conformance/runner.py", line 5 in run_cases',
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--retry-crashed", "-1"], "--retry-crashed takes 0 or more, not -1"),
        (["--jsonl", "/nonexistent/dir/x.jsonl"], "its directory does not exist"),
        (["--self-test", "--retry-crashed", "1"], "--self-test takes --quick"),
    ],
)
def test_the_crash_options_are_checked_before_any_launch(argv, message, capsys):
    from conformance.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
