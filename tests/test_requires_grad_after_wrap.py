"""``requires_grad`` set on wrapped parameters after wrapping, beside torch FSDP1 in one run.

torch FSDP1 follows the flag at the next forward (runtime.py Note [requires_grad after
wrapping]): a parameter frozen after wrapping gets no gradient and does not move, one unfrozen
trains from then on. Each case trains the same model with fsdp_lite and with torch FSDP1
(``device_id=cpu``) on 2 gloo ranks, changing flags between steps, and compares every parameter
after every step bitwise; frozen values must stay put bit for bit, trainable ones must move.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as native
import torch.nn as nn

import fsdp_lite
from tests.ranks import run_checks, run_ranks

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)),
        nn.ReLU(), nn.Linear(16, 4),
    )  # fmt: skip


def _wrap(ours: bool, strategy: str, use_orig_params: bool, freeze_before: list[str]):
    """The model with its block [2] a unit of its own inside the root unit."""
    model = _model()
    for name, p in model.named_parameters():
        p.requires_grad = name not in freeze_before
    if ours:
        cls, kwargs = fsdp_lite.FullyShardedDataParallel, {}
        kwargs["sharding_strategy"] = fsdp_lite.ShardingStrategy[strategy]
    else:
        cls, kwargs = native.FullyShardedDataParallel, {"device_id": torch.device("cpu")}
        kwargs["sharding_strategy"] = native.ShardingStrategy[strategy]
    kwargs["use_orig_params"] = use_orig_params
    model[2] = cls(model[2], **kwargs)
    return cls(model, **kwargs)


def _full(wrapped, ours: bool) -> dict[str, torch.Tensor]:
    cls = fsdp_lite.FullyShardedDataParallel if ours else native.FullyShardedDataParallel
    with cls.summon_full_params(wrapped):
        return {
            name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for name, p in wrapped.named_parameters()
        }


def _train(ours: bool, strategy: str, use_orig_params: bool, case: dict) -> list[dict]:
    wrapped = _wrap(ours, strategy, use_orig_params, case.get("before", []))
    optim = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1 + dist.get_rank())
    inputs = [torch.randn(3, 8) for _ in range(STEPS)]
    history = [_full(wrapped, ours)]
    for step, x in enumerate(inputs):
        for module_path, flag in case.get(step, []):
            # The parameters as the wrapped model shows them: torch's flat parameter with
            # use_orig_params=False, the original ones (sharded) otherwise and in fsdp_lite.
            target = wrapped.get_submodule(module_path)
            for p in target.parameters():
                p.requires_grad = flag
        optim.zero_grad()
        wrapped(x).square().sum().backward()
        optim.step()
        history.append(_full(wrapped, ours))
    return history


# step -> [(module path in the wrapped model, requires_grad)], set before that step's forward.
CASES = {
    # The nested unit frozen whole after wrapping (torch's test_freezing_weights does this).
    "freeze_nested_unit": {1: [("_fsdp_wrapped_module.2", False)]},
    # Frozen, then trained again.
    "freeze_then_unfreeze": {
        1: [("_fsdp_wrapped_module.2", False)],
        3: [("_fsdp_wrapped_module.2", True)],
    },
    # Wrapped frozen (so no gradient hook at wrapping), unfrozen after the first step.
    "unfreeze_wrapped_frozen": {
        "before": ["2.0.weight", "2.0.bias", "2.1.weight", "2.1.bias"],
        1: [("_fsdp_wrapped_module.2", True)],
    },
}
# One parameter of a unit frozen beside trainable ones: torch takes that with use_orig_params.
ORIG_ONLY_CASES = {
    "freeze_one_parameter_of_a_unit": {
        0: [("_fsdp_wrapped_module.2._fsdp_wrapped_module.0", False)],
        2: [("_fsdp_wrapped_module.2._fsdp_wrapped_module.0", True)],
    },
    "freeze_the_root_units_own": {1: [("_fsdp_wrapped_module.0", False)]},
}


def _frozen_at(case: dict, step: int) -> set[str]:
    """Names (unwrapped) of the parameters frozen during ``step``."""
    names = {n for n, _ in _model().named_parameters()}
    frozen = set(case.get("before", []))
    for s in range(step + 1):
        for path, flag in case.get(s, []):
            prefix = path.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
            hit = {n for n in names if n.startswith(prefix.rstrip(".") + ".")}
            frozen = frozen - hit if flag else frozen | hit
    return frozen


def check_case(rank: int, world_size: int, name: str) -> None:
    case = {**CASES, **ORIG_ONLY_CASES}[name]
    modes = (True,) if name in ORIG_ONLY_CASES else (False, True)
    for use_orig_params in modes:
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            ours = _train(True, strategy, use_orig_params, case)
            theirs = _train(False, strategy, use_orig_params, case)
            where = f"{strategy}, use_orig_params={use_orig_params}"
            for step in range(STEPS):
                frozen = _frozen_at(case, step)
                for key, value in ours[step + 1].items():
                    assert torch.equal(value, theirs[step + 1][key]), (
                        f"{where}: {key} after step {step} differs from torch FSDP1's "
                        f"by {(value - theirs[step + 1][key]).abs().max():.3e}"
                    )
                    moved = not torch.equal(value, ours[step][key])
                    assert moved == (key not in frozen), (
                        f"{where}: {key} {'moved' if moved else 'did not move'} in step {step}"
                    )


def _rank(rank: int, world_size: int) -> dict[str, str]:
    checks = {n: (lambda r, w, n=n: check_case(r, w, n)) for n in {**CASES, **ORIG_ONLY_CASES}}
    return run_checks(checks, list(checks), rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("requires_grad_after_wrap"), timeout=300)


@pytest.mark.parametrize("case", [*CASES, *ORIG_ONLY_CASES])
def test_requires_grad_after_wrapping_as_torch_fsdp1(results, case):
    for rank, failures in enumerate(results):
        assert case not in failures, f"rank {rank}:\n{failures[case]}"
