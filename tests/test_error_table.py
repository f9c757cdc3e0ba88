"""docs/errors.md is the table of what fsdp_lite refuses, with the exact text: this keeps it true.

- Every ``raise`` in fsdp_lite/ is in the table (its message's longest literal part appears in
  docs/errors.md), or in ``NOT_IN_THE_TABLE`` with the reason.
- Every row names a test, and that test exists.
- ``CASES`` produces the rows that name ``tests/test_error_table.py``: each case makes its error on 2
  ranks, and the row must hold the error's exact text (``Type: message``, whitespace collapsed, the
  case's temporary directory written ``TMP``).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_lite import (
    CPUOffload,
    DataParallelMeshDims,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
    checkpoint,
    disk_offload,
    fully_shard,
)
from fsdp_lite import (
    FullyShardedDataParallel as FSDP,
)
from fsdp_lite.optim.muon import Muon
from fsdp_lite.optim.whole_matrix import WholeMatrix
from fsdp_lite.tools.estimate import estimate
from fsdp_lite.wrap import CustomPolicy, ModuleWrapPolicy, enable_wrap, wrap
from tests.parity import build_model
from tests.ranks import run_ranks
from tests.test_stand_in_group import StandIn

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
HERE = "tests/test_error_table.py"


@dataclasses.dataclass
class Ctx:
    rank: int
    tmp: Path  # this case's directory, shared by the ranks

    def mlp(self) -> nn.Module:
        return build_model("mlp")

    def units(self) -> FSDP:
        """An MLP with each Linear a unit of its own."""
        return FSDP(self.mlp(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _forward_hook(model: nn.Module, action: Callable[[], object]) -> None:
    """Make ``action`` run inside the forward of ``model``'s first unit."""
    model.module.fc2.register_forward_pre_hook(lambda *_: action())
    model(torch.randn(2, 7))


def _torch_sharded_state_dict_at_another_world_size(c: Ctx) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    # torch FSDP1's SHARDED_STATE_DICT holds ShardedTensors of this rank's rows of 2...
    saved_at_2 = TorchFSDP(c.mlp(), device_id=torch.device("cpu"))
    with TorchFSDP.state_dict_type(saved_at_2, TorchStateDictType.SHARDED_STATE_DICT):
        saved = saved_at_2.state_dict()
    # ... loaded where this rank holds all rows (a group of one).
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][c.rank]
    model = FSDP(c.mlp(), process_group=alone)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(saved)


def _after_a_forward(c: Ctx) -> FSDP:
    model = c.units()
    model(torch.randn(2, 7))
    return model


def _optimizer_of_the_original_params(c: Ctx) -> None:
    plain = c.mlp()
    optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    FSDP.optim_state_dict(FSDP(plain), optim)


def _load_another_models_optimizer_state(c: Ctx) -> None:
    other = FSDP(nn.Sequential(nn.Linear(3, 3)))
    other_optim = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other(torch.randn(2, 3)).sum().backward()
    other_optim.step()
    saved = FSDP.optim_state_dict(other, other_optim)
    model = c.units()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    FSDP.optim_state_dict_to_load(model, optim, saved)


@dataclasses.dataclass
class _Foreign:
    param_dtype: torch.dtype | None = None
    future_field: int = 1


_Foreign.__name__ = _Foreign.__qualname__ = "MixedPrecision"
_Foreign.__module__ = "torch.distributed.fsdp.future"  # a torch class with a field we lack


def _nested_enable_wrap(c: Ctx) -> None:
    with enable_wrap(wrapper_cls=FSDP), enable_wrap(wrapper_cls=FSDP):
        wrap(c.mlp())


def _auto_wrap_over_a_wrapped_child(c: Ctx) -> None:
    model = c.mlp()
    model.fc1 = FSDP(model.fc1)
    FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _ignore_a_wrapped_child(c: Ctx) -> None:
    model = c.mlp()
    model.fc1 = FSDP(model.fc1)
    FSDP(model, ignored_modules=[model.fc1])


def _not_writable(c: Ctx) -> None:
    # Tests run as root here, who may write anywhere: os.access answers as for a read-only dir.
    with mock.patch.object(os, "access", return_value=False):
        FSDP(c.mlp(), cpu_offload=CPUOffload(offload_params=True, offload_dir=c.tmp))


def _unfreeze_on_disk(c: Ctx) -> None:
    model = c.mlp()
    model.fc1.requires_grad_(False)  # wrapped frozen: no gradient file reserved for it
    wrapped = FSDP(model, cpu_offload=CPUOffload(offload_params=True, offload_dir=c.tmp))
    wrapped.module.fc1.weight.requires_grad = True
    wrapped(torch.randn(2, 7))


def _save_under_a_file(c: Ctx) -> None:
    if c.rank == 0:
        (c.tmp / "a_file").write_text("")
    dist.barrier()
    model = c.units()
    checkpoint.save(model, torch.optim.SGD(model.parameters(), lr=0.1), c.tmp / "a_file" / "ckpt")


class _TiedSiblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


class _TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()


def _fully_shard_siblings_sharing_a_param(c: Ctx) -> None:
    model = _TiedSiblings()
    fully_shard(model.emb)
    fully_shard(model.head)
    fully_shard(model)


def _fully_shard_twice(c: Ctx) -> None:
    linear = nn.Linear(4, 4)
    fully_shard(linear)
    fully_shard(linear)


def _fully_shard_scalar_param(c: Ctx) -> None:
    linear = nn.Linear(4, 4)
    linear.scale = nn.Parameter(torch.tensor(1.0))
    fully_shard(linear)


def _reset_iter_state_below_the_root(c: Ctx) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(2, 4))
    model[0].reset_iter_state()


def _torch_reads_a_state_attribute(c: Ctx) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    linear = nn.Linear(4, 4)
    fully_shard(linear)
    torch_fully_shard.state(linear)._fsdp_param_groups_of_torch  # noqa: B018


def _prefetch_a_plain_module(c: Ctx) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    model[0].set_modules_to_forward_prefetch([model[1]])


def _dtensor_module(mesh: DeviceMesh, placement) -> nn.Module:
    module = nn.Linear(4, 4)
    module.weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    if placement is not None:
        local = module.weight.to_local()
        module.weight = nn.Parameter(DTensor.from_local(local, mesh, [placement]))
    return module


def _spmd_linear(names: tuple[str, ...], placements) -> tuple[DeviceMesh, nn.Module]:
    """A mesh of ``names`` (world x 1 x ...) and a Linear whose params are DTensors on it."""
    shape = (dist.get_world_size(), *[1] * (len(names) - 1))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    module = nn.Linear(4, 4, bias=False)
    module.weight = nn.Parameter(
        DTensor.from_local(torch.randn(4, 4), mesh, placements, run_check=False)
    )
    return mesh, module


def _dp_mesh_dims_int_reshard(c: Ctx) -> None:
    mesh, module = _spmd_linear(("dpi",), [Replicate()])
    fully_shard(
        module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dpi"), reshard_after_forward=2
    )


def _dp_mesh_dims_plain_param(c: Ctx) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dpp",))
    fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dpp"))


def _dp_mesh_dims_other_mesh(c: Ctx) -> None:
    _, module = _spmd_linear(("dpo",), [Replicate()])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dpx",))
    fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dpx"))


def _dp_mesh_dims_sharded_on_dp(c: Ctx) -> None:
    mesh, module = _spmd_linear(("dps",), [Shard(0)])
    fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dps"))


def _dp_mesh_dims_partial(c: Ctx) -> None:
    mesh, module = _spmd_linear(("dpq", "tpq"), [Replicate(), Partial()])
    fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dpq"))


def _dp_mesh_dims(names: tuple[str, ...], **dims) -> Callable[[Ctx], None]:
    def case(c: Ctx) -> None:
        shape = (dist.get_world_size(), *[1] * (len(names) - 1))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names or None)
        fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))

    return case


def _all_gather_extension(c: Ctx) -> None:
    linear = nn.Linear(4, 4)
    linear.weight.fsdp_pre_all_gather = lambda *args: None  # as a float8 tensor subclass has
    fully_shard(linear)


def _muon_strided_shard(c: Ctx) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dpm",))
    weight = nn.Parameter(
        DTensor.from_local(torch.randn(4, 4), mesh, [_StridedShard(0, split_factor=2)])
    )
    weight.grad = torch.zeros_like(weight)
    Muon([weight]).step()


def _whole_matrix(local_rows: int | None = None, built_with: bool = True):
    def case(c: Ctx) -> None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        weight = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        given = weight if local_rows is None else torch.ones(local_rows, 4)
        WholeMatrix([weight] if built_with else []).map(lambda p, m: m, [weight], [given])

    return case


def _whole_matrix_of_a_vector(c: Ctx) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    WholeMatrix([distribute_tensor(torch.ones(4), mesh, [Shard(0)])])


def _whole_matrix_partial(c: Ctx) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    WholeMatrix([DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])])


def _tp_placement_partial(c: Ctx) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    fully_shard(_dtensor_module(mesh["tp"], Partial()), mesh=mesh["dp"])


def _tp_with_hsdp(c: Ctx) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    replicas = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")
    )
    fully_shard(_dtensor_module(mesh["tp"], None), mesh=replicas)


def _optimizer_state_of_another_shape(c: Ctx) -> None:
    model = c.units()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 7)).sum().backward()
    optim.step()
    saved = FSDP.optim_state_dict(model, optim)
    saved["state"]["fc1.weight"]["momentum_buffer"] = torch.zeros(4, 4)
    FSDP.optim_state_dict_to_load(model, optim, saved)


def _unreadable_metadata(c: Ctx) -> None:
    model, optim, path = _dcp_checkpoint(c)  # torch's: no manifest, so .metadata is read
    if c.rank == 0:
        (path / ".metadata").write_bytes(b"not a pickle")
    dist.barrier()
    checkpoint.load(model, optim, path)


class _Pwned:
    """Unpickling it would run a shell command (it never does here: the tests check the text)."""

    def __reduce__(self):
        return os.system, ("echo pwned",)


def _dcp_checkpoint(c: Ctx, change=None):
    """A model, its optimizer and a DCP checkpoint of them (``change(state)`` first), by torch."""
    import torch.distributed.checkpoint as dcp

    from fsdp_lite.state.checkpoint import checkpoint_state

    model = c.units()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = checkpoint_state(model, optim)
    if change is not None:
        change(state)
    dcp.save(state, checkpoint_id=c.tmp / "ckpt")
    return model, optim, c.tmp / "ckpt"


def _load_with_a_new_metadata(c: Ctx, change) -> None:
    """Rank 0 rewrites the checkpoint's .metadata (``change(metadata)`` returns what to pickle)."""
    import pickle

    from fsdp_lite.state.checkpoint_files import read_metadata

    model, optim, path = _dcp_checkpoint(c)
    if c.rank == 0:
        metadata = read_metadata(path / ".metadata")
        (path / ".metadata").write_bytes(pickle.dumps(change(metadata)))
    dist.barrier()
    checkpoint.load(model, optim, path)


def _outside(metadata):
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    return metadata


def _crafted_param_group(c: Ctx) -> None:
    def poison(state):
        state["optim"]["param_groups"][0]["lr"] = _Pwned()

    model, optim, path = _dcp_checkpoint(c, poison)
    checkpoint.load(model, optim, path)


def _saved(c: Ctx, path: str = "ckpt"):
    model = c.units()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(model, optim, c.tmp / path)
    return model, optim, c.tmp / path


def _on_rank0_then_load(c: Ctx, change) -> None:
    """Save, let rank 0 ``change(path)`` the checkpoint, then load it on every rank."""
    model, optim, path = _saved(c)
    if c.rank == 0:
        change(path)
    dist.barrier()
    checkpoint.load(model, optim, path)


def _flip(file: Path, offset: int, count: int = 16) -> None:
    data = bytearray(file.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def _flip_a_shard(path: Path) -> None:
    """16 bytes in the middle of the largest item of rank 0's data file (same size)."""
    import json

    manifest = json.loads((path / "fsdp_lite_manifest.json").read_text())
    name = "fsdp_lite-000001__0_0.distcp"
    offset, length, _ = max(manifest["files"][name]["items"], key=lambda item: item[1])
    _flip(path / name, offset + length // 2)


def _edit_manifest(path: Path) -> None:
    import json

    manifest = json.loads((path / "fsdp_lite_manifest.json").read_text())
    manifest["files"]["fsdp_lite-000001__0_0.distcp"]["size"] += 1
    (path / "fsdp_lite_manifest.json").write_text(json.dumps(manifest))


def _save_onto_a_file(c: Ctx) -> None:
    if c.rank == 0:
        (c.tmp / "a_file").write_text("keep me")
    dist.barrier()
    model = c.units()
    checkpoint.save(model, torch.optim.SGD(model.parameters(), lr=0.1), c.tmp / "a_file")


def _save_over_a_torch_checkpoint(c: Ctx) -> None:
    model, optim, path = _dcp_checkpoint(c)
    checkpoint.save(model, optim, path)


def _save_while_another_job_saves(c: Ctx) -> None:
    import fcntl

    model, optim, path = _saved(c)
    with open(path / ".fsdp_lite.lock", "r+") as other_job:  # another open file: another holder
        if c.rank == 0:
            fcntl.flock(other_job, fcntl.LOCK_EX)
            other_job.truncate(0)
            other_job.write("generation 2, saved by node7 pid 4242")
            other_job.flush()
        dist.barrier()
        checkpoint.save(model, optim, path)


def _load_on_one_rank_only(c: Ctx) -> None:
    model, optim, path = _saved(c)
    checkpoint.load(model, optim, path if c.rank == 0 else c.tmp / "elsewhere")


def _save_where_ranks_see_other_directories(c: Ctx) -> None:
    model = c.units()
    checkpoint.save(model, None, c.tmp / f"view{c.rank}")  # what one path on two disks does


def _load_before_the_first_save_ends(c: Ctx) -> None:
    if c.rank == 0:  # what a first save has made when it starts writing
        (c.tmp / "ckpt").mkdir()
        (c.tmp / "ckpt" / ".fsdp_lite.lock").write_text("generation 1, saved by node7 pid 4242")
    dist.barrier()
    model = c.units()
    checkpoint.load(model, None, c.tmp / "ckpt")


def _load_two_generations(c: Ctx) -> None:
    model, optim, _ = _saved(c, "a")
    _saved(c, "b")
    _saved(c, "b")
    checkpoint.load(model, optim, c.tmp / ("a" if c.rank == 0 else "b"))


def _hybrid_shard_over_nodes_of_3(c: Ctx) -> None:
    with mock.patch.dict(os.environ, LOCAL_WORLD_SIZE="3"):
        FSDP(c.mlp(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)


# id -> (what the user did, the code doing it). The row with `[id]` holds the exact text.
CASES: dict[str, Callable[[Ctx], object]] = {
    # constructing, FSDP1 front
    "group_tuple_of_three": lambda c: FSDP(
        c.mlp(),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        process_group=(dist.group.WORLD,) * 3,
    ),
    "group_and_mesh": lambda c: FSDP(
        c.mlp(),
        process_group=dist.group.WORLD,
        device_mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"),
    ),
    "device_id_as_list": lambda c: FSDP(c.mlp(), device_id=["cpu"]),
    "ignored_modules_hold_a_parameter": lambda c: FSDP(
        (m := c.mlp()), ignored_modules=[m.fc1.weight]
    ),
    "ignored_states_mixed": lambda c: FSDP((m := c.mlp()), ignored_states=[m.fc1, m.fc2.weight]),
    "ignored_both_ways": lambda c: FSDP(
        (m := c.mlp()), ignored_modules=[m.fc1], ignored_states=[m.fc2.weight]
    ),
    "ignored_wrapped_module": _ignore_a_wrapped_child,
    "foreign_config_field": lambda c: FSDP(c.mlp(), mixed_precision=_Foreign()),
    "module_wrap_policy_not_a_set": lambda c: ModuleWrapPolicy(nn.Linear),
    "module_wrap_policy_not_classes": lambda c: ModuleWrapPolicy({nn.Linear(2, 2)}),
    "custom_policy_returns_int": lambda c: FSDP(
        c.mlp(), auto_wrap_policy=CustomPolicy(lambda m: 3)
    ),
    "nested_enable_wrap": _nested_enable_wrap,
    "policy_ignores_params": lambda c: FSDP(
        (m := c.mlp()),
        auto_wrap_policy=CustomPolicy(
            lambda mod: {"ignored_states": [m.fc2.bias]} if mod is m.fc2 else False
        ),
    ),
    "policy_ignores_modules": lambda c: FSDP(
        (m := c.mlp()),
        auto_wrap_policy=CustomPolicy(
            lambda mod: {"ignored_modules": [m.fc2]} if mod is m.fc2 else False
        ),
    ),
    "policy_mixes_hybrid": lambda c: FSDP(
        c.mlp(),
        auto_wrap_policy=CustomPolicy(
            lambda mod: (
                {"sharding_strategy": ShardingStrategy.HYBRID_SHARD}
                if isinstance(mod, nn.Linear)
                else False
            )
        ),
    ),
    "hybrid_world_not_a_multiple": _hybrid_shard_over_nodes_of_3,
    "auto_wrap_over_wrapped_child": _auto_wrap_over_a_wrapped_child,
    "two_dtypes_in_a_unit": lambda c: FSDP(_TwoDtypes()),
    "siblings_share_a_param": lambda c: FSDP(
        _TiedSiblings(), auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear})
    ),
    # disk offload
    "offload_dir_without_offload_params": lambda c: FSDP(
        c.mlp(), cpu_offload=CPUOffload(offload_params=False, offload_dir=c.tmp)
    ),
    "offload_dir_not_a_path": lambda c: FSDP(
        c.mlp(), cpu_offload=CPUOffload(offload_params=True, offload_dir=3)
    ),
    "offload_dir_missing": lambda c: FSDP(
        c.mlp(), cpu_offload=CPUOffload(offload_params=True, offload_dir=c.tmp / "missing")
    ),
    "offload_dir_not_writable": _not_writable,
    "offload_dir_with_no_shard": lambda c: FSDP(
        c.mlp(),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        cpu_offload=CPUOffload(offload_params=True, offload_dir=c.tmp),
    ),
    "unfreeze_on_disk": _unfreeze_on_disk,
    "param_init_fn_changes_a_shape": lambda c: FSDP(
        nn.Linear(2, 2, device="meta"),
        param_init_fn=lambda m: setattr(m, "weight", nn.Parameter(torch.zeros(3, 3))),
    ),
    # a process group stand-in (construct.py Note [Stand-in process groups])
    "stand_in_with_sync_module_states": lambda c: FSDP(
        c.mlp(), process_group=StandIn(0, 2), sync_module_states=True
    ),
    "stand_in_rank_out_of_range": lambda c: FSDP(c.mlp(), process_group=StandIn(2, 2)),
    "stand_in_run": lambda c: FSDP(c.mlp(), process_group=StandIn(0, 2))(torch.randn(2, 7)),
    "disk_step_without_offload_dir": lambda c: disk_offload.step(
        (m := c.units()), torch.optim.SGD(m.parameters(), lr=0.1)
    ),
    # constructing, FSDP2 front
    "fully_shard_empty_list": lambda c: fully_shard([]),
    "fully_shard_not_a_module": lambda c: fully_shard("blocks"),
    "fully_shard_twice": _fully_shard_twice,
    "muon_strided_shard": _muon_strided_shard,
    "whole_matrix_not_built_with": _whole_matrix(built_with=False),
    "whole_matrix_input_shape": _whole_matrix(local_rows=3),
    "whole_matrix_of_a_vector": _whole_matrix_of_a_vector,
    "whole_matrix_partial": _whole_matrix_partial,
    "all_gather_extension": _all_gather_extension,
    "dp_mesh_dims_empty": lambda c: DataParallelMeshDims(),
    "dp_mesh_dims_without_mesh": lambda c: fully_shard(
        nn.Linear(4, 4), dp_mesh_dims=DataParallelMeshDims(shard="dp")
    ),
    "dp_mesh_dims_mesh_without_names": lambda c: fully_shard(
        nn.Linear(4, 4),
        mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
        dp_mesh_dims=DataParallelMeshDims(shard="dp"),
    ),
    "dp_mesh_dims_unknown_name": _dp_mesh_dims(("dpu",), shard="fsdp"),
    "dp_mesh_dims_flattened": _dp_mesh_dims(("dpa", "dpb"), shard=("dpa", "dpb")),
    "dp_mesh_dims_replicate_only": _dp_mesh_dims(("dpr",), replicate="dpr"),
    "dp_mesh_dims_int_reshard": _dp_mesh_dims_int_reshard,
    "dp_mesh_dims_plain_param": _dp_mesh_dims_plain_param,
    "dp_mesh_dims_other_mesh": _dp_mesh_dims_other_mesh,
    "dp_mesh_dims_sharded_on_dp": _dp_mesh_dims_sharded_on_dp,
    "dp_mesh_dims_partial": _dp_mesh_dims_partial,
    "fully_shard_module_list": lambda c: fully_shard(
        nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    ),
    "fully_shard_scalar_param": _fully_shard_scalar_param,
    "mesh_2d_without_names": lambda c: fully_shard(
        nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2))
    ),
    "mesh_not_a_mesh": lambda c: fully_shard(nn.Linear(4, 4), mesh="cpu"),
    "reset_iter_state_below_the_root": _reset_iter_state_below_the_root,
    "reshard_after_forward_int": lambda c: fully_shard(nn.Linear(4, 4), reshard_after_forward=3),
    "shard_placement_out_of_range": lambda c: fully_shard(
        nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(1)
    ),
    "shard_placement_not_a_shard": lambda c: fully_shard(
        nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()
    ),
    "shard_placement_uneven": lambda c: fully_shard(
        nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None
    ),
    "reshard_after_forward_string": lambda c: fully_shard(
        nn.Linear(4, 4), reshard_after_forward="yes"
    ),
    "set_reshard_after_forward_int": lambda c: fully_shard(
        nn.Linear(4, 4)
    ).set_reshard_after_forward(2),
    "fully_shard_two_dtypes": lambda c: fully_shard(_TwoDtypes()),
    "fully_shard_siblings_share_a_param": _fully_shard_siblings_sharing_a_param,
    "mesh_3d": lambda c: fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2, 1))),
    "prefetch_a_plain_module": _prefetch_a_plain_module,
    "max_input_buffers_bool": lambda c: fully_shard(
        nn.Linear(4, 4)
    ).set_reduce_scatter_max_input_buffers(True),
    "max_input_buffers_zero": lambda c: fully_shard(
        nn.Linear(4, 4)
    ).set_reduce_scatter_max_input_buffers(0),
    "torch_reads_a_state_attribute": _torch_reads_a_state_attribute,
    "tp_placement_partial": _tp_placement_partial,
    "tp_with_hsdp": _tp_with_hsdp,
    # between steps
    "no_sync_on_a_nested_unit": lambda c: _after_a_forward(c).module.fc1.no_sync().__enter__(),
    "clip_on_a_nested_unit": lambda c: _after_a_forward(c).module.fc1.clip_grad_norm_(1.0),
    "summon_rank0_only_writeback": lambda c: FSDP.summon_full_params(
        c.units(), rank0_only=True, writeback=True
    ).__enter__(),
    "load_state_dict_assign": lambda c: (m := c.units()).load_state_dict(
        m.state_dict(), assign=True
    ),
    "load_another_models_state_dict": lambda c: c.units().load_state_dict(
        FSDP(nn.Sequential(nn.Linear(7, 3))).state_dict()
    ),
    "torch_sharded_state_dict_elsewhere": _torch_sharded_state_dict_at_another_world_size,
    "state_dict_type_none": lambda c: FSDP.set_state_dict_type(c.units(), None),
    "state_dict_types_differ": lambda c: (
        FSDP.set_state_dict_type((m := c.units()).module.fc1, StateDictType.SHARDED_STATE_DICT),
        FSDP.set_state_dict_type(m, StateDictType.FULL_STATE_DICT),
    ),
    "get_state_dict_type_differs": lambda c: (
        FSDP.set_state_dict_type((m := c.units()).module.fc1, StateDictType.SHARDED_STATE_DICT),
        FSDP.get_state_dict_type(m),
    ),
    "forward_of_a_submodule": lambda c: FSDP(c.mlp()).module.fc2(torch.randn(2, 13)),
    "apply_in_forward": lambda c: _forward_hook((m := c.units()), lambda: m.double()),
    "state_dict_in_forward": lambda c: _forward_hook((m := c.units()), lambda: m.state_dict()),
    # optimizer state
    "optimizer_of_the_original_params": _optimizer_of_the_original_params,
    "optim_input_groups_without_params": lambda c: FSDP.full_optim_state_dict(
        (m := c.units()), torch.optim.SGD(m.parameters(), lr=0.1), optim_input=[{"lr": 0.1}]
    ),
    "optim_input_not_params": lambda c: FSDP.full_optim_state_dict(
        (m := c.units()), torch.optim.SGD(m.parameters(), lr=0.1), optim_input=[1, 2]
    ),
    "optim_input_in_another_order": lambda c: FSDP.full_optim_state_dict(
        (m := c.units()),
        torch.optim.SGD(m.parameters(), lr=0.1),
        optim_input=list(m.parameters())[::-1],
    ),
    "another_models_optimizer_state": _load_another_models_optimizer_state,
    "optimizer_state_of_another_shape": _optimizer_state_of_another_shape,
    "rekey_as_string": lambda c: FSDP.rekey_optim_state_dict(
        {"state": {}, "param_groups": []}, "PARAM_NAME", c.units()
    ),
    "rekey_none": lambda c: FSDP.rekey_optim_state_dict(
        {"state": {}, "param_groups": []}, None, c.units()
    ),
    "rekey_mixed_keys": lambda c: FSDP.rekey_optim_state_dict(
        {"state": {0: {}, "fc1.weight": {}}, "param_groups": []},
        OptimStateKeyType.PARAM_ID,
        c.units(),
    ),
    # checkpoints
    "load_missing_checkpoint": lambda c: checkpoint.load(
        (m := c.units()), torch.optim.SGD(m.parameters(), lr=0.1), c.tmp / "nowhere"
    ),
    "save_under_a_file": _save_under_a_file,
    "unreadable_metadata": _unreadable_metadata,
    "crafted_metadata": lambda c: _load_with_a_new_metadata(c, lambda m: _Pwned()),
    "metadata_not_metadata": lambda c: _load_with_a_new_metadata(c, lambda m: [1, 2]),
    "data_file_outside": lambda c: _load_with_a_new_metadata(c, _outside),
    "crafted_param_group": _crafted_param_group,
    "save_onto_a_file": _save_onto_a_file,
    "save_over_a_torch_checkpoint": _save_over_a_torch_checkpoint,
    "save_while_another_job_saves": _save_while_another_job_saves,
    "save_where_ranks_see_other_directories": _save_where_ranks_see_other_directories,
    "load_on_one_rank_only": _load_on_one_rank_only,
    "flipped_bytes": lambda c: _on_rank0_then_load(c, _flip_a_shard),
    "metadata_flipped": lambda c: _on_rank0_then_load(
        c, lambda p: _flip(p / "fsdp_lite-000001.metadata", 100, 1)
    ),
    "metadata_missing": lambda c: _on_rank0_then_load(
        c, lambda p: (p / "fsdp_lite-000001.metadata").unlink()
    ),
    "manifest_unreadable": lambda c: _on_rank0_then_load(
        c, lambda p: (p / "fsdp_lite_manifest.json").write_text("{")
    ),
    "manifest_edited": lambda c: _on_rank0_then_load(c, _edit_manifest),
    "ranks_read_other_generations": _load_two_generations,
    "load_before_the_first_save_ends": _load_before_the_first_save_ends,
    # the planner
    "estimate_world_size_0": lambda c: estimate(1e6, world_size=0),
    "estimate_shard_size_not_dividing": lambda c: estimate(1e6, world_size=4, shard_size=3),
    "estimate_unknown_strategy": lambda c: estimate(1e6, world_size=4)["ZeRO-9"],
}

# Raise sites whose message is not a row, and why: matched by file and a literal part of the
# message ("" matches a message with no literal part).
_TREE_INVARIANT = (
    "the tree's own invariants (a power of two of leaves, float32 pieces that tile the elements); "
    "Canonical checks what users pass before any of them can fail"
)
NOT_IN_THE_TABLE = {
    ("engine/canonical.py", "power of two of leaves"): _TREE_INVARIANT,
    ("engine/canonical.py", "1D float32"): _TREE_INVARIANT,
    ("engine/canonical.py", "is in no piece"): _TREE_INVARIANT,
    (
        "optim/whole_matrix.py",
        ": fn returned shape",
    ): "the user function's own bug, raised on its owner only (the other ranks wait in the "
    "exchange until the process group's timeout)",
    (
        "fronts/construct.py",
        "must be",
    ): "the shared type check; its texts are the rows naming arguments",
    (
        "fronts/fsdp1.py",
        "",
    ): "torch's load_state_dict error, wrapper names removed: a row shows one",
    (
        "state/optim_state.py",
        "",
    ): "the type check's TypeError as a ValueError: row [rekey_as_string]",
    ("tools/estimate.py", ""): "KeyError(name), as a dict's: row [estimate_unknown_strategy]",
    ("tools/order.py", ""): "the message is built by order.py's _describe: the order rows show it",
    ("demo.py", "state_dict keys differ"): "the demo's own check of its result, not user input",
    ("demo.py", "has shape"): "the demo's own check of its result, not user input",
    ("engine/disk.py", "cannot create"): "the OS refused a directory (full disk): its error",
    ("state/checkpoint.py", "loading checkpoint"): "DCP failed after fsdp_lite's checks passed",
    (
        "state/checkpoint.py",
        "",
    ): "another rank's error, or DCP's with the disk's facts, raised on every rank: the rows "
    "[load_on_one_rank_only], [save_where_ranks_see_other_directories] and the full disk's",
    (
        "engine/param.py",
        "that needs a sharding mesh",
    ): "both fronts pass a mesh, or refuse DTensors first",
    ("engine/param.py", "only sharding strategies"): "the FSDP1 front refuses DTensors first",
    ("fronts/fsdp2.py", "tensor-parallel (DTensor) parameters"): "needs dp >= 4 beside TP: 8 ranks",
}


def _raise_sites() -> list[tuple[str, int, list[str]]]:
    sites = []
    package = ROOT / "fsdp_lite"
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                parts = [
                    n.value.strip()
                    for arg in node.exc.args
                    for n in ast.walk(arg)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                ]
                sites.append((path.relative_to(package).as_posix(), node.lineno, parts))
    return sites


def test_every_raise_site_is_in_the_table_or_says_why_not():
    doc = " ".join(DOC.read_text().split())
    missing = []
    for name, line, parts in _raise_sites():
        longest = max(parts, key=len, default="")
        if len(longest) >= 8 and " ".join(longest.split()) in doc:
            continue
        if any(
            f == name and (any(key in p for p in parts) if key else not parts)
            for f, key in NOT_IN_THE_TABLE
        ):
            continue
        missing.append(f"fsdp_lite/{name}:{line}: {longest!r}")
    assert not missing, "raise sites missing from docs/errors.md:\n" + "\n".join(missing)


def _rows() -> list[tuple[str, str]]:
    """(error cell, test cell) of every table row of docs/errors.md, headers included."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[0]) <= set("-"):
            rows.append((cells[1], cells[2]))
    return rows


def test_every_row_names_a_test_that_exists():
    current = None
    for error, test in _rows():
        if (error, test) == ("error", "test"):
            continue
        refs = re.findall(r"`([^`]+)`", test)
        assert refs, f"row without a test: {error[:80]} | {test}"
        for ref in refs:
            if ref.startswith("tests/"):
                current = ref
                path, _, func = ref.partition("::")
                func = func.split("[")[0]
                assert (ROOT / path).exists(), ref
                assert not func or f"def {func}(" in (ROOT / path).read_text(), ref
            elif ref.startswith("["):
                assert current, f"{ref} before any test file"
                param = ref.strip("[]")
                source = (ROOT / current.partition("::")[0]).read_text()
                assert f'"{param}"' in source, f"{ref}: no case {param!r} in {current}"
            else:
                func = ref.split("[")[0]
                assert (
                    current and f"def {func}(" in (ROOT / current.partition("::")[0]).read_text()
                ), ref


def _normalize(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "TMP")
    text = re.sub(r"0x[0-9a-f]+", "0x...", text)
    return " ".join(text.split())


def _cases_rank(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    seen = {}
    for case, make in CASES.items():
        directory = Path(tmp) / case
        if rank == 0:
            directory.mkdir()
        dist.barrier()
        try:
            make(Ctx(rank, directory))
        except Exception as e:  # noqa: BLE001 - the test compares type and text
            seen[case] = _normalize(f"{type(e).__name__}: {e}", directory)
        else:
            seen[case] = "no error"
    return seen


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    return run_ranks(_cases_rank, 2, tmp, args=(str(tmp),), timeout=180)


def _documented(case: str) -> list[str]:
    texts = [
        " ".join(t.split())
        for error, test in _rows()
        if f"[{case}]" in test
        # ``...`` spans hold messages with backticks in them (torch's words)
        for a, b in re.findall(r"``(.+?)``|`([^`]+)`", error)
        for t in [a or b]
    ]
    assert texts, f"no row of docs/errors.md names [{case}]"
    return texts


@pytest.mark.parametrize("case", list(CASES))
def test_the_table_holds_the_exact_error(produced, case):
    first = produced[0][case]
    for rank, seen in enumerate(produced):  # the same error; its numbers may be the rank's own
        same = seen[case].partition(":")[0] == first.partition(":")[0]
        assert same, f"rank {rank} said {seen[case]!r}, rank 0 {first!r}"
    assert first in _documented(case), f"[{case}] produced {first!r}; docs/errors.md says otherwise"


def test_uninitialized_torch_distributed_is_named_before_anything_else():
    assert not dist.is_initialized()
    for make, case in (
        (lambda: FSDP(nn.Linear(2, 2)), "fsdp1_without_init"),
        (lambda: fully_shard(nn.Linear(2, 2)), "fully_shard_without_init"),
    ):
        with pytest.raises(RuntimeError) as error:
            make()
        text = _normalize(f"RuntimeError: {error.value}", Path(os.devnull))
        assert text in _documented(case), text


def _two_devices_rank(rank: int, world_size: int) -> str:
    model = build_model("mlp")
    model.fc1.to("cuda")
    try:
        FSDP(model)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


@pytest.mark.gpu
def test_parameters_on_two_devices_need_device_id(tmp_path):
    text = run_ranks(_two_devices_rank, 1, tmp_path, timeout=60)[0]
    assert text in _documented("params_on_two_devices"), text
