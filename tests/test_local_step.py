"""Optimizer steps on local shards (engine/local_step.py, Note [Optimizer steps on local shards]):
the same bits and the same visible state as stepping the DTensors, and never where someone could
tell. The reference in each check is the same optimizer made a subclass, which the local step
leaves alone (only exact types are stepped locally), so DTensor's dispatch steps it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_lite
from fsdp_lite.engine import local_step
from tests.ranks import run_ranks

OPTIMIZERS = {
    "SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "AdamW_fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.01)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=1)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 7 rows: uneven shards at 2 ranks (rank 1 holds 3 rows of the first Linear).
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp_lite.fully_shard(layer)
    return fsdp_lite.fully_shard(model)


def _train(optim_type: type, kwargs: dict, rank: int, steps: int = 3):
    model = _model()
    optim = optim_type(model.parameters(), **kwargs)
    for step in range(steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _state_view(model: nn.Module, optim: torch.optim.Optimizer) -> list:
    """What a user sees of the optimizer: its state, in order, by parameter position."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    view = []
    for p, state in optim.state.items():
        entries = []
        for key, value in state.items():
            if isinstance(value, DTensor):
                entries.append((key, "DTensor", value.placements, value.to_local().tolist()))
            elif isinstance(value, torch.Tensor):
                entries.append((key, "Tensor", tuple(value.shape), value.tolist()))
            else:
                entries.append((key, type(value).__name__, value))
        view.append((position[id(p)], entries))
    return view


def _same_as_dtensor_steps(rank: int, world_size: int) -> dict:
    out = {}
    for name, (optim_type, kwargs) in OPTIMIZERS.items():
        model, optim = _train(optim_type, kwargs, rank)
        reference_type = type(optim_type.__name__, (optim_type,), {})  # not stepped locally
        ref_model, ref_optim = _train(reference_type, kwargs, rank)
        params = [p.to_local().tolist() for p in model.parameters()]
        ref_params = [p.to_local().tolist() for p in ref_model.parameters()]
        out[name] = {
            "params_equal": params == ref_params,
            "state_equal": _state_view(model, optim) == _state_view(ref_model, ref_optim),
            "state_dict_keys": list(optim.state_dict()["state"])
            == list(ref_optim.state_dict()["state"]),
            "groups_hold_the_params": all(
                a is b
                for a, b in zip(optim.param_groups[0]["params"], model.parameters(), strict=True)
            ),
        }
    return out


def test_every_elementwise_optimizer_gives_the_bits_and_state_of_the_dtensor_steps(tmp_path):
    for rank, seen in enumerate(run_ranks(_same_as_dtensor_steps, 2, tmp_path, timeout=120)):
        for name, checks in seen.items():
            assert all(checks.values()), (rank, name, checks)


def _train_with_closure(optim_type: type, rank: int) -> tuple[list, bool]:
    """Lightning's loop: forward, backward and a clip inside ``optimizer.step(closure)``."""
    model = _model()
    optim = optim_type(model.parameters(), lr=1e-2)
    seen = []

    def closure(x: torch.Tensor) -> torch.Tensor:
        optim.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        params = optim.param_groups[0]["params"]
        seen.append(all(isinstance(p.grad, DTensor) for p in params))
        torch.nn.utils.clip_grad_value_(params, 0.01)
        return loss

    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        optim.step(lambda x=x: closure(x))
    return [p.to_local().tolist() for p in model.parameters()], all(seen)


def _with_closure(rank: int, world_size: int) -> dict:
    reference = type("AdamW", (torch.optim.AdamW,), {})
    return {
        "local": _train_with_closure(torch.optim.AdamW, rank),
        "dtensor": _train_with_closure(reference, rank),
    }


def test_a_step_with_a_closure_keeps_the_dtensors(tmp_path):
    for seen in run_ranks(_with_closure, 2, tmp_path, timeout=60):
        assert seen["local"][1] and seen["dtensor"][1], seen  # the closure saw DTensor grads
        assert seen["local"][0] == seen["dtensor"][0], seen


def _nobody_can_tell(rank: int, world_size: int) -> dict:
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen_by_hook = []
    optim.register_step_post_hook(
        lambda o, args, kwargs: seen_by_hook.extend(
            type(p).__name__ for p in o.param_groups[0]["params"]
        )
    )
    model(torch.ones(2, 5)).sum().backward()
    optim.step()
    # A step that raises inside (a bad lr) after the swap: the state is back before state_dict.
    raising = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 5)).sum().backward()
    raising.step()
    raising.param_groups[0]["lr"] = "not a number"
    try:
        raising.step()
        raised = None
    except TypeError as e:
        raised = str(e)
    keys_after = [type(k).__name__ for k in raising.state]
    raising.state_dict()
    keys_after_state_dict = [type(k).__name__ for k in raising.state]
    return {
        "hook_saw": sorted(set(seen_by_hook)),
        "raised": raised is not None,
        "keys_after_raise": keys_after,
        "keys_after_state_dict": keys_after_state_dict,
        # torch's private per-optimizer hook dicts local_step reads (pinned here).
        "private_names": isinstance(optim._optimizer_step_pre_hooks, dict)
        and isinstance(optim._optimizer_step_post_hooks, dict),
        "world_size": dist.get_world_size(),
    }


def test_an_optimizer_with_hooks_steps_dtensors_and_a_raising_step_is_undone(tmp_path):
    for seen in run_ranks(_nobody_can_tell, 2, tmp_path, timeout=60):
        assert seen["hook_saw"] == ["DTensor"], seen  # its own hook: never stepped locally
        assert seen["raised"], seen
        assert set(seen["keys_after_raise"]) == {"Tensor"}, seen  # the swap the raise left
        assert set(seen["keys_after_state_dict"]) == {"DTensor"}, seen  # undone first
        assert seen["private_names"], seen


def _rprop(rank: int, world_size: int) -> list:
    model, _ = _train(torch.optim.Rprop, dict(lr=1e-2), rank)
    return [p.to_local().tolist() for p in model.parameters()]


def test_rprop_steps_locally_where_dtensor_cannot(tmp_path):
    """Rprop's ``sign[sign.gt(0)] = etaplus`` has no DTensor strategy in torch 2.13 (index_put_
    on a Shard(0) DTensor raises), so torch FSDP2 cannot step it; on local shards it runs, and
    equals Rprop on a plain model bitwise (the ranks' rows put together)."""
    shards = run_ranks(_rprop, 2, tmp_path, timeout=60)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    optim = torch.optim.Rprop(plain.parameters(), lr=1e-2)
    for step in range(3):
        loss = 0
        for rank in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = loss + plain(x).square().mean() / 2
        loss.backward()
        optim.step()
        optim.zero_grad()
    for i, p in enumerate(plain.parameters()):
        got = torch.tensor(shards[0][i] + shards[1][i]).reshape(p.shape)
        assert torch.equal(got, p.detach()), (got - p.detach()).abs().max()


def _grads_like_from_local(rank: int, world_size: int) -> list:
    """Every gradient fsdp_lite lands (param.dtensor_like, torch's private DTensor constructor
    and ``_spec``) against the DTensor ``from_local`` makes of the same local tensor."""
    from fsdp_lite.engine.param import dtensor_like

    model = _model()
    model(torch.ones(2, 5)).sum().backward()
    seen = []
    for p in model.parameters():
        made = DTensor.from_local(
            p.grad.to_local(),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
        local = p.grad._local_tensor
        like = dtensor_like(p, local)
        seen.append(
            (
                p.grad._spec == made._spec,
                like._spec == made._spec,
                like._local_tensor is local,
                like.requires_grad,
            )
        )
    return seen


def test_gradients_are_dtensors_of_their_parameters_spec(tmp_path):
    for seen in run_ranks(_grads_like_from_local, 2, tmp_path, timeout=60):
        assert seen and all(s == (True, True, True, False) for s in seen), seen


def test_only_torchs_elementwise_optimizers_by_exact_type():
    assert torch.optim.AdamW in local_step.ELEMENTWISE
    assert torch.optim.LBFGS not in local_step.ELEMENTWISE  # reads whole tensors
    assert fsdp_lite.Muon not in local_step.ELEMENTWISE
