"""What torch FSDP1's own tests and client code read off the wrapper, beside torch FSDP1 in one run.

torch's public instance attributes (``sharding_strategy``, ``cpu_offload``, ``mixed_precision``,
``rank``, ``process_group``...), ``clip_grad_norm_``'s return dtype and its warning on a rank with
no gradients, and ``device_id`` given as a string, as torch's tests pass it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as native
import torch.nn as nn

import fsdp_lite
from tests.ranks import run_checks, run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _both(**kwargs):
    """The same arguments to fsdp_lite's wrapper and to torch FSDP1's (the classes by name)."""
    ours = fsdp_lite.FullyShardedDataParallel(_net(), **kwargs)
    theirs_kwargs = {
        k: getattr(native, type(v).__name__)(**vars(v)) if k in ("mixed_precision", "cpu_offload")
        else getattr(native, type(v).__name__)[v.name] if hasattr(v, "name") and not isinstance(v, str)
        else v
        for k, v in kwargs.items()
    }  # fmt: skip
    theirs = native.FullyShardedDataParallel(_net(), device_id=torch.device("cpu"), **theirs_kwargs)
    return ours, theirs


def _fields(mp) -> dict:
    return {f: getattr(mp, f) for f in ("param_dtype", "reduce_dtype", "buffer_dtype",
                                        "keep_low_precision_grads", "cast_forward_inputs",
                                        "cast_root_forward_inputs")}  # fmt: skip


def check_public_attributes(rank: int, world_size: int) -> None:
    for kwargs in (
        {},
        {
            "sharding_strategy": fsdp_lite.ShardingStrategy.SHARD_GRAD_OP,
            "mixed_precision": fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16),
            "backward_prefetch": fsdp_lite.BackwardPrefetch.BACKWARD_POST,
            "forward_prefetch": True,
        },
    ):
        ours, theirs = _both(**kwargs)
        assert ours.sharding_strategy.name == theirs.sharding_strategy.name
        assert ours.cpu_offload.offload_params == theirs.cpu_offload.offload_params
        assert ours.backward_prefetch.name == theirs.backward_prefetch.name
        # fsdp_lite prefetches in forward unless told not to (its docstring says why); the
        # attribute says what runs: True by default, torch's False.
        assert ours.forward_prefetch == kwargs.get("forward_prefetch", True)
        assert theirs.forward_prefetch == kwargs.get("forward_prefetch", False)
        assert _fields(ours.mixed_precision) == _fields(theirs.mixed_precision), kwargs
        assert (
            (ours.rank, ours.world_size) == (theirs.rank, theirs.world_size) == (rank, world_size)
        )
        assert dist.get_process_group_ranks(ours.process_group) == dist.get_process_group_ranks(
            theirs.process_group
        )
        assert ours.compute_device == theirs.compute_device == torch.device("cpu")
        assert [p.shape for p in ours.params] == [(6, 4), (6,), (2, 6), (2,)]


def check_clip_grad_norm_dtype_and_warning(rank: int, world_size: int) -> None:
    """fp16 gradients: the norm in fp16, as torch's; a rank without gradients warns (torch's
    words) and returns float32."""
    for cls in (fsdp_lite.FullyShardedDataParallel, native.FullyShardedDataParallel):
        extra = (
            {} if cls is fsdp_lite.FullyShardedDataParallel else {"device_id": torch.device("cpu")}
        )
        model = cls(_net().half(), use_orig_params=True, **extra)
        model(torch.ones(3, 4, dtype=torch.float16)).sum().backward()
        assert model.clip_grad_norm_(1.0).dtype == torch.float16, cls
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            norm = model.clip_grad_norm_(1.0)
        assert norm.dtype == torch.float32, cls
        assert any(
            f"Called FSDP.clip_grad_norm_() on rank {rank} with no gradients" in str(w.message)
            for w in caught
        ), (cls, [str(w.message) for w in caught])


def check_device_id_as_string(rank: int, world_size: int) -> None:
    """torch's tests pass ``device_id="cpu"`` (and "cuda" on GPUs): taken as torch.device takes it."""
    by_string = fsdp_lite.FullyShardedDataParallel(_net(), device_id="cpu")
    by_device = fsdp_lite.FullyShardedDataParallel(_net(), device_id=torch.device("cpu"))
    assert by_string.compute_device == by_device.compute_device == torch.device("cpu")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    assert torch.equal(by_string(x), by_device(x))
    with pytest.raises(TypeError, match="device_id must be an int, a str or a torch.device"):
        fsdp_lite.FullyShardedDataParallel(_net(), device_id=["cpu"])


def check_ignored_modules_refuses_parameters(rank: int, world_size: int) -> None:
    """torch's class and words (its test_fsdp_ignored_modules asserts them)."""
    model = _net()
    for cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, {}),
        (native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
    ):
        with pytest.raises(ValueError, match="ignored_modules expects nn.Module list elements"):
            cls(model, ignored_modules=[model[0].weight], **extra)
        with pytest.raises(ValueError, match="Cannot pass both ignored_modules and ignored_states"):
            cls(model, ignored_modules=[model[0]], ignored_states=[model[2].weight], **extra)


def check_summon_or_apply_out_of_idle(rank: int, world_size: int) -> None:
    """``apply`` inside ``summon_full_params`` (torch's ValueError, which its test_fsdp_apply
    matches), a summon inside a summon or inside forward (torch 2.13's AssertionErrors): the same
    class and words from both wrappers."""

    class SummonsInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, wrapper):
            with type(wrapper).summon_full_params(wrapper):
                pass
            return self.lin(x)

    for cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, {}),
        (native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
    ):
        model = cls(_net(), **extra)
        with cls.summon_full_params(model):
            with pytest.raises(ValueError, match="expected to be in states"):
                model.apply(lambda m: None)
            with pytest.raises(AssertionError, match="when already unsharding parameters"):
                with cls.summon_full_params(model):
                    pass
        model.apply(lambda m: None)  # idle again afterwards
        inner = cls(SummonsInForward(), **extra)
        with pytest.raises(AssertionError, match="during forward/backward"):
            inner(torch.ones(2, 4), inner)


def check_ranks_ignoring_different_modules(rank: int, world_size: int) -> None:
    """Ranks whose ignored modules differ (here in number) build and train, as with torch FSDP1
    (its test_diff_ignored_modules_across_ranks); the parameters they share stay equal."""
    torch.manual_seed(0)
    extra = [nn.Linear(4, 4, bias=False) for _ in range(rank + 1)]
    body = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    last = nn.Linear(4, 4)  # after the ignored ones: '2.weight' on rank 0, '3.weight' on rank 1
    model = nn.Sequential(body, *extra, last)
    wrapped = fsdp_lite.FullyShardedDataParallel(model, ignored_modules=extra)
    optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    wrapped(x).sum().backward()
    optim.step()
    with fsdp_lite.FullyShardedDataParallel.summon_full_params(wrapped):
        shared = torch.cat([p.detach().reshape(-1) for m in (body, last) for p in m.parameters()])
    everyone = [torch.empty_like(shared) for _ in range(world_size)]
    dist.all_gather(everyone, shared)
    assert all(torch.equal(everyone[0], t) for t in everyone)


def check_ignoring_the_wrapped_module_warns(rank: int, world_size: int) -> None:
    """torch FSDP1's warning and words (its test_ignored_modules_invalid matches them)."""
    for cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, {}),
        (native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
    ):
        model = _net()
        with pytest.warns(UserWarning, match="Trying to ignore the top-level module passed into"):
            cls(model, ignored_modules=[model], **extra)


def check_ignored_module_outside_the_wrapped_one(rank: int, world_size: int) -> None:
    """One list of ignored modules given to two wrappers, each holding some of them: taken by both
    classes (torch's test_ignored_modules_not_under_wrapped_root), and training runs."""
    for cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, {}),
        (native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
    ):
        model = nn.Sequential(_net(), nn.Linear(2, 2), nn.Linear(2, 2))
        ignored = [model[0][2], model[1]]
        model[0] = cls(model[0], ignored_modules=ignored, **extra)
        model[2] = cls(model[2], ignored_modules=ignored, **extra)
        model(torch.ones(3, 4)).sum().backward()
        assert model[1].weight.grad is not None


def check_non_root_refusals_in_torchs_words(rank: int, world_size: int) -> None:
    """``clip_grad_norm_()`` and ``no_sync()`` on a nested unit: torch FSDP1's class and words
    (its test_non_root in test_fsdp_clip_grad_norm matches them)."""
    said = []
    for cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, {}),
        (native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
    ):
        model = _net()
        model[2] = cls(model[2], **extra)
        wrapped = cls(model, **extra)
        wrapped(torch.ones(2, 4)).sum().backward()
        inner = wrapped.module[2]
        with pytest.raises(RuntimeError) as info:
            inner.clip_grad_norm_(2.0)
        said.append(str(info.value))
        with pytest.raises(RuntimeError) as info:
            inner.no_sync().__enter__()
        said.append(str(info.value))
    assert said[:2] == said[2:], said


def check_param_init_fn_not_callable_as_torch(rank: int, world_size: int) -> None:
    """``param_init_fn=42`` on a meta-device module: torch FSDP1's ValueError, whose words
    ("to be callable") its test_bad_arg_meta matches."""
    for cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, {}),
        (native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}),
    ):
        with pytest.raises(ValueError, match="to be callable"):
            cls(nn.Linear(2, 2, device="meta"), param_init_fn=42, **extra)


def check_mixed_precision_kept_classes_warn_as_torch(rank: int, world_size: int) -> None:
    """BatchNorm (``MixedPrecision._module_classes_to_ignore``) under mixed precision and a
    policy: both wrap it in full precision and warn in torch's words (its test_mp_batchnorm
    matches "These modules will be wrapped as separate FSDP"); a model without one: no warning."""
    for cls, mp_cls, extra in (
        (fsdp_lite.FullyShardedDataParallel, fsdp_lite.MixedPrecision, {}),
        (native.FullyShardedDataParallel, native.MixedPrecision, {"device_id": "cpu"}),
    ):
        mp = mp_cls(param_dtype=torch.float16)
        for model, warns in (
            (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), True),
            (_net(), False),
        ):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                wrapped = cls(model, mixed_precision=mp, auto_wrap_policy=lambda *a, **k: False,
                              **extra)  # fmt: skip
            said = [str(w.message) for w in seen if "wrapped as separate FSDP" in str(w.message)]
            assert bool(said) == warns, (cls, said)
            if warns:
                assert isinstance(wrapped.module[1], cls)
                assert wrapped.module[1].mixed_precision == mp_cls()
                assert wrapped.mixed_precision == mp


CHECKS = {
    "public_attributes": check_public_attributes,
    "clip_grad_norm_dtype_and_warning": check_clip_grad_norm_dtype_and_warning,
    "device_id_as_string": check_device_id_as_string,
    "ignored_modules_refuses_parameters": check_ignored_modules_refuses_parameters,
    "summon_or_apply_out_of_idle": check_summon_or_apply_out_of_idle,
    "ranks_ignoring_different_modules": check_ranks_ignoring_different_modules,
    "ignoring_the_wrapped_module_warns": check_ignoring_the_wrapped_module_warns,
    "ignored_module_outside_the_wrapped_one": check_ignored_module_outside_the_wrapped_one,
    "non_root_refusals_in_torchs_words": check_non_root_refusals_in_torchs_words,
    "param_init_fn_not_callable_as_torch": check_param_init_fn_not_callable_as_torch,
    "mixed_precision_kept_classes_warn_as_torch": check_mixed_precision_kept_classes_warn_as_torch,
}


def _rank(rank: int, world_size: int) -> dict[str, str]:
    return run_checks(CHECKS, list(CHECKS), rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("fsdp1_surface"), timeout=120)


@pytest.mark.parametrize("check", list(CHECKS))
def test_fsdp1_surface_as_torch(results, check):
    for rank, failures in enumerate(results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"
