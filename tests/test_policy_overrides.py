"""Per-unit arguments from a ``CustomPolicy`` reach the unit they were given for, as in torch FSDP1.

torch FSDP1 builds every nested unit as an FSDP instance of its own, so each argument a policy's
dict returns applies to that unit. Arguments torch needs equal on all units (``use_orig_params``,
``limit_all_gathers``), or that fsdp_lite builds once (process groups, the device), raise at
construction and name the argument and the submodule. Policies here are torch's ``CustomPolicy``
or fsdp_lite's, with torch's config objects or fsdp_lite's, as clients write them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import wrap as torch_wrap

from conformance.models import Block
from fsdp_lite import BackwardPrefetch, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import wrap as lite_wrap
from fsdp_lite.engine.unit import ShardedUnit
from tests.parity import build_model, loss_fn, rank_batch, train_lm
from tests.ranks import run_ranks

CPU = torch.device("cpu")


def _blocks_policy(wrap_module, overrides_for):
    """Wrap each Block; ``overrides_for(model)`` maps some modules to their kwargs dict."""

    def make(model):
        chosen = overrides_for(model)
        return wrap_module.CustomPolicy(lambda m: chosen.get(m, isinstance(m, Block)))

    return make


def _ignored_module_goes_to_the_parent(rank, world_size):
    """blocks.1.fc ignored by blocks.1's unit: the root's unit takes it, as native FSDP1's does;
    a training step is bitwise native FSDP1's."""
    states = {}
    for name, fsdp_cls, wrap_module, extra in (
        ("native", torch_fsdp.FullyShardedDataParallel, torch_wrap, {"device_id": CPU}),
        ("lite", FSDP, lite_wrap, {}),
    ):
        model = build_model("lm")
        policy = _blocks_policy(
            wrap_module, lambda m: {m.blocks[1]: {"ignored_states": [m.blocks[1].fc]}}
        )(model)
        fsdp = fsdp_cls(model, auto_wrap_policy=policy, use_orig_params=True, **extra)
        train_lm(fsdp, rank, world_size, steps=2, lr=0.1)
        if name == "lite":
            fc = model.blocks[1]._fsdp_wrapped_module.fc.weight
            assert not any(fc is p.sharded_param for p in model.blocks[1]._unit.params)
            assert any(fc is p.sharded_param for p in fsdp._unit.params), "root did not take it"
        with fsdp_cls.state_dict_type(fsdp, torch_fsdp.StateDictType.FULL_STATE_DICT):
            states[name] = fsdp.state_dict()
    for key, value in states["native"].items():
        torch.testing.assert_close(states["lite"][key], value, rtol=0, atol=0, msg=key)


def _ignored_modules_override_is_refused_as_native_does(rank, world_size):
    """A policy's ``ignored_modules`` for a nested unit: torch FSDP1 raises (it refuses
    ignored_modules beside the ignored_states it passes on); fsdp_lite raises the same error,
    naming the submodule, instead of letting the parent shard the module."""
    errors = {}
    for name, fsdp_cls, wrap_module, extra in (
        ("native", torch_fsdp.FullyShardedDataParallel, torch_wrap, {"device_id": CPU}),
        ("lite", FSDP, lite_wrap, {}),
    ):
        model = build_model("lm")
        policy = _blocks_policy(
            wrap_module, lambda m: {m.blocks[1]: {"ignored_modules": [m.blocks[1].fc]}}
        )(model)
        with pytest.raises(ValueError) as raised:
            fsdp_cls(model, auto_wrap_policy=policy, use_orig_params=True, **extra)
        errors[name] = str(raised.value)
    assert errors["native"] in errors["lite"], errors
    assert "'blocks.1'" in errors["lite"], errors


def _manually_nested_ignored_module_stays_unmanaged(rank, world_size):
    """A unit wrapped by hand with ``ignored_modules``, then its parent: the parent leaves the
    module alone too (native FSDP1 counts a nested FSDP's ignored modules as its own), so its
    parameters keep local gradients; two training steps bitwise native FSDP1's."""
    states = {}
    for name, fsdp_cls, extra in (
        ("native", torch_fsdp.FullyShardedDataParallel, {"device_id": CPU}),
        ("lite", FSDP, {}),
    ):
        model = build_model("lm")
        fc = model.blocks[1].fc
        model.blocks[1] = fsdp_cls(
            model.blocks[1], ignored_modules=[fc], use_orig_params=True, **extra
        )
        fsdp = fsdp_cls(model, use_orig_params=True, **extra)
        if name == "lite":
            managed = {id(p.sharded_param) for w in FSDP.fsdp_modules(fsdp) for p in w._unit.params}
            assert id(fc.weight) not in managed and id(fc.bias) not in managed, "fc was sharded"
        train_lm(fsdp, rank, world_size, steps=2, lr=0.1)
        with fsdp_cls.state_dict_type(fsdp, torch_fsdp.StateDictType.FULL_STATE_DICT):
            states[name] = fsdp.state_dict()
    assert states["lite"].keys() == states["native"].keys()
    for key, value in states["native"].items():
        torch.testing.assert_close(states["lite"][key], value, rtol=0, atol=0, msg=key)


def _prefetch_overrides_apply_per_unit(rank, world_size):
    """Root without forward prefetch, blocks.0 with it: only blocks.0's forward prefetches;
    blocks.1 with BACKWARD_POST, the rest BACKWARD_PRE (torch's objects, mapped by name)."""
    model = build_model("lm")
    policy = _blocks_policy(
        torch_wrap,
        lambda m: {
            m.blocks[0]: {"forward_prefetch": True},
            m.blocks[1]: {"backward_prefetch": torch_fsdp.BackwardPrefetch.BACKWARD_POST},
        },
    )(model)
    fsdp = FSDP(model, auto_wrap_policy=policy, forward_prefetch=False)
    assert fsdp.blocks[1]._unit.settings.backward_prefetch == BackwardPrefetch.BACKWARD_POST
    assert fsdp._unit.settings.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
    prefetched = []
    original = ShardedUnit.unshard

    def spy(self, phase, async_op=False):
        if async_op and self.needs_unshard():
            prefetched.append((phase, self.name))
        return original(self, phase, async_op)

    ShardedUnit.unshard = spy
    try:
        for step in range(2):
            x, y = rank_batch("lm", step, rank, world_size)
            loss_fn("lm", fsdp(x), y).backward()
    finally:
        ShardedUnit.unshard = original
    forward = [u for phase, u in prefetched if phase == "forward"]
    # Step 1 knows the order: blocks.0's pre-forward prefetches blocks.1, nobody else prefetches.
    assert forward == ["blocks.1"], prefetched


def _strategy_and_precision_overrides(rank, world_size):
    model = build_model("lm")
    policy = _blocks_policy(
        torch_wrap,
        lambda m: {
            m.blocks[0]: {"sharding_strategy": torch_fsdp.ShardingStrategy.SHARD_GRAD_OP},
            m.blocks[1]: {"mixed_precision": torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)},
        },
    )(model)
    fsdp = FSDP(model, auto_wrap_policy=policy)
    assert fsdp.blocks[0]._config.strategy == ShardingStrategy.SHARD_GRAD_OP
    assert fsdp.blocks[1]._unit.precision.param_dtype == torch.bfloat16
    assert fsdp._unit.precision.param_dtype is None


def _sync_and_init_overrides(rank, world_size):
    """sync_module_states for blocks.0 only; param_init_fn for blocks.1 only (meta init)."""

    def initialized(seed):  # rank-dependent weights: only a broadcast makes them rank 0's
        model = build_model("lm")
        for p in model.parameters():
            torch.nn.init.normal_(p.data, generator=torch.Generator().manual_seed(seed))
        return model

    model = initialized(rank)
    policy = lite_wrap.CustomPolicy(
        lambda m: {"sync_module_states": True} if m is model.blocks[0] else isinstance(m, Block)
    )
    fsdp = FSDP(model, auto_wrap_policy=policy)
    state, rank0 = fsdp.state_dict(), initialized(0).state_dict()
    # A full tensor gathers every rank's rows: all rank 0's only where rank 0's were broadcast.
    assert torch.equal(state["blocks.0.qkv.weight"], rank0["blocks.0.qkv.weight"]), "not synced"
    assert not torch.equal(state["ln_f.weight"], rank0["ln_f.weight"]), "root synced unasked"

    with torch.device("meta"):
        meta_model = build_model("lm")

    def fill(module):
        for p in module.parameters(recurse=False):
            p.data.fill_(0.25)

    policy = lite_wrap.CustomPolicy(
        lambda m: {"param_init_fn": fill} if m is meta_model.blocks[1] else isinstance(m, Block)
    )
    fsdp = FSDP(meta_model, auto_wrap_policy=policy, device_id=CPU)
    state = fsdp.state_dict()
    assert torch.all(state["blocks.1.qkv.weight"] == 0.25)
    assert not torch.all(state["blocks.0.qkv.weight"] == 0.25)


CHECKS = {
    "ignored_states": _ignored_module_goes_to_the_parent,
    "ignored_modules": _ignored_modules_override_is_refused_as_native_does,
    "manually_nested_ignored": _manually_nested_ignored_module_stays_unmanaged,
    "prefetch": _prefetch_overrides_apply_per_unit,
    "strategy_and_precision": _strategy_and_precision_overrides,
    "sync_and_init": _sync_and_init_overrides,
}


def _checks_rank(rank, world_size):
    failures = {}
    for name, check in CHECKS.items():
        try:
            check(rank, world_size)
        except AssertionError as e:
            failures[name] = str(e)
    return failures


@pytest.fixture(scope="module")
def check_results(tmp_path_factory):
    return run_ranks(_checks_rank, 2, tmp_path_factory.mktemp("overrides"), timeout=180)


@pytest.mark.parametrize("check", list(CHECKS))
def test_custom_policy_override_reaches_its_unit(check_results, check):
    for rank, failures in enumerate(check_results):
        assert check not in failures, f"rank {rank}: {failures[check]}"


BAD_OVERRIDES = {
    "use_orig_params": (True, ValueError, "torch FSDP requires one value for all units"),
    "limit_all_gathers": (False, ValueError, "torch FSDP requires one value for all units"),
    "process_group": ("group", NotImplementedError, "units on other process groups"),
    "device_id": (torch.device("cpu", 1), NotImplementedError, "every unit computes on the root"),
}


def _bad_override_rank(rank, world_size):
    seen = {}
    for arg, (value, _, _) in BAD_OVERRIDES.items():
        if value == "group":
            value = dist.new_group([0, 1])
        model = build_model("lm")
        policy = torch_wrap.CustomPolicy(
            lambda m, v=value, a=arg, b=model.blocks[1]: {a: v} if m is b else isinstance(m, Block)
        )
        try:
            FSDP(model, auto_wrap_policy=policy)
            seen[arg] = ("no error", "")
        except Exception as e:
            seen[arg] = (type(e).__name__, str(e))
    return seen


@pytest.mark.parametrize("arg", list(BAD_OVERRIDES))
def test_override_that_cannot_apply_to_one_unit_raises_naming_it(tmp_path, arg):
    _, error, message = BAD_OVERRIDES[arg]
    for seen in run_ranks(_bad_override_rank, 2, tmp_path, timeout=120):
        name, text = seen[arg]
        assert name == error.__name__, f"{arg}: {name}: {text}"
        assert message in text and "'blocks.1'" in text, text
