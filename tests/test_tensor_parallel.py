"""Tensor parallel (2-D): ``parallelize_module`` on a TP mesh, then ``fully_shard`` on the dp mesh.

4 gloo ranks as dp 2 x tp 2, torchtitan's Llama plan (tests/tp_model.py: ColwiseParallel,
RowwiseParallel, SequenceParallel). Parameters become DTensors on the 2-D mesh laid out as torch
FSDP2 lays them (param.py Note [Tensor parallel parameters]); training equals the single-process
model on the global batch and torch FSDP2 + TP; a DCP checkpoint saved at dp2 x tp2 loads at
dp4 (no TP) and into a plain module; bad meshes fail before any collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fsdp_lite
from conformance.tp_models import TPLM, batch, build_tplm, loss_fn, parallelize
from fsdp_lite.engine.unit import unit_owners
from tests.ranks import run_ranks

STEPS = 3


def _shard(model: torch.nn.Module, mesh, fully_shard, **kw) -> torch.nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _dim_1(param: torch.nn.Parameter) -> Shard | None:
    """Every matrix on its dim 1 (param.py Note [Shard dim]): where a rowwise weight's TP cut
    is too, so the dp placement there is _StridedShard(1)."""
    return Shard(1) if param.ndim == 2 else None


# (name, fully_shard, its shard_placement_fn)
def _systems():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return (
        ("ours", fsdp_lite.fully_shard, None),
        ("torch", torch_fully_shard, None),
        ("ours_dim_1", fsdp_lite.fully_shard, _dim_1),
        ("torch_dim_1", torch_fully_shard, _dim_1),
    )


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model, optim, step: int, part: int, parts: int) -> None:
    x, y = batch(step, part, parts)
    loss_fn(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # on the 2-D DTensor gradients
    optim.step()
    optim.zero_grad()


def _diff(full: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(full, reference))


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
    ]


def _tp_rank(rank: int, world_size: int, checkpoint: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    reference = build_tplm()
    ref_optim = _optimizer(reference)
    ref_after = []  # the single-process model on the global batch, after each step
    for step in range(STEPS):
        _step(reference, ref_optim, step, 0, 1)
        ref_after.append([p.detach().clone() for p in reference.parameters()])
    results = {}
    for name, fully_shard, placement_fn in _systems():
        model = _shard(
            parallelize(build_tplm(), mesh["tp"]),
            mesh["dp"],
            fully_shard,
            shard_placement_fn=placement_fn,
        )
        if name.startswith("ours"):  # explain()'s boxes: where each rank's shard sits in the whole
            whole = dict(build_tplm().named_parameters())
            names = {id(param): name for name, param in model.named_parameters()}
            results[f"boxes_hold_the_shards {name}"] = all(
                torch.equal(
                    p.sharded_param.to_local(),
                    whole[names[id(p.sharded_param)]][
                        tuple(slice(a, b) for a, b in p.global_box())
                    ],
                )
                for m in unit_owners(model)
                for p in m._unit.params
            )
        optim = _optimizer(model)
        for step in range(STEPS - 1):
            _step(model, optim, step, dp_rank, 2)
        full = _full(model)
        results[name] = {
            "layouts": [
                (n, tuple(map(repr, p.placements)), tuple(p.to_local().shape))
                for n, p in model.named_parameters()
            ],
            "diff": _diff(full, ref_after[STEPS - 2]),
            "full": [t.tolist() for t in full],
        }
        if name == "ours":
            dcp.save(
                {
                    "model": get_model_state_dict(model),
                    "optim": get_optimizer_state_dict(model, optim),
                },
                checkpoint_id=checkpoint,
            )

    # torchtitan's init: meta model, TP, fully_shard, to_empty, then the weights.
    with torch.device("meta"):
        model = TPLM()
    _shard(parallelize(model, mesh["tp"]), mesh["dp"], fsdp_lite.fully_shard)
    model.to_empty(device="cpu")
    set_model_state_dict(
        model, build_tplm().state_dict(), options=StateDictOptions(full_state_dict=True)
    )
    optim = _optimizer(model)
    for step in range(STEPS - 1):
        _step(model, optim, step, dp_rank, 2)
    results["meta_init_bitwise"] = all(
        torch.equal(a, torch.tensor(b)) for a, b in zip(_full(model), results["ours"]["full"])
    )

    # The dp2 x tp2 checkpoint at dp4 (no TP): the same weights, and the next step as the
    # single-process model's.
    model = _shard(
        build_tplm(seed=1), init_device_mesh("cpu", (world_size,)), fsdp_lite.fully_shard
    )
    optim = _optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    saved = [torch.tensor(t) for t in results["ours"]["full"]]
    results["dp4_loaded_diff"] = _diff(_full(model), saved)
    _step(model, optim, STEPS - 1, rank, world_size)
    results["dp4_next_step_diff"] = _diff(_full(model), ref_after[STEPS - 1])

    # ... and into a plain module.
    plain = build_tplm(seed=1)
    plain_state = {"model": plain.state_dict()}
    dcp.load(plain_state, checkpoint_id=checkpoint)
    plain.load_state_dict(plain_state["model"])
    results["plain_loaded_diff"] = _diff(_full(plain), saved)
    return results


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    return run_ranks(_tp_rank, 4, tmp, timeout=300, args=(str(tmp / "checkpoint"),))


@pytest.mark.parametrize("ours", ["ours", "ours_dim_1"])
def test_dp2_tp2_trains_to_the_single_process_model_and_to_torch_fsdp2(tp_runs, ours):
    theirs = ours.replace("ours", "torch")
    for rank, r in enumerate(tp_runs):
        assert r[ours]["diff"] <= 1e-6, f"rank {rank}: off the reference by {r[ours]['diff']}"
        assert r[theirs]["diff"] <= 1e-6, f"rank {rank}: torch off by {r[theirs]['diff']}"
        # The same sums in the same order as torch FSDP2 + TP: bitwise.
        for i, (a, b) in enumerate(zip(r[ours]["full"], r[theirs]["full"])):
            assert torch.equal(torch.tensor(a), torch.tensor(b)), f"rank {rank} param {i}"


def test_parameters_are_laid_out_as_torch_fsdp2_lays_them(tp_runs):
    for rank, r in enumerate(tp_runs):
        assert r["ours"]["layouts"] == r["torch"]["layouts"], f"rank {rank}"
        assert r["ours_dim_1"]["layouts"] == r["torch_dim_1"]["layouts"], f"rank {rank}"
    placements = {name: pl for name, pl, _ in tp_runs[0]["ours"]["layouts"]}
    # A colwise weight: dp shards the rows of TP's row shard, so dp's shard is strided.
    assert placements["blocks.0.attn.wq.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert placements["blocks.0.attn.wo.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
    assert placements["blocks.0.attn_norm.weight"] == ("Shard(dim=0)", "Replicate()")
    # Every matrix on dim 1: now a rowwise weight's dp shard is the strided one.
    placements = {name: pl for name, pl, _ in tp_runs[0]["ours_dim_1"]["layouts"]}
    assert placements["blocks.0.attn.wq.weight"] == ("Shard(dim=1)", "Shard(dim=0)")
    assert placements["blocks.0.attn.wo.weight"] == ("_StridedShard(dim=1, sf=2)", "Shard(dim=1)")
    assert placements["blocks.0.attn_norm.weight"] == ("Shard(dim=0)", "Replicate()")


@pytest.mark.parametrize("ours", ["ours", "ours_dim_1"])
def test_explain_boxes_locate_every_shard_in_the_whole_tensor(tp_runs, ours):
    assert all(r[f"boxes_hold_the_shards {ours}"] for r in tp_runs)


def test_meta_init_then_full_state_dict_trains_bitwise_as_a_built_model(tp_runs):
    assert all(r["meta_init_bitwise"] for r in tp_runs)


def test_dcp_checkpoint_from_dp2_tp2_loads_at_dp4_and_into_a_plain_module(tp_runs):
    for rank, r in enumerate(tp_runs):
        assert r["dp4_loaded_diff"] == 0.0, f"rank {rank}: {r['dp4_loaded_diff']}"
        assert r["plain_loaded_diff"] == 0.0, f"rank {rank}: {r['plain_loaded_diff']}"
        assert r["dp4_next_step_diff"] <= 1e-6, f"rank {rank}: {r['dp4_next_step_diff']}"


def _bad_mesh_rank(rank: int, world_size: int) -> dict[str, str]:
    """Every case in one launch (each fails on every rank alike, so the next starts in step)."""
    return {case: _bad_mesh(case) for case in BAD_MESHES}


def _bad_mesh(case: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(build_tplm(), mesh["tp"])
    try:
        if case == "whole_mesh":
            fsdp_lite.fully_shard(model.blocks[0], mesh=mesh)
        elif case == "tp_mesh":
            fsdp_lite.fully_shard(model.blocks[0], mesh=mesh["tp"])
        elif case == "other_mesh":  # another mesh's dp dim: dims named otherwise
            other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
            fsdp_lite.fully_shard(model.blocks[0], mesh=other["data"])
        elif case == "equal_mesh":  # an equal mesh from another call: taken, as torch does
            other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            fsdp_lite.fully_shard(model.blocks[0], mesh=other["dp"])
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            model(x).sum().backward()  # its gathers and reductions run on the other mesh
        elif case == "hsdp":
            mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
            model = parallelize(build_tplm(), mesh3["tp"])
            fsdp_lite.fully_shard(model.blocks[0], mesh=mesh3["rep", "shard"])
        elif case == "shard_dim_out_of_range":  # dim 1 of a 1-D norm weight
            fsdp_lite.fully_shard(
                model.blocks[0], mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1)
            )
        elif case == "fsdp1":
            fsdp_lite.FullyShardedDataParallel(model, device_mesh=mesh["dp"], use_orig_params=True)
    except (ValueError, NotImplementedError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


BAD_MESHES = {
    "whole_mesh": "ValueError: parameter 'attn_norm.weight' is a DTensor on a mesh of ranks",
    "tp_mesh": "ValueError: parameter 'attn_norm.weight' is a DTensor on a mesh of ranks",
    "other_mesh": "ValueError: parameter 'attn_norm.weight': its tensor-parallel mesh and the "
    "sharding mesh are not dims of one DeviceMesh",
    "equal_mesh": "no error",
    "hsdp": "NotImplementedError: parameter 'attn_norm.weight': tensor parallel with HSDP",
    "shard_dim_out_of_range": "AssertionError: Shard dim 1 is invalid for 1D tensor: "
    "torch.Size([24]) (shard_placement_fn gave 'attn_norm.weight' Shard(dim=1))",
    "fsdp1": "NotImplementedError: parameter 'tok.weight' is a DTensor (tensor parallel); "
    "FullyShardedDataParallel does not shard DTensors: use fully_shard(module, mesh=mesh['dp'])",
}


@pytest.fixture(scope="module")
def bad_mesh_messages(tmp_path_factory):
    return run_ranks(_bad_mesh_rank, 4, tmp_path_factory.mktemp("bad_meshes"), timeout=120)


@pytest.mark.parametrize("case", list(BAD_MESHES))
def test_bad_meshes_fail_before_any_collective(case, bad_mesh_messages):
    for rank, messages in enumerate(bad_mesh_messages):
        assert messages[case].startswith(BAD_MESHES[case]), f"rank {rank}: {messages[case]}"
