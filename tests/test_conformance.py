"""The conformance suite can fail: planted bugs are caught at the right case and stage.

Broken adapters subclass the fsdp_lite adapter and plant a bug inside fsdp_lite by patching it for
the duration of their case only (a wrong gradient divide factor, a skipped reduce-scatter, a stale
unsharded parameter). One group of 2 ranks runs them all through ``run_cases``, next to the clean
adapter on the same case; the report must mark exactly the broken cases, at the expected stage.
The command line is run twice in a subprocess: ``--quick`` for fsdp_lite, and torch FSDP2.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from conformance.adapters import Adapter, Unsupported, get_adapter
from conformance.adapters.lite import FsdpLiteAdapter
from conformance.matrix import (
    EXTRA_FEATURES,
    FEATURES,
    PRECISIONS,
    RANKS_FEATURES,
    Case,
    build_matrix,
    select,
)
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
STALE_UNIT = "fc2"  # the mlp unit whose parameters go stale / skip their reduce-scatter


# ---- planted bugs ----------------------------------------------------------------------------


class WrongDivideFactorAdapter(FsdpLiteAdapter):
    """Gradients averaged over 2N ranks instead of N: every gradient is half what it should be."""

    name = "bug_wrong_divide_factor"

    @contextlib.contextmanager
    def case_context(self, case):
        from fsdp_lite.engine import collectives

        if hasattr(collectives, "grad_divide_factors"):  # (pre, post): divide before / after
            original = collectives.grad_divide_factors
            patched = lambda world_size: (original(world_size)[0], original(world_size)[1] * 2)
            attr = "grad_divide_factors"
        else:  # the original single factor, multiplied in before the sum
            original = collectives.grad_divide_factor
            patched = lambda world_size: 1.0 / (2 * world_size)
            attr = "grad_divide_factor"
        with _patched(collectives, attr, patched):
            yield


class SkippedReduceScatterAdapter(FsdpLiteAdapter):
    """One unit never reduces its gradients: its parameters get no gradient at all."""

    name = "bug_skipped_reduce_scatter"

    @contextlib.contextmanager
    def case_context(self, case):
        from fsdp_lite.engine.unit import ShardedUnit

        original = ShardedUnit.start_reduce

        def start_reduce(unit):
            if unit.name == STALE_UNIT:
                return None  # every rank skips the same unit: no collective goes missing
            return original(unit)

        with _patched(ShardedUnit, "start_reduce", start_reduce):
            yield


class StaleUnshardedParamAdapter(FsdpLiteAdapter):
    """One unit keeps computing with the values of its first all-gather, ignoring later steps."""

    name = "bug_stale_unsharded_param"

    @contextlib.contextmanager
    def case_context(self, case):
        from fsdp_lite.engine.unit import ShardedUnit

        original = ShardedUnit.wait_for_unshard
        first_values: dict[int, list[torch.Tensor]] = {}

        def wait_for_unshard(unit):
            original(unit)  # the all-gather still runs, so the ranks stay in step
            if unit.name != STALE_UNIT or not unit.params:
                return
            with torch.no_grad():
                if id(unit) not in first_values:
                    first_values[id(unit)] = [p.unsharded_param.clone() for p in unit.params]
                    return
                for p, old in zip(unit.params, first_values[id(unit)]):
                    with torch.autograd._unsafe_preserve_version_counter(p.unsharded_param):
                        p.unsharded_param.copy_(old)

        with _patched(ShardedUnit, "wait_for_unshard", wait_for_unshard):
            yield


class NotImplementedAdapter(FsdpLiteAdapter):
    """Wrapping raises NotImplementedError, as fsdp_lite does for what it does not build yet."""

    name = "stub_not_implemented"

    def wrap(self, model, request):
        raise NotImplementedError("this combination is not built")


class SaysUnsupportedAdapter(FsdpLiteAdapter):
    name = "stub_says_unsupported"

    def unsupported_reason(self, case):
        return "the adapter declines every case"


class RaisesMidStepAdapter(FsdpLiteAdapter):
    """Every rank raises in the middle of step 2's optimizer step (a crash, not unsupported)."""

    name = "stub_raises_mid_step"

    def full_params(self, model):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            raise RuntimeError("planted crash while gathering params")
        return super().full_params(model)


class OneRankRaisesInWrapAdapter(FsdpLiteAdapter):
    """Rank 1 raises before wrapping while rank 0 enters the constructor's collectives."""

    name = "stub_one_rank_raises"

    def wrap(self, model, request):
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("planted failure on rank 1 only")
        return super().wrap(model, request)


@contextlib.contextmanager
def _patched(owner, attr: str, value):
    original = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, original)


ADAPTERS = [
    FsdpLiteAdapter,
    WrongDivideFactorAdapter,
    SkippedReduceScatterAdapter,
    StaleUnshardedParamAdapter,
    NotImplementedAdapter,
    SaysUnsupportedAdapter,
    RaisesMidStepAdapter,
]


def _case(impl: str, model: str = "mlp", strategy: str = "FULL_SHARD") -> Case:
    return Case(impl, strategy, "fp32", "plain", model, 2)


def _run_suite_rank(
    rank: int, world_size: int, cases: list[Case], names: list[str], timeout_s: float
):
    from conformance.runner import run_cases

    by_name = {
        cls.name: cls() for cls in ADAPTERS + [OneRankRaisesInWrapAdapter] if cls.name in names
    }
    return run_cases(cases, by_name, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Every adapter above on the same case, in one 2-rank group; results by impl name."""
    cases = [_case(cls.name) for cls in ADAPTERS]
    names = [c.impl for c in cases]
    results = run_ranks(
        _run_suite_rank,
        2,
        tmp_path_factory.mktemp("planted"),
        args=(cases, names, 30.0),
        timeout=240,
    )
    assert [r.status for r in results[0]] == [r.status for r in results[1]], "ranks disagree"
    return {r.case.impl: r for r in results[0]}


# ---- the suite catches each planted bug ------------------------------------------------------


def test_clean_fsdp_lite_passes_the_case_the_bugs_are_planted_in(planted):
    result = planted["fsdp_lite"]
    assert result.status == "passed", result.reason
    assert all(per["ddp"].bitwise for per in result.stages.values()), "fp32 at 2 ranks is bitwise"


@pytest.mark.parametrize(
    "impl, stage, step",
    [
        ("bug_wrong_divide_factor", "grads", 1),  # loss of step 1 is still right
        ("bug_skipped_reduce_scatter", "grads", 1),
    ],
)
def test_planted_gradient_bug_fails_grads_at_first_step(planted, impl, stage, step):
    result = planted[impl]
    assert result.status == "failed"
    assert result.traceback is None, "a planted numerical bug must fail a comparison, not raise"
    assert result.first_failure() == (step, stage)
    assert result.stages["loss"]["ddp"].first_failed_step != 1, "step 1's forward had no bug"


def test_stale_unsharded_param_fails_loss_or_params_from_step_two(planted):
    result = planted["bug_stale_unsharded_param"]
    assert result.status == "failed" and result.traceback is None
    step, stage = result.first_failure()
    assert step >= 2 and stage in ("loss", "params"), (step, stage)
    # Step 1 ran on fresh values: nothing failed there.
    assert all(t.first_failed_step != 1 for per in result.stages.values() for t in per.values())


def test_report_marks_exactly_the_broken_cases(planted):
    from conformance import report

    failed = {impl for impl, r in planted.items() if r.status == "failed"}
    assert failed == {
        "bug_wrong_divide_factor",
        "bug_skipped_reduce_scatter",
        "bug_stale_unsharded_param",
        "stub_raises_mid_step",
    }
    doc = json.loads(report.to_json(list(planted.values()), {"world_size": 2}))
    by_impl = {c["impl"]: c for c in doc["cases"]}
    divide = by_impl["bug_wrong_divide_factor"]
    assert divide["first_failure"] == {"step": 1, "stage": "grads"}
    assert divide["stages"]["loss"]["passed"] is False  # step 2's loss follows the wrong step
    assert divide["stages"]["grads"]["vs_ddp"]["first_failed_step"] == 1
    assert divide["stages"]["grads"]["vs_single"]["passed"] is False
    assert by_impl["fsdp_lite"]["stages"]["grads"]["bitwise"] is True
    assert doc["exit_status"] == 1


def test_unsupported_is_reported_with_its_reason_never_passed(planted):
    assert planted["stub_not_implemented"].status == "unsupported"
    assert "not built" in planted["stub_not_implemented"].reason
    assert planted["stub_says_unsupported"].status == "unsupported"
    assert planted["stub_says_unsupported"].reason == "the adapter declines every case"


def test_exception_in_a_case_is_a_failed_case_with_traceback(planted):
    result = planted["stub_raises_mid_step"]
    assert result.status == "failed"
    assert "planted crash while gathering params" in result.traceback
    assert "step 2" in result.reason  # the stage it raised in
    assert result.stages["grads"]["ddp"].passed  # step 1 was compared before the crash


def test_one_rank_failing_inside_a_collective_fails_only_that_case(tmp_path):
    # Rank 1 raises before wrapping while rank 0 waits in the constructor's collectives: the data
    # group's timeout frees rank 0, the case fails naming rank 1, and the next case still runs
    # on a rebuilt group.
    cases = [_case("stub_one_rank_raises"), _case("fsdp_lite")]
    results = run_ranks(
        _run_suite_rank, 2, tmp_path, args=(cases, [c.impl for c in cases], 5.0), timeout=120
    )[0]
    assert results[0].status == "failed"
    assert "planted failure on rank 1 only" in results[0].traceback
    assert results[0].reason.startswith("rank 1 raised")
    assert results[1].status == "passed", results[1].reason


# ---- matrix, registry, reports ---------------------------------------------------------------


def test_default_matrix_covers_every_feature_strategy_and_precision():
    cases, _ = build_matrix(
        ["fsdp_lite"],
        {"fsdp_lite": ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]},
        2,
        known_features={"fsdp_lite": EXTRA_FEATURES},
    )
    # hpZ needs 4 ranks: it joins the default matrix there (the nightly's --nproc 4).
    assert {c.feature for c in cases} == set(FEATURES) - set(RANKS_FEATURES)
    at_four, _ = build_matrix(["fsdp_lite"], {}, 4, known_features={"fsdp_lite": EXTRA_FEATURES})
    assert {c.feature for c in at_four} == set(FEATURES)
    assert {c.strategy for c in cases} == {"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"}
    assert {c.precision for c in cases} == set(PRECISIONS)
    assert {"mlp", "lm", "lm_untied", "nested", "convnet", "frozen", "bufnet", "unused"} <= {
        c.model for c in cases
    }
    assert len(set(cases)) == len(cases)
    quick, _ = build_matrix(["fsdp_lite"], {}, 2, quick=True)
    # One case per class of bug the self-test's catalog shows, on top of the loop features.
    assert set(quick) < set(cases) and len(quick) <= 40


def test_extra_strategies_only_for_implementations_that_have_them():
    cases, _ = build_matrix(["a", "b"], {"a": ["HYBRID_SHARD"], "b": []}, 2)
    assert {c.impl for c in cases if c.strategy == "HYBRID_SHARD"} == {"a"}
    assert not [c for c in cases if c.strategy == "SHARD_OPTIM"]


def test_extra_features_only_for_implementations_that_list_them():
    cases, _ = build_matrix(["a", "b"], {}, 2, known_features={"a": ["disk_offload"]})
    extra = {(c.impl, c.feature) for c in cases if c.feature in EXTRA_FEATURES}
    assert extra == {("a", "disk_offload")}
    assert {c.model for c in cases if c.feature == "disk_offload"} == {"lm_untied", "wide_lm"}
    # The matrix of an implementation that lists none is what it was before the offload features.
    assert len([c for c in cases if c.impl == "b"]) == len(build_matrix(["b"], {}, 2)[0])


class DiskOffloadSeenAdapter(FsdpLiteAdapter):
    """fsdp_lite, noting what its disk offload left in the case's scratch directory."""

    name = "disk_offload_seen"

    def wrap(self, model, request):
        wrapped = super().wrap(model, request)
        self.seen = sorted(os.listdir(request.scratch_dir))
        return wrapped


def _disk_offload_rank(rank: int, world_size: int):
    from conformance.runner import run_cases

    adapter = DiskOffloadSeenAdapter()
    case = Case(adapter.name, "FULL_SHARD", "fp32", "disk_offload", "mlp", 2)
    return run_cases([case], [adapter], timeout_s=30.0)[0], adapter.seen


def test_fsdp_lite_disk_offload_writes_into_the_case_directory_and_passes(tmp_path):
    (result, seen), _ = run_ranks(_disk_offload_rank, 2, tmp_path, timeout=120)
    assert result.status == "passed", result.reason
    assert all(per["ddp"].bitwise for per in result.stages.values())
    assert seen, "CPUOffload(offload_dir=...) made no directory in the case's scratch directory"


def test_only_selects_by_glob_or_substring():
    cases, _ = build_matrix(["fsdp_lite"], {}, 2)
    assert {c.feature for c in select(cases, ["no_sync"])} == {"no_sync"}
    picked = select(cases, ["*/FULL_SHARD/fp?[26]/plain/mlp/*"])
    assert [c.name for c in picked] == [
        "fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2",
        "fsdp_lite/FULL_SHARD/fp16/plain/mlp/ws2",
    ]


def test_adapters_found_by_name_and_by_module_path():
    assert get_adapter("fsdp_lite").name == "fsdp_lite"
    assert get_adapter("torch_fsdp2").name == "torch_fsdp2"
    third_party = get_adapter("tests.test_conformance:WrongDivideFactorAdapter")
    assert isinstance(third_party, Adapter) and third_party.name == "bug_wrong_divide_factor"
    with pytest.raises(ValueError, match="unknown implementation"):
        get_adapter("no_such_fsdp")
    assert issubclass(Unsupported, Exception)


def test_junit_has_a_failure_per_failed_stage_and_skipped_for_unsupported(planted):
    from conformance import report

    root = ET.fromstring(report.to_junit(list(planted.values())))
    suite = root.find("testsuite")
    assert suite.get("tests") == str(len(planted))
    cases = {tc.get("classname").split(".", 1)[1]: tc for tc in suite.iter("testcase")}
    assert cases["bug_wrong_divide_factor"].find("failure").get("type") == "grads"
    assert cases["stub_raises_mid_step"].find("error") is not None
    assert cases["stub_not_implemented"].find("skipped") is not None
    assert len(cases["fsdp_lite"]) == 1  # only system-out: passed
    markdown = report.to_markdown(list(planted.values()))
    assert "| bug_wrong_divide_factor | FULL_SHARD |" in markdown


# ---- the command line ------------------------------------------------------------------------


def _run_cli(
    args: list[str], tmp_path: Path, timeout: float
) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            *args,
            "--json",
            str(out),
            "--junit",
            str(tmp_path / "out.xml"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), (
        f"no JSON written; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_cli_quick_run_passes_for_fsdp_lite_with_the_documented_json(tmp_path):
    proc, doc = _run_cli(["--quick"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["summary"]["failed"] == 0 and doc["exit_status"] == 0
    assert doc["world_size"] == 2 and doc["impls"] == ["fsdp_lite"]
    assert "worst stage" in proc.stdout and "cases:" in proc.stdout  # the summary table
    keys = {
        "name",
        "impl",
        "strategy",
        "precision",
        "feature",
        "model",
        "world_size",
        "status",
        "reason",
        "stages",
    }
    for case in doc["cases"]:
        assert keys <= set(case)
        assert case["status"] in ("passed", "failed", "unsupported")
        if case["status"] == "unsupported":
            assert case["reason"]
            continue
        assert set(case["stages"]) == {"loss", "grads", "params", "optim_state", "state_dict"}
        for stage in case["stages"].values():
            assert {"max_abs", "max_rel", "bitwise", "tolerance", "passed"} <= set(stage)
            assert isinstance(stage["bitwise"], bool)
            assert set(stage["tolerance"]) == {"atol", "rtol"}
    fp32 = [c for c in doc["cases"] if c["precision"] == "fp32"]
    assert fp32 and all(
        s["bitwise"] for c in fp32 for s in c["stages"].values() if c["feature"] != "clip_grad_norm"
    )
    assert ET.parse(tmp_path / "out.xml").getroot().tag == "testsuites"


@pytest.mark.slow
def test_cli_runs_torch_fsdp2_and_reports_its_results(tmp_path):
    proc, doc = _run_cli(
        ["--impl", "torch_fsdp2", "--quick", "--only", "*/plain/*"], tmp_path, timeout=240
    )
    assert doc["impls"] == ["torch_fsdp2"] and doc["cases"]
    assert {c["impl"] for c in doc["cases"]} == {"torch_fsdp2"}
    # Native failures are reported, not hidden: the exit status follows the cases.
    assert proc.returncode == int(any(c["status"] == "failed" for c in doc["cases"]))
    assert all(c["status"] in ("passed", "failed", "unsupported") for c in doc["cases"])
    assert "torch_fsdp2" in proc.stdout


def _fsdp2_front_quick_rank(rank: int, world_size: int):
    from conformance.adapters import get_adapter
    from conformance.runner import run_cases

    adapter = get_adapter("fsdp_lite_fsdp2")
    cases, _ = build_matrix(
        ["fsdp_lite_fsdp2"], {"fsdp_lite_fsdp2": adapter.strategies()}, 2, quick=True
    )
    return [(r.case.name, r.status, r.reason) for r in run_cases(cases, [adapter], timeout_s=60.0)]


def test_the_fsdp2_front_passes_the_quick_matrix(tmp_path):
    results = run_ranks(_fsdp2_front_quick_rank, 2, tmp_path, timeout=240)[0]
    assert len(results) >= 20
    failed = [r for r in results if r[1] != "passed"]
    assert not failed, failed
