"""The DeepSpeed adapter: case mapping, configs and unsupported reasons without deepspeed installed,
and a few real cases on 2 ranks where it is (skipped otherwise; scripts/deepspeed_matrix.sh runs all).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from parameterized import parameterized

from conformance.adapters import get_adapter
from conformance.adapters.deepspeed import (
    STAGE_OF,
    DeepSpeedAdapter,
    _optimizer_spec,
    deepspeed_unsupported_reason,
    ds_config,
)
from conformance.matrix import EXTRA_FEATURES, FEATURES, RANKS_FEATURES, Case, build_matrix
from conformance.training import LR, MOMENTUM, make_sgd
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]


def _case(strategy: str, feature: str = "plain", precision: str = "fp32") -> Case:
    return Case("deepspeed", strategy, precision, feature, "lm_untied", 2)


# ---- mapping and configs (no deepspeed needed) ------------------------------------------------


def test_strategies_map_to_zero_stages_0_to_3():
    assert STAGE_OF == {"NO_SHARD": 0, "SHARD_OPTIM": 1, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3}
    for strategy, stage in STAGE_OF.items():
        config = ds_config(_case(strategy), "/scratch")
        assert config["zero_optimization"]["stage"] == stage
        assert config["gradient_clipping"] == 0.0  # DeepSpeed's default clips at 1.0
    # The suite's parameters are all under ZeRO-3's default persistence threshold (1e5 elements),
    # which would leave them whole on every rank: every one must be partitioned.
    zero = ds_config(_case("FULL_SHARD"), "/scratch")["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 0


def test_adapter_lists_its_stages_and_the_offload_features():
    adapter = get_adapter("deepspeed")
    assert isinstance(adapter, DeepSpeedAdapter)
    assert set(adapter.strategies()) == set(STAGE_OF)
    assert set(adapter.features()) == set(EXTRA_FEATURES)


def test_offload_features_become_offload_param_and_offload_optimizer(tmp_path):
    scratch = str(tmp_path)
    zero = ds_config(_case("FULL_SHARD", "cpu_offload"), scratch)["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu"} and "offload_optimizer" not in zero
    zero = ds_config(_case("SHARD_GRAD_OP", "offload_optimizer"), scratch)["zero_optimization"]
    assert zero == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    zero = ds_config(_case("FULL_SHARD", "disk_offload"), scratch)["zero_optimization"]
    assert zero["offload_param"] == {
        "device": "nvme",
        "nvme_path": os.path.join(scratch, "offload_param"),
        "buffer_size": 2**21,
    }
    zero = ds_config(_case("FULL_SHARD", "disk_offload_optimizer"), scratch)["zero_optimization"]
    assert zero["offload_optimizer"] == {
        "device": "nvme",
        "nvme_path": os.path.join(scratch, "offload_optimizer"),
    }


def test_quick_path_passes_the_client_optimizer_and_builds_no_deepspeed_op():
    config = ds_config(_case("FULL_SHARD", "offload_optimizer"), "/scratch")
    assert "optimizer" not in config  # the suite's torch SGD goes in as the client optimizer
    assert config["zero_force_ds_cpu_optimizer"] is False  # else offload demands CPUAdam
    assert "bf16" not in config
    assert ds_config(_case("NO_SHARD", precision="bf16"), "/scratch")["bf16"] == {"enabled": True}


def test_config_optimizer_is_the_suites_sgd_by_name():
    name, params = _optimizer_spec(make_sgd)
    assert name == "SGD"
    assert params["lr"] == LR and params["momentum"] == MOMENTUM and params["foreach"] is False
    config = ds_config(_case("SHARD_OPTIM"), "/scratch", optimizer=(name, params))
    assert config["optimizer"] == {"type": "SGD", "params": params}
    assert "zero_force_ds_cpu_optimizer" not in config  # DeepSpeed's default (true)
    assert get_adapter("deepspeed_config_optimizer").optimizer_from_config is True


@parameterized.expand(
    [
        ("fp16", _case("FULL_SHARD", precision="fp16"), "own dynamic scaler"),
        ("clip", _case("NO_SHARD", "clip_grad_norm"), "clips inside engine.step()"),
        ("prefetch", _case("FULL_SHARD", "backward_prefetch_post"), "no per-module prefetch"),
        ("fwd_prefetch", _case("FULL_SHARD", "forward_prefetch"), "no per-module prefetch"),
        ("no_sync_z2", _case("SHARD_GRAD_OP", "no_sync"), "no_sync() is incompatible"),
        ("no_sync_z3", _case("FULL_SHARD", "no_sync"), "no_sync() is incompatible"),
        ("param_offload_z2", _case("SHARD_GRAD_OP", "cpu_offload"), "ZeRO-3 only"),
        ("disk_offload_z1", _case("SHARD_OPTIM", "disk_offload"), "ZeRO-3 only"),
        ("optim_offload_z0", _case("NO_SHARD", "offload_optimizer"), "stage 1 or above"),
        ("nvme_optim_z2", _case("SHARD_GRAD_OP", "disk_offload_optimizer"), "nvme as cpu"),
        ("hybrid", _case("HYBRID_SHARD"), "no HYBRID_SHARD"),
    ]
)
def test_what_deepspeed_lacks_is_unsupported_with_its_reason(_, case, words):
    reason = deepspeed_unsupported_reason(case)
    assert reason is not None and words in reason, reason


@parameterized.expand(
    [
        (strategy, feature)
        for strategy, feature in [
            ("NO_SHARD", "no_sync"),
            ("SHARD_OPTIM", "no_sync"),
            ("FULL_SHARD", "cpu_offload"),
            ("FULL_SHARD", "disk_offload"),
            ("FULL_SHARD", "disk_offload_optimizer"),
            ("SHARD_OPTIM", "offload_optimizer"),
            ("FULL_SHARD", "activation_checkpointing"),
            ("SHARD_GRAD_OP", "frozen_params"),
        ]
    ]
)
def test_what_deepspeed_has_runs(strategy, feature):
    assert deepspeed_unsupported_reason(_case(strategy, feature)) is None


def test_every_case_of_the_deepspeed_matrix_is_run_or_declined_with_a_reason():
    adapter = get_adapter("deepspeed")
    cases, _ = build_matrix(
        ["deepspeed"],
        {"deepspeed": adapter.strategies()},
        2,
        known_features={"deepspeed": adapter.features()},
    )
    assert {c.strategy for c in cases} == set(STAGE_OF)
    assert {c.feature for c in cases} == set(FEATURES) - set(RANKS_FEATURES)  # hpZ: 4+ ranks
    run = [c for c in cases if adapter.unsupported_reason(c) is None]
    # Every stage trains plainly in fp32 and bf16.
    assert {(c.strategy, c.precision) for c in run if c.feature == "plain"} == {
        (s, p) for s in STAGE_OF for p in ("fp32", "bf16")
    }


def test_extra_features_stay_out_of_other_implementations_matrices():
    cases, _ = build_matrix(["torch_fsdp2"], {"torch_fsdp2": ["HYBRID_SHARD"]}, 2)
    assert not {c.feature for c in cases} & set(EXTRA_FEATURES)
    lite, _ = build_matrix(
        ["fsdp_lite"], {}, 2, known_features={"fsdp_lite": get_adapter("fsdp_lite").features()}
    )
    assert {c.feature for c in lite} & set(EXTRA_FEATURES) == {"disk_offload"}


def test_listing_the_deepspeed_matrix_imports_no_deepspeed():
    # deepspeed blocked: any import of it raises, so listing must not import it at all.
    code = (
        "import sys; sys.modules['deepspeed'] = None; sys.argv[1:] = ['--list', '--impl', "
        "'deepspeed']; from conformance.cli import main; main(); "
        "assert sys.modules['deepspeed'] is None"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "deepspeed/FULL_SHARD/fp32/plain/lm_untied/ws2" in proc.stdout.splitlines()


# ---- real DeepSpeed on 2 ranks (skipped where it is not installed) ---------------------------

REAL_CASES = [
    _case("NO_SHARD"),
    _case("SHARD_OPTIM"),
    _case("SHARD_GRAD_OP"),
    _case("FULL_SHARD"),
    _case("SHARD_GRAD_OP", "offload_optimizer"),
    _case("FULL_SHARD", "cpu_offload"),
    _case("FULL_SHARD", "clip_grad_norm"),  # declined up front
]


def _real_rank(rank: int, world_size: int):
    import torch.nn.functional as F

    from conformance.runner import run_cases

    torch_linear = F.linear
    results = run_cases(REAL_CASES, [get_adapter("deepspeed")], timeout_s=60.0)
    # ZeRO-3 replaces F.linear process-wide; the adapter must have put torch's back.
    return [(r, F.linear is torch_linear) for r in results]


@pytest.mark.slow
def test_deepspeed_stages_and_cpu_offload_match_ddp_bitwise(tmp_path):
    pytest.importorskip(
        "deepspeed", reason="deepspeed is not installed (pip install '.[deepspeed]')"
    )
    results = run_ranks(_real_rank, 2, tmp_path, timeout=300)[0]
    for result, linear_restored in results:
        assert linear_restored, result.case.name
    *ran, declined = [r for r, _ in results]
    assert declined.status == "unsupported" and "engine.step()" in declined.reason
    for result in ran:
        assert result.status == "passed", (result.case.name, result.reason)
        bitwise = all(per["ddp"].bitwise for per in result.stages.values() if per["ddp"].compared)
        assert bitwise, result.case.name
