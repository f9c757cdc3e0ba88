"""The conformance matrix as pytest tests: one test per case, its id the case name.

Load it with ``pytest -p conformance.pytest_plugin``, with ``pytest_plugins =
["conformance.pytest_plugin"]`` in a conftest.py, or not at all: installed, the package registers
it with pytest (entry point ``pytest11``). It does nothing until ``--conformance-impl NAME`` is
given. Then it adds one test per case of the matrix (``--conformance-quick``, ``-only``,
``-model``, ``-shard`` choose them, as the command line's options do), and when the first of them
runs it starts one ``python -m conformance`` launch for every case still selected (after ``-k``
and ``-m``), reads its JSON report, and passes, fails (every failing stage in the message) or skips
(unsupported) each test from it. With ``--conformance-compare-to`` a failure the baseline had too
is an expected failure (xfail), and a passing case whose distance grew is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ConformanceItem", "ConformanceMatrix"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "the FSDP conformance suite (conformance/)")
    group.addoption(
        "--conformance-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="add the conformance cases of this implementation (a built-in name or "
        "module.path:AdapterClass); repeatable",
    )
    group.addoption("--conformance-quick", action="store_true", help="the quick matrix")
    group.addoption(
        "--conformance-only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="cases whose name matches (as python -m conformance --only)",
    )
    group.addoption(
        "--conformance-model",
        metavar="MODULE:FACTORY",
        help="judge your own model (as python -m conformance --model)",
    )
    group.addoption("--conformance-shard", metavar="I/N", help="part I of N of the cases")
    group.addoption(
        "--conformance-nproc", type=int, default=2, metavar="N", help="ranks (default 2)"
    )
    group.addoption(
        "--conformance-compare-to",
        metavar="PATH",
        help="a previous --json report: its failures are expected, regressions fail",
    )
    group.addoption("--conformance-json", metavar="PATH", help="keep the run's JSON report at PATH")
    group.addoption(
        "--conformance-timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds the whole launch may take (default 3600)",
    )


def _cli_args(config: pytest.Config) -> list[str]:
    """The options that choose the matrix, as ``python -m conformance`` takes them."""
    argv: list[str] = []
    for impl in config.getoption("conformance_impl"):
        argv += ["--impl", impl]
    if config.getoption("conformance_quick"):
        argv.append("--quick")
    for pattern in config.getoption("conformance_only"):
        argv += ["--only", pattern]
    if config.getoption("conformance_model"):
        argv += ["--model", config.getoption("conformance_model")]
    if config.getoption("conformance_shard"):
        argv += ["--shard", config.getoption("conformance_shard")]
    return argv + ["--nproc", str(config.getoption("conformance_nproc"))]


def pytest_report_header(config: pytest.Config) -> list[str]:
    notes = config.stash.get(_NOTES, None)
    if notes is None:
        return []
    return [f"conformance: {' '.join(_cli_args(config))}"] + [f"  note: {n}" for n in notes]


_NOTES = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so that they select among the cases
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not config.getoption("conformance_impl"):
        return
    from conformance.cli import _cases, parse_args

    # Adapters and model factories named by module path are the user's: importable from where
    # pytest was started, as they are in the ranks (python -m puts the working directory first).
    here = str(config.invocation_params.dir)
    if here not in sys.path:
        sys.path.insert(0, here)
    args = parse_args(_cli_args(config))
    cases, notes, _ = _cases(args, args.nproc)
    config.stash[_NOTES] = notes
    matrix = ConformanceMatrix.from_parent(session, name="conformance", nodeid="conformance")
    matrix.case_names = [c.name for c in cases]
    items.extend(matrix.collect())


class ConformanceMatrix(pytest.Collector):
    """The selected cases of one pytest session, and the one launch that runs them."""

    case_names: list[str]
    _report: dict[str, Any] | None = None
    _failure: str | None = None  # why the launch left no report

    def collect(self) -> list[ConformanceItem]:
        return [ConformanceItem.from_parent(self, name=name) for name in self.case_names]

    def report(self) -> dict[str, Any]:
        """The JSON report of the launch, started at the first call with every case still
        selected in the session."""
        if self._report is None and self._failure is None:
            self._launch()
        if self._failure is not None:
            pytest.fail(self._failure, pytrace=False)
        return self._report

    def _launch(self) -> None:
        config = self.config
        selected = [i.name for i in self.session.items if isinstance(i, ConformanceItem)]
        keep = config.getoption("conformance_json")
        tmp = tempfile.mkdtemp(prefix="conformance-pytest-")
        out = keep or os.path.join(tmp, "report.json")
        argv = [a for a in _cli_args(config)]
        # The cases are chosen already (shard included): name them, so that -k's choice holds.
        if "--shard" in argv:
            i = argv.index("--shard")
            del argv[i : i + 2]
        for name in selected:
            argv += ["--case", name]
        if config.getoption("conformance_compare_to"):
            argv += ["--compare-to", config.getoption("conformance_compare_to")]
        log = os.path.join(tmp, "output.txt")
        here = str(config.invocation_params.dir)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "conformance", *argv, "--json", out]
        try:
            with open(log, "w") as f:
                proc = subprocess.run(
                    command,
                    cwd=here,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=config.getoption("conformance_timeout"),
                )
        except subprocess.TimeoutExpired:
            self._failure = f"the conformance launch ran out of time; its output: {log}"
            return
        if not os.path.exists(out):
            tail = Path(log).read_text()[-4000:]
            self._failure = (
                f"python -m conformance exited {proc.returncode} without a report:\n{tail}"
            )
            return
        with open(out, encoding="utf-8") as f:
            self._report = json.load(f)

    def comparison(self) -> dict[str, Any] | None:
        return self.report().get("comparison")


class ConformanceItem(pytest.Item):
    """One case of the matrix; its outcome is read from the launch's report."""

    parent: ConformanceMatrix

    def runtest(self) -> None:
        from conformance.report import describe_case

        doc = self.parent.report()
        case = next((c for c in doc["cases"] if c["name"] == self.name), None)
        if case is None:
            pytest.fail(f"{self.name} has no result (the run stopped before it)", pytrace=False)
        self.user_properties.append(("conformance_seconds", case["seconds"]))
        comparison = self.parent.comparison()
        regressions = [
            c for c in (comparison or {}).get("regressions", []) if c["case"] == self.name
        ]
        if case["status"] == "unsupported":
            pytest.skip(f"unsupported: {case['reason']}")
        if case["status"] == "failed" and comparison is not None and not regressions:
            pytest.xfail(f"failed in the baseline too: {case['reason']}")
        # crashed (a rank died in it) fails whatever the baseline says, as the exit status does
        if case["status"] in ("failed", "crashed") or regressions:
            message = describe_case(case)
            if regressions:
                message += "\nregressions against the baseline:\n" + "\n".join(
                    f"  {r['stage'] or 'case'}: {r['what']}" for r in regressions
                )
            pytest.fail(message, pytrace=False)

    def reportinfo(self):
        return self.path, None, f"conformance case {self.name}"
