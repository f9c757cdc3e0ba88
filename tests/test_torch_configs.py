"""torch FSDP's own enums and configs work in fsdp_lite exactly as fsdp_lite's do.

Accelerate's FSDP plugin and Lightning's FSDPStrategy build ``torch.distributed.fsdp``'s
``ShardingStrategy``, ``MixedPrecision``, ``BackwardPrefetch``, ``CPUOffload``, ``StateDictType``,
``*StateDictConfig`` and pass them on. Each case trains the same model twice, once with torch's
objects and once with fsdp_lite's, and needs the same losses and state, bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import wrap as torch_wrap

import fsdp_lite
from conformance.models import Block
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import wrap as lite_wrap
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

BF16 = torch.bfloat16


def _kwargs(api, wrap_module) -> dict[str, dict]:
    """Constructor kwargs per case, built from ``api`` (torch.distributed.fsdp or fsdp_lite)."""
    layers = wrap_module.ModuleWrapPolicy({Block})
    cases = {
        strategy: {"sharding_strategy": api.ShardingStrategy[strategy], "auto_wrap_policy": layers}
        for strategy in (
            "FULL_SHARD",
            "SHARD_GRAD_OP",
            "NO_SHARD",
            "HYBRID_SHARD",
            "_HYBRID_SHARD_ZERO2",
        )
    }
    cases["mixed_precision"] = {
        "mixed_precision": api.MixedPrecision(
            param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16
        ),
        "auto_wrap_policy": wrap_module.CustomPolicy(lambda m: isinstance(m, Block)),
    }
    cases["backward_post"] = {
        "backward_prefetch": api.BackwardPrefetch.BACKWARD_POST,
        "auto_wrap_policy": layers,
    }
    cases["cpu_offload"] = {"cpu_offload": api.CPUOffload(offload_params=True)}
    return cases


CASES = list(_kwargs(fsdp_lite, lite_wrap))


def _train(rank, world_size, kwargs):
    fsdp = FSDP(build_model("lm"), **kwargs)
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(2):
        x, y = rank_batch("lm", step, rank, world_size)
        loss = loss_fn("lm", fsdp(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return fsdp, optim, losses


def _configs_rank(rank: int, world_size: int) -> dict:
    theirs, ours = _kwargs(torch_fsdp, torch_wrap), _kwargs(fsdp_lite, lite_wrap)
    failures = {}
    for case in CASES:
        try:
            fsdp_t, _, losses_t = _train(rank, world_size, theirs[case])
            fsdp_o, _, losses_o = _train(rank, world_size, ours[case])
            assert losses_t == losses_o, f"losses {losses_t} != {losses_o}"
            assert fsdp_t._config == dataclasses.replace(
                fsdp_o._config,
                group=fsdp_t._config.group,
                mesh=fsdp_t._config.mesh,
                replicate_group=fsdp_t._config.replicate_group,
                disk=fsdp_t._config.disk,
            ), "configs differ"
        except AssertionError as e:
            failures[case] = str(e)
    # State dict settings and optimizer keys with torch's enum and config objects.
    fsdp, optim, _ = _train(rank, world_size, ours["FULL_SHARD"])
    for kind, config, optim_config in (
        ("FULL_STATE_DICT", "FullStateDictConfig", "FullOptimStateDictConfig"),
        ("SHARDED_STATE_DICT", "ShardedStateDictConfig", "ShardedOptimStateDictConfig"),
        ("LOCAL_STATE_DICT", "LocalStateDictConfig", "LocalOptimStateDictConfig"),
    ):
        options = {"offload_to_cpu": True}
        if kind == "FULL_STATE_DICT":
            options["rank0_only"] = True
        seen = []
        for api in (torch_fsdp, fsdp_lite):
            with FSDP.state_dict_type(
                fsdp,
                api.StateDictType[kind],
                getattr(api, config)(**options),
                getattr(api, optim_config)(**options),
            ):
                settings = FSDP.get_state_dict_type(fsdp)
                assert type(settings.state_dict_type) is fsdp_lite.StateDictType
                assert type(settings.state_dict_config) is getattr(fsdp_lite, config)
                seen.append((fsdp.state_dict(), FSDP.optim_state_dict(fsdp, optim)))
        (sd_t, osd_t), (sd_o, osd_o) = seen
        if list(sd_t) != list(sd_o) or any(
            not torch.equal(_local(sd_t[k]), _local(sd_o[k])) for k in sd_t
        ):
            failures[kind] = "state dicts differ"
        if list(osd_t.get("state", {})) != list(osd_o.get("state", {})):
            failures[f"optim {kind}"] = "optimizer state keys differ"
    full = FSDP.full_optim_state_dict(fsdp, optim, rank0_only=False)
    by_id = FSDP.rekey_optim_state_dict(full, torch_fsdp.OptimStateKeyType.PARAM_ID, fsdp)
    by_id_ours = FSDP.rekey_optim_state_dict(full, fsdp_lite.OptimStateKeyType.PARAM_ID, fsdp)
    if list(by_id["state"]) != list(by_id_ours["state"]):
        failures["OptimStateKeyType"] = "rekeyed differently"
    return failures


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.fixture(scope="module")
def config_results(tmp_path_factory):
    return run_ranks(_configs_rank, 2, tmp_path_factory.mktemp("configs"), timeout=240)


@pytest.mark.parametrize(
    "case",
    CASES
    + ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT", "OptimStateKeyType"]
    + [f"optim {k}" for k in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")],
)
def test_torch_config_objects_behave_as_fsdp_lites(config_results, case):
    for rank, failures in enumerate(config_results):
        assert case not in failures, f"rank {rank}: {case}: {failures[case]}"


def test_a_foreign_type_of_the_same_name_is_refused_naming_both_modules():
    @dataclasses.dataclass
    class MixedPrecision:  # another library's class of the same name: not torch's
        param_dtype: torch.dtype | None = None

    with pytest.raises(TypeError) as error:
        fsdp_lite.api.as_ours(MixedPrecision(), fsdp_lite.MixedPrecision, "mixed_precision")
    message = str(error.value)
    assert "fsdp_lite.api.MixedPrecision" in message and __name__ in message, message


def test_torch_configs_map_field_by_field():
    theirs = torch_fsdp.MixedPrecision(
        param_dtype=BF16, keep_low_precision_grads=True, cast_forward_inputs=True
    )
    ours = fsdp_lite.api.as_ours(theirs, fsdp_lite.MixedPrecision, "mixed_precision")
    assert ours == fsdp_lite.MixedPrecision(
        param_dtype=BF16, keep_low_precision_grads=True, cast_forward_inputs=True
    )
    for name in ("ShardingStrategy", "BackwardPrefetch", "StateDictType"):
        for member in getattr(torch_fsdp, name):
            mapped = fsdp_lite.api.as_ours(member, getattr(fsdp_lite, name), name)
            assert mapped is getattr(fsdp_lite, name)[member.name]
