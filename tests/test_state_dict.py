"""Model state dicts: the settings API, FULL / SHARDED / LOCAL out and back in, DCP, torch's
get_state_dict helpers (against native FSDP2 on the same model), and the memory of a full save.

All checks for one world size run in one launch (start-up dominates); each check's outcome comes
back by name, and each test below asserts one of them on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from fsdp_lite import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.trace import record_collectives
from fsdp_lite.wrap import ModuleWrapPolicy
from tests.parity import POLICIES, assert_close, build_model, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks

EXACT = dict(rtol=0.0, atol=0.0)  # state dicts copy values; nothing is computed
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
FULL, SHARDED, LOCAL = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
)


def _lm(strategy_name: str = "FULL_SHARD") -> FSDP:
    return FSDP(
        build_model("lm"),
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=POLICIES["lm"],
    )


def _plus(state_dict: dict, delta: float) -> dict:
    return {k: v + delta for k, v in state_dict.items()}


def _assert_full_equal(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for key, value in want.items():
        assert not isinstance(got[key], DTensor), f"{what}: {key} is a DTensor"
        assert_close(got[key], value, what=f"{what} {key}", **EXACT)


# ---- checks (each runs on every rank) -----------------------------------------------------------


def _check_settings(rank, world_size, tmp):
    model = _lm()
    wrappers = FSDP.fsdp_modules(model)
    default = FSDP.get_state_dict_type(model)
    assert default.state_dict_type == FULL, default
    assert type(default.state_dict_config) is FullStateDictConfig, default
    assert type(default.optim_state_dict_config) is FullOptimStateDictConfig, default
    config = ShardedStateDictConfig(offload_to_cpu=True)
    previous = FSDP.set_state_dict_type(model, SHARDED, config)
    assert previous.state_dict_type == FULL, previous
    assert all(FSDP.get_state_dict_type(w).state_dict_config is config for w in wrappers)
    assert type(FSDP.get_state_dict_type(model).optim_state_dict_config) is (
        ShardedOptimStateDictConfig
    )
    with FSDP.state_dict_type(model, LOCAL):
        assert FSDP.get_state_dict_type(model).state_dict_type == LOCAL
    assert FSDP.get_state_dict_type(model).state_dict_type == SHARDED, "context did not restore"
    with pytest.raises(
        RuntimeError,
        match="Expected state_dict_config of type fsdp_lite.api.FullStateDictConfig for "
        "FULL_STATE_DICT, got fsdp_lite.api.LocalStateDictConfig",
    ):
        FSDP.set_state_dict_type(model, FULL, LocalStateDictConfig())
    # A plain module around the root: the settings reach every wrapper inside it.
    outer = nn.Sequential(_lm())
    FSDP.set_state_dict_type(outer, LOCAL)
    assert all(
        FSDP.get_state_dict_type(w).state_dict_type == LOCAL for w in FSDP.fsdp_modules(outer)
    )


def _check_full(rank, world_size, tmp):
    for strategy_name in STRATEGIES:
        plain, model = build_model("lm"), _lm(strategy_name)
        what = f"{strategy_name} FULL"
        with record_collectives(model) as trace:
            full = model.state_dict()
        _assert_full_equal(full, plain.state_dict(), what)
        num_sharded_units = sum(w._unit.rules.shard_params for w in FSDP.fsdp_modules(model))
        assert trace.count("all_gather", phase="state_dict") == num_sharded_units, trace.records
        # offload_to_cpu and rank0_only: rank 0 gets everything on CPU, the others {} (as torch)
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, FULL, config):
            only = model.state_dict()
        if rank == 0:
            _assert_full_equal(only, plain.state_dict(), f"{what} rank0_only")
            assert all(v.device.type == "cpu" for v in only.values())
        else:
            assert only == {}, f"{what}: rank {rank} got {list(only)} with rank0_only"
        # load: every rank holds the full dict; values land in the shards, no gather
        fresh = _lm(strategy_name)
        with record_collectives(fresh) as trace:
            result = fresh.load_state_dict(_plus(full, 1.0))
        assert not result.missing_keys and not result.unexpected_keys, result
        assert trace.count("all_gather") == 0, trace.records
        _assert_full_equal(fresh.state_dict(), _plus(plain.state_dict(), 1.0), f"{what} load")
        # the unwrapped module takes it too
        plain.load_state_dict(fresh.state_dict())


def _check_full_after_forward_without_backward(rank, world_size, tmp):
    # The root keeps its unsharded params after a forward with grad on (for the backward).
    plain, model = build_model("lm"), _lm()
    x, _ = rank_batch("lm", 0, rank, world_size)
    model(x)
    _assert_full_equal(model.state_dict(), plain.state_dict(), "after forward")
    with FSDP.state_dict_type(model, SHARDED):
        assert isinstance(model.state_dict()["tok.weight"], DTensor)


def _check_sharded(rank, world_size, tmp):
    plain, model = build_model("lm"), _lm()
    want = plain.state_dict()
    with FSDP.state_dict_type(model, SHARDED), record_collectives(model) as trace:
        sharded = model.state_dict()
        assert list(sharded) == list(want), list(sharded)
        for key, value in sharded.items():
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
            assert value.shape == want[key].shape, key
            assert_close(value.to_local(), shard_of(want[key], rank, world_size), what=key, **EXACT)
        dcp.save(sharded, checkpoint_id=f"{tmp}/sharded")
        assert trace.count("all_gather") == 0, f"a sharded save gathered: {trace.records}"
        # load into a model with other values: dcp.load fills its shards in place
        fresh = _lm()
        fresh.load_state_dict(_plus(want, 3.0))
        with FSDP.state_dict_type(fresh, SHARDED):
            target = fresh.state_dict()
            dcp.load(target, checkpoint_id=f"{tmp}/sharded")
            fresh.load_state_dict(target)
    assert trace.count("all_gather") == 0, trace.records
    _assert_full_equal(fresh.state_dict(), want, "SHARDED via dcp")


def _check_local(rank, world_size, tmp):
    plain, model = build_model("lm"), _lm()
    want = plain.state_dict()
    with FSDP.state_dict_type(model, LOCAL):
        local = model.state_dict()
        for key, value in local.items():
            assert type(value) is torch.Tensor, f"{key} is {type(value).__name__}"
            assert_close(value, shard_of(want[key], rank, world_size), what=key, **EXACT)
        fresh = _lm()
        fresh.load_state_dict(_plus(want, 2.0))
        with FSDP.state_dict_type(fresh, LOCAL):
            fresh.load_state_dict(local)
            wrong = dict(local, pos=torch.zeros(1, 24))
            with pytest.raises(ValueError, match="LOCAL_STATE_DICT value for 'pos' has shape"):
                fresh.load_state_dict(wrong)
    _assert_full_equal(fresh.state_dict(), want, "LOCAL roundtrip")


def _check_sharded_values_are_dtensors_and_sharded_tensors_load(rank, world_size, tmp):
    """_use_dtensor: DTensors either way, with a warning saying how to read them; native FSDP1's
    ShardedTensor values load at the same world size."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as NativeFSDP
    from torch.distributed.fsdp import StateDictType as NativeStateDictType

    plain, model = build_model("lm"), _lm()
    with pytest.warns(
        UserWarning, match=r"rows with \.to_local\(\), not \.local_shards\(\)"
    ) as caught:
        FSDP.set_state_dict_type(model, SHARDED)
    assert caught[0].filename == __file__, f"the warning names {caught[0].filename}"
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    expect_dtensors = ShardedStateDictConfig(_use_dtensor=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning once the user says DTensor
        with FSDP.state_dict_type(model, SHARDED, expect_dtensors):
            assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    # native FSDP1's SHARDED_STATE_DICT (ShardedTensor values, the same rows per rank) loads here
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's deprecation notices
    source = build_model("lm")
    source.load_state_dict(_plus(plain.state_dict(), 1.0))
    native = NativeFSDP(source, auto_wrap_policy=POLICIES["lm"], device_id=torch.device("cpu"))
    with NativeFSDP.state_dict_type(native, NativeStateDictType.SHARDED_STATE_DICT):
        native_sharded = native.state_dict()
    assert type(native_sharded["tok.weight"]).__name__ == "ShardedTensor"
    fresh = _lm()
    with FSDP.state_dict_type(fresh, SHARDED, expect_dtensors):
        fresh.load_state_dict(native_sharded)
    _assert_full_equal(fresh.state_dict(), _plus(plain.state_dict(), 1.0), "from ShardedTensor")


def _check_load_errors_name_unwrapped_keys(rank, world_size, tmp):
    model = _lm()
    full = model.state_dict()
    del full["blocks.1.qkv.weight"]
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(dict(full, extra=torch.zeros(1)))
    message = str(error.value)
    assert '"blocks.1.qkv.weight"' in message and '"extra"' in message, message
    assert "_fsdp_wrapped_module" not in message, message
    result = model.load_state_dict(full, strict=False)
    assert result.missing_keys == ["blocks.1.qkv.weight"], result
    bad = dict(model.state_dict(), pos=torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match="size mismatch for pos"):
        model.load_state_dict(bad)


def _native_fsdp2_lm():
    from torch.distributed.fsdp import fully_shard

    model = build_model("lm")
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


DSD_OPTIONS = [  # (full_state_dict, cpu_offload): what torch's helper takes
    (False, False),
    (False, True),
    (True, False),
    (True, True),
]


def _assert_same_values(mine, theirs, what: str) -> None:
    assert type(mine) is type(theirs), f"{what}: {type(mine)} vs {type(theirs)}"
    if isinstance(mine, DTensor):
        assert mine.placements == theirs.placements, what
        mine, theirs = mine.to_local(), theirs.to_local()
    if torch.is_tensor(mine):
        assert mine.device == theirs.device, f"{what}: {mine.device} vs {theirs.device}"
    assert_close(mine, theirs, what=what, **EXACT)


def _check_dsd_matches_native_fsdp2(rank, world_size, tmp):
    """torch's get/set_state_dict give the same on an fsdp_lite model as on an FSDP2 one, with
    no step beforehand: the wrappers stay in FSDP1's default FULL_STATE_DICT (Note [torch's
    get_state_dict] in state_dict.py).
    """
    ours, native = _lm(), _native_fsdp2_lm()
    models = {"fsdp_lite": ours, "fsdp2": native}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = rank_batch("lm", 0, rank, world_size)
    for key, model in models.items():
        loss_fn("lm", model(x), y).backward()
        optims[key].step()
    for full_state_dict, cpu_offload in DSD_OPTIONS:
        options = StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload)
        what = f"full_state_dict={full_state_dict}, cpu_offload={cpu_offload}"
        got = {k: get_state_dict(m, optims[k], options=options) for k, m in models.items()}
        (our_model, our_optim), (their_model, their_optim) = got["fsdp_lite"], got["fsdp2"]
        assert list(our_model) == list(their_model), f"{what}: {list(our_model)}"
        if full_state_dict and cpu_offload and rank != 0:  # torch: rank 0 only
            assert our_model == {} and our_optim == {} == their_optim, what
        else:
            assert list(our_optim["state"]) == list(their_optim["state"]), what
            assert our_optim["param_groups"] == their_optim["param_groups"], what
        for key, value in our_model.items():
            _assert_same_values(value, their_model[key], f"{what} model {key}")
        for name, entry in our_optim.get("state", {}).items():
            for key, value in entry.items():
                theirs = their_optim["state"][name][key]
                _assert_same_values(value, theirs, f"{what} optim {name}.{key}")
        assert FSDP.get_state_dict_type(ours).state_dict_type == FULL, "settings changed"
        # and back: into a fresh fsdp_lite model and optimizer, with other values
        fresh = _lm()
        fresh.load_state_dict(_plus(build_model("lm").state_dict(), 1.0))
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        sharded = StateDictOptions(full_state_dict=False)
        want_model, want_optim = get_state_dict(ours, optims["fsdp_lite"], options=sharded)
        if full_state_dict and cpu_offload:
            # Only rank 0 holds it: rank 0 broadcasts. Model only: torch's optimizer path with
            # an empty dict on the other ranks falls out of step with rank 0's broadcasts, for
            # FSDP2 and fsdp_lite alike.
            load_options = dataclasses.replace(options, broadcast_from_rank0=True)
            set_model_state_dict(fresh, dict(our_model), options=load_options)
            want_optim = None
        else:
            set_state_dict(  # it may replace values in the dicts it is given: hand it copies
                fresh,
                fresh_optim,
                model_state_dict=dict(our_model),
                optim_state_dict=copy.deepcopy(our_optim),
                options=options,
            )
        again_model, again_optim = get_state_dict(fresh, fresh_optim, options=sharded)
        for key, value in want_model.items():
            _assert_same_values(again_model[key], value, f"{what} set_state_dict {key}")
        if want_optim is None:
            continue
        for name, entry in want_optim["state"].items():
            for key, value in entry.items():
                mine = again_optim["state"][name][key]
                _assert_same_values(mine, value, f"{what} set_state_dict optim {name}.{key}")
        # torch's full-state path hands hyperparameters back as lists (betas): compare as lists
        as_lists = lambda groups: [
            {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups
        ]
        assert as_lists(again_optim["param_groups"]) == as_lists(want_optim["param_groups"]), what


def _check_dsd_overrides_the_settings_while_it_runs(rank, world_size, tmp):
    # Under any state_dict_type, torch's helper gets shards (as its own FSDP1 support does, by
    # entering state_dict_type itself); the settings are back in force afterwards.
    plain, model = build_model("lm"), _lm()
    for state_dict_type in (FULL, LOCAL, SHARDED):
        FSDP.set_state_dict_type(model, state_dict_type)
        got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
        for key, value in got.items():
            assert isinstance(value, DTensor), f"{state_dict_type.name}: {key}"
            want = shard_of(plain.state_dict()[key], rank, world_size)
            assert_close(value.to_local(), want, what=f"{state_dict_type.name} {key}", **EXACT)
        set_model_state_dict(model, {k: v + 1.0 for k, v in got.items()})
        assert FSDP.get_state_dict_type(model).state_dict_type == state_dict_type
        FSDP.set_state_dict_type(model, FULL)
        _assert_full_equal(model.state_dict(), _plus(plain.state_dict(), 1.0), "set")
        model.load_state_dict(plain.state_dict())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    _assert_full_equal(full, plain.state_dict(), "full_state_dict=True")


def _check_full_state_dict_memory(rank, world_size, tmp):
    """Peak extra memory of a rank0_only full save of an 8-unit model: about one unit."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    num_units, width = 8, 64
    model = FSDP(
        nn.Sequential(*[nn.Linear(width, width) for _ in range(num_units)]),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    unit_nbytes = (width * width + width) * 4  # one Linear's unsharded params, fp32
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, FULL, config):
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            full = model.state_dict()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    sharded_nbytes = sum(p.to_local().nbytes for p in model.parameters())
    output_nbytes = sum(v.nbytes for v in full.values())
    extra = peak["Total"] - sharded_nbytes - output_nbytes  # beyond shards and the result
    # One unit's all_gather_output plus this rank's all_gather_input (1/N unit): 1.5 units at 2
    # ranks. Sometimes twice that: gloo's worker thread drops its references to the previous
    # unit's buffers a moment after the call returned (about 1 save in 4 on a non-zero rank).
    one_unit = unit_nbytes + unit_nbytes // world_size
    assert one_unit <= extra <= 2 * one_unit, f"rank {rank}: extra {extra} bytes, unit {one_unit}"
    # For scale: unsharding the whole model at once (what a summon of every unit holds).
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, FSDP.summon_full_params(model, writeback=False):
        pass
    (summon_peak,) = tracker.get_tracker_snapshot("peak").values()
    return {
        "extra_nbytes": extra,
        "unit_nbytes": unit_nbytes,
        "num_units": num_units,
        "summon_all_extra_nbytes": summon_peak["Total"] - sharded_nbytes,
    }


CHECKS = [name[len("_check_") :] for name in dir() if name.startswith("_check_")]


def _all_checks_rank(rank: int, world_size: int, tmp: str) -> dict:
    outcomes = {}
    for name in CHECKS:
        try:
            outcomes[name] = ("ok", globals()[f"_check_{name}"](rank, world_size, tmp))
        except Exception:  # noqa: BLE001 - reported by the test named after the check
            outcomes[name] = ("failed", traceback.format_exc())
        dist.barrier()
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state_dict")
    return run_ranks(_all_checks_rank, 2, tmp, args=(str(tmp),), timeout=150)


@pytest.mark.parametrize("check", CHECKS)
def test_state_dict(outcomes, check):
    for rank, by_check in enumerate(outcomes):
        status, detail = by_check[check]
        assert status == "ok", f"rank {rank}, check {check}:\n{detail}"


def test_rank0_only_full_state_dict_peak_is_one_unit_not_the_model(outcomes):
    for rank, by_check in enumerate(outcomes):
        status, figure = by_check["full_state_dict_memory"]
        assert status == "ok", figure
        unit, model = figure["unit_nbytes"], figure["num_units"] * figure["unit_nbytes"]
        assert figure["extra_nbytes"] <= 3 * unit < model / 2, f"rank {rank}: {figure}"
        assert figure["summon_all_extra_nbytes"] >= model, f"rank {rank}: {figure}"
