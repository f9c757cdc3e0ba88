"""``fully_shard(shard_placement_fn=...)`` returning ``Shard(d)`` for d > 0 (param.py Note [Shard dim]).

Every matrix of the model is sharded on dim 1 (torchtitan's MoE experts use ``Shard(1)``), the rest
on dim 0, through both APIs in the same run. At 2 ranks, fp32 and bf16 params / fp32 reduce, with
gradient accumulation, ZeRO-2, CPU offload and meta init: every loss, gradient and parameter is
bitwise torch FSDP2's, and the DTensors are laid out as torch's (placements, local shapes,
strides). State dicts share the parameters' storage; DCP checkpoints reshard from dim 1 to dim 0
and load into a plain module. At 4 ranks: HSDP bitwise torch; ``reshard_after_forward=2`` (which
torch 2.13 fails with ``Shard(1)``) bitwise ``True``, and ``True`` within 1e-5 of torch.
Bad placements fail before any collective (tests/test_error_table.py has their texts).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp_lite
from fsdp_lite.engine.unit import unit_owners
from fsdp_lite.trace import explain
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_checks, run_ranks
from tests.test_fsdp2_front import APIS, BF16, _assert_same, _sharded, _train, sharded_on_meta


def dim_1(param: torch.nn.Parameter) -> Shard | None:
    """Matrices on dim 1 (as ``Shard(-1)``, the way torch normalizes it too), the rest on 0."""
    return Shard(-1) if param.ndim == 2 else None


def _layouts(model: torch.nn.Module) -> dict:
    return {
        n: (p.placements, p.to_local().shape, p.to_local().stride())
        for n, p in model.named_parameters()
    }


def _check_training(rank, world_size, _checkpoint):
    for what, kw in (
        ("fp32", {}),
        ("bf16 params, fp32 reduce", {"precision": BF16}),
        ("reshard_after_forward=False", {"reshard_after_forward": False}),
        ("CPUOffloadPolicy", {"offload": True}),
    ):
        runs, layouts = {}, {}
        for name, api in APIS.items():
            extra = dict(kw)
            if extra.pop("offload", False):
                extra["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
            precision = extra.pop("precision", None)
            model = _sharded(api, precision, shard_placement_fn=dim_1, **extra)
            layouts[name] = _layouts(model)
            runs[name] = _train(model, rank, world_size)
        assert layouts["fsdp_lite"] == layouts["torch"], what
        _assert_same(runs["fsdp_lite"], runs["torch"], f"Shard(1), {what}")
    placements = {n: pl for n, (pl, _, _) in layouts["fsdp_lite"].items()}
    assert placements["blocks.0.fc.weight"] == (Shard(1),)
    assert placements["blocks.0.fc.bias"] == (Shard(0),)


def _check_gradient_accumulation(rank, world_size, _checkpoint):
    def sync(model, last):
        model.set_requires_gradient_sync(last)

    runs = {
        name: _train(_sharded(api, shard_placement_fn=dim_1), rank, world_size, 2, 2, sync)
        for name, api in APIS.items()
    }
    _assert_same(runs["fsdp_lite"], runs["torch"], "Shard(1), set_requires_gradient_sync")


def _check_meta_init(rank, world_size, _checkpoint):
    runs = {
        name: _train(sharded_on_meta(api, rank, shard_placement_fn=dim_1), rank, world_size, 2)
        for name, api in APIS.items()
    }
    _assert_same(runs["fsdp_lite"], runs["torch"], "Shard(1), meta init")


def _check_state_dicts(rank, world_size, checkpoint):
    model = _sharded(fsdp_lite, shard_placement_fn=dim_1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = rank_batch("lm", 0, rank, world_size)
    loss_fn("lm", model(x), y).backward()
    optim.step()
    optim.zero_grad()
    # Plain state_dict(): DTensors that share the parameters' storage.
    state = model.state_dict()
    for name, p in model.named_parameters():
        assert state[name].placements == p.placements, name
        if p.to_local().numel():
            assert state[name].to_local().data_ptr() == p.to_local().data_ptr(), name
    # explain() names the dim; its boxes locate each shard in the whole tensor.
    line = next(x for x in explain(model).splitlines() if x.split()[0] == "fc.weight")
    assert "40x24  rows   12/12   shard_numel     480" in line, line
    assert line.endswith("padding 0  on dim 1"), line
    whole = {k: v.full_tensor() for k, v in state.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for m in unit_owners(model):
        for p in m._unit.params:
            box = tuple(slice(a, b) for a, b in p.global_box())
            name = names[id(p.sharded_param)]
            assert torch.equal(p.sharded_param.to_local(), whole[name][box]), name
    # DCP's full state dicts equal torch's after the same step.
    options = StateDictOptions(full_state_dict=True)
    theirs = _sharded(torch_fsdp, shard_placement_fn=dim_1)
    their_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    loss_fn("lm", theirs(x), y).backward()
    their_optim.step()
    ours_full = get_model_state_dict(model, options=options)
    theirs_full = get_model_state_dict(theirs, options=options)
    for key, value in theirs_full.items():
        torch.testing.assert_close(ours_full[key], value, rtol=0, atol=0, msg=key)
    ours_optim = get_optimizer_state_dict(model, optim, options=options)
    theirs_optim = get_optimizer_state_dict(theirs, their_optim, options=options)
    for key, st in theirs_optim["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(ours_optim["state"][key][k], v, rtol=0, atol=0)
    # broadcast_from_rank0 into a fresh Shard(1) model.
    fresh = _sharded(fsdp_lite, model=build_model("lm_untied"), shard_placement_fn=dim_1)
    set_model_state_dict(
        fresh,
        dict(ours_full) if rank == 0 else {},  # DCP replaces the given dict's values
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), ours_full[key], rtol=0, atol=0, msg=key)
    # A sharded DCP checkpoint at Shard(1) loads into a Shard(0) model and into a plain module.
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
        checkpoint_id=checkpoint,
    )
    dim_0 = _sharded(fsdp_lite, model=build_model("lm_untied"))
    dim_0_optim = torch.optim.AdamW(dim_0.parameters(), lr=1e-2)
    loaded = {
        "model": get_model_state_dict(dim_0),
        "optim": get_optimizer_state_dict(dim_0, dim_0_optim),
    }
    dcp.load(loaded, checkpoint_id=checkpoint)
    set_model_state_dict(dim_0, loaded["model"])
    set_optimizer_state_dict(dim_0, dim_0_optim, loaded["optim"])
    for key, value in dim_0.state_dict().items():
        assert value.placements == (Shard(0),), key
        torch.testing.assert_close(value.full_tensor(), ours_full[key], rtol=0, atol=0, msg=key)
    # The next step from the loaded checkpoint is the next step of the model that saved it.
    after = []
    for m, o in ((model, optim), (dim_0, dim_0_optim)):
        x, y = rank_batch("lm", 1, rank, world_size)
        loss_fn("lm", m(x), y).backward()
        o.step()
        after.append({k: v.full_tensor() for k, v in m.state_dict().items()})
    for key in after[0]:
        torch.testing.assert_close(after[1][key], after[0][key], rtol=0, atol=0, msg=key)
    plain = build_model("lm_untied")
    plain_state = {"model": plain.state_dict()}
    dcp.load(plain_state, checkpoint_id=checkpoint)
    for key, value in plain_state["model"].items():
        torch.testing.assert_close(value, ours_full[key], rtol=0, atol=0, msg=f"plain {key}")


def _check_placement_fn_sees_the_params_each_call_shards(rank, world_size, _checkpoint):
    """As torch's: a block's params at the block's call, the root's own at the root's (not the
    blocks' again, not ignored ones), each once."""
    seen = {}
    for name, api in APIS.items():
        model = build_model("lm_untied")
        names = {id(p): n for n, p in model.named_parameters()}
        calls = seen[name] = []

        def record(p, calls=calls, names=names):
            calls.append(names.get(id(p), "?"))
            return dim_1(p)

        for block in model.blocks:
            api.fully_shard(block, shard_placement_fn=record)
            calls.append("|")
        api.fully_shard(model, shard_placement_fn=record, ignored_params={model.pos})
    # torch calls it twice per parameter (a check, then the sharding); fsdp_lite once.
    calls = {name: " ".join(names).split(" | ") for name, names in seen.items()}
    for ours, theirs in zip(calls["fsdp_lite"], calls["torch"], strict=True):
        assert ours.split() == list(dict.fromkeys(theirs.split())), (ours, theirs)
    assert "pos" not in calls["fsdp_lite"][-1].split(), calls


CHECKS_2 = {
    "placement_fn_calls": _check_placement_fn_sees_the_params_each_call_shards,
    "training": _check_training,
    "gradient_accumulation": _check_gradient_accumulation,
    "meta_init": _check_meta_init,
    "state_dicts": _check_state_dicts,
}


def _hsdp_and_hpz(rank, world_size, _checkpoint):
    def run(api, reshard_after_forward=None, **kw):
        model = build_model("lm_untied")
        for block in model.blocks:
            api.fully_shard(
                block, shard_placement_fn=dim_1, reshard_after_forward=reshard_after_forward, **kw
            )
        api.fully_shard(model, shard_placement_fn=dim_1, **kw)
        return model, _train(model, rank, world_size)

    # HSDP reduce-scatters over 2 ranks and all-reduces over 2: bitwise.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, ours = run(fsdp_lite, mesh=mesh)
    assert model.blocks[0].fc.weight.placements == (Replicate(), Shard(1))
    _assert_same(ours, run(torch_fsdp, mesh=mesh)[1], "Shard(1), HSDP")
    # torch 2.13 fails here with Shard(1) (IndexError in foreach_all_gather_copy_out, its
    # post-forward shard size): the int only moves data, so it must train as True does, and
    # True as torch's.
    hpz, whole = run(fsdp_lite, 2)[1], run(fsdp_lite, True)[1]
    _assert_same(hpz, whole, "Shard(1), reshard_after_forward=2 against True")
    # Over 4 ranks the two differ in last bits here, with Shard(0) as with Shard(1) (measured
    # the same: 4 of 384 elements of the root's pos grad, 3e-6 relative): the reductions' order.
    theirs = run(torch_fsdp, True)[1]
    _assert_same(whole, theirs, "Shard(1), reshard_after_forward=True", rtol=1e-5, atol=1e-6)


CHECKS_4 = {"hsdp_and_hpz": _hsdp_and_hpz}


def _checks_rank(rank, world_size, names, checkpoint):
    return run_checks({**CHECKS_2, **CHECKS_4}, names, rank, world_size, checkpoint)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard_dim")
    return run_ranks(
        _checks_rank, 2, tmp, args=(list(CHECKS_2), str(tmp / "checkpoint")), timeout=300
    )


@pytest.mark.parametrize("check", list(CHECKS_2))
def test_shard_dim_1_matches_torch(results, check):
    for rank, failures in enumerate(results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"


def test_shard_dim_1_with_hsdp_and_reshard_after_forward_int_at_4_ranks(tmp_path):
    for rank, failures in enumerate(
        run_ranks(_checks_rank, 4, tmp_path, args=(list(CHECKS_4), ""), timeout=300)
    ):
        assert not failures, f"rank {rank}:\n{failures}"
