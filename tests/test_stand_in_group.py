"""Wrapping on a process group stand-in (``rank()`` and ``size()`` only), beside torch FSDP1.

torch's test_wrap.py (TestAutoWrap) builds FSDP1 wrappers in one process with no process group,
passing ``DummyProcessGroup``; construct.py Note [Stand-in process groups]. Each case wraps the
same model with fsdp_lite and with torch FSDP1 on the same stand-in and compares which modules
became wrappers and what the wrappers say of their group; running refuses before any collective.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.fsdp as native
import torch.distributed.fsdp.wrap as native_wrap
import torch.nn as nn

import fsdp_lite
import fsdp_lite.wrap as lite_wrap
from fsdp_lite.fronts.construct import _check_stand_in


class StandIn:
    """What torch's tests pass: a rank and a size, no collectives."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5),
        nn.Sequential(nn.Linear(5, 5), nn.Linear(10, 10)), nn.MultiheadAttention(8, 2),
    )  # fmt: skip


POLICIES = {
    "none": lambda w: None,
    "always": lambda w: w.always_wrap_policy,
    "size_40": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=40),
    "module_linear": lambda w: w.ModuleWrapPolicy({nn.Linear}),
}


def _wrapped_paths(model: nn.Module, cls: type) -> list[str]:
    return [
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for name, m in model.named_modules()
        if isinstance(m, cls)
    ]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2), (2, 4)])
def test_wrapping_on_a_stand_in_as_torch_fsdp1(policy, rank, size):
    group = StandIn(rank, size)
    ignored = {"ignored_modules": None}
    for with_ignored in (False, True):
        built = {}
        for name, cls, wrap_mod, extra in (
            ("ours", fsdp_lite.FullyShardedDataParallel, lite_wrap, {}),
            ("torch", native.FullyShardedDataParallel, native_wrap, {"device_id": "cpu"}),
        ):
            model = _model()
            if with_ignored:
                ignored = {"ignored_modules": [model[1], model[2][0]]}
            built[name] = wrapped = cls(
                model, process_group=group, auto_wrap_policy=POLICIES[policy](wrap_mod),
                **ignored, **extra,
            )  # fmt: skip
            for w in cls.fsdp_modules(wrapped):
                assert w.process_group is group
                assert (w.rank, w.world_size) == (rank, size)
        assert _wrapped_paths(built["ours"], fsdp_lite.FullyShardedDataParallel) == (
            _wrapped_paths(built["torch"], native.FullyShardedDataParallel)
        )
        # Each rank holds its rows of each parameter, as on a real group of `size`.
        rows = -(-5 // size)
        first = built["ours"].module[0] if policy in ("always", "module_linear") else built["ours"]
        weight = next(p for p in first.parameters() if p.dim() == 2)
        assert weight.to_local().shape[0] == max(0, min(rows, 5 - rank * rows))


def test_enable_wrap_on_a_stand_in():
    """torch's test_wrap_override_defaults, test_wrap_disabled_outside_context: ``wrap`` inside
    ``enable_wrap`` takes the group given to either."""
    default, other = StandIn(0, 1), StandIn(0, 2)
    with lite_wrap.enable_wrap(
        wrapper_cls=fsdp_lite.FullyShardedDataParallel, process_group=default
    ):
        layer = lite_wrap.wrap(nn.Linear(5, 5), process_group=other)
        plain = lite_wrap.wrap(nn.Linear(5, 5))
    assert layer.process_group is other and (layer.rank, layer.world_size) == (0, 2)
    assert plain.process_group is default and plain.world_size == 1
    assert isinstance(lite_wrap.wrap(nn.Linear(5, 5), process_group=other), nn.Linear)


def test_running_a_stand_in_wrapper_is_refused_before_any_collective():
    wrapped = fsdp_lite.FullyShardedDataParallel(_model()[0], process_group=StandIn(0, 2))
    for run in (
        lambda: wrapped(torch.ones(2, 5)),
        wrapped.state_dict,
        lambda: fsdp_lite.FullyShardedDataParallel.summon_full_params(wrapped).__enter__(),
        lambda: wrapped.clip_grad_norm_(1.0),
    ):
        with pytest.raises(RuntimeError, match="a stand-in with rank\\(\\) and size\\(\\) but no"):
            run()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sync_module_states": True},
        {"cpu_offload": fsdp_lite.CPUOffload(offload_params=True, offload_dir="/tmp")},
        {"sharding_strategy": fsdp_lite.ShardingStrategy.HYBRID_SHARD},
    ],
)
def test_stand_in_refuses_what_needs_other_ranks(kwargs):
    with pytest.raises(ValueError, match="needs the other ranks at construction"):
        fsdp_lite.FullyShardedDataParallel(nn.Linear(5, 5), process_group=StandIn(0, 2), **kwargs)


def test_stand_in_with_a_rank_out_of_range():
    kw = {"sync_module_states": False, "cpu_offload": None}
    with pytest.raises(ValueError, match="need 0 <= rank < size"):
        _check_stand_in(StandIn(2, 2), kw, hybrid=False)
