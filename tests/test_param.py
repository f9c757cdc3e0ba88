"""param.py in one process: padding and chunking of dim 0, the sharded and unsharded views, storage.

A ``ShardedParam`` only needs its rank and world size to cut its shard; it communicates nothing. So
these tests build rank r of world size N directly, for every r, against a 1-rank gloo mesh (DTensor
takes the global shape as given with ``run_check=False``), and compare with ``torch.chunk``, the rule
Note [Padding] and DTensor's Shard(0) follow.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_lite.engine.param import (
    ReplicatedParam,
    ShardedParam,
    alloc_storage,
    free_storage,
    new_param,
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A 1-rank gloo mesh; reuses a process group some other test left initialized."""
    initialized_here = not dist.is_initialized()
    if initialized_here:
        rendezvous = tmp_path_factory.mktemp("param_pg") / "rendezvous"
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )
    yield DeviceMesh.from_group(dist.group.WORLD, "cpu")
    if initialized_here:
        dist.destroy_process_group()


def _orig_param(shape: tuple[int, ...], requires_grad: bool = True) -> nn.Parameter:
    # Distinct nonzero values, so a wrong row or a missing zero in the padding shows.
    return nn.Parameter(
        torch.arange(1.0, math.prod(shape) + 1).view(shape), requires_grad=requires_grad
    )


def _sharded(mesh, shape, rank, world_size, requires_grad=True, name="w") -> ShardedParam:
    return new_param(
        _orig_param(shape, requires_grad), [], name, mesh, rank, world_size, shard=True
    )


def _expected_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """torch.chunk's rank-th chunk; ranks past the last chunk get no rows."""
    chunks = torch.chunk(full, world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


# (case name, shape, world_size): readable ids, each shape at the world sizes that matter for it.
CASES = [
    ("8x3 divisible", (8, 3), 2),
    ("8x3 divisible", (8, 3), 4),
    ("7x3 uneven", (7, 3), 2),
    ("7x3 uneven", (7, 3), 3),
    ("7x3 uneven", (7, 3), 4),
    ("bias numel 1 < N", (1,), 4),
    ("bias numel 3 < N", (3,), 4),
    ("3-D 5x2x3", (5, 2, 3), 2),
    ("3-D 5x2x3", (5, 2, 3), 3),
    ("dim0 2 < N", (2, 5), 3),
    ("5 rows, chunk gives 3 of 4 chunks", (5, 4), 4),
]
RANK_CASES = [
    pytest.param(shape, world_size, rank, id=f"{name}-N{world_size}-rank{rank}")
    for name, shape, world_size in CASES
    for rank in range(world_size)
]
WORLD_CASES = [
    pytest.param(shape, world_size, id=f"{name}-N{world_size}") for name, shape, world_size in CASES
]


@pytest.mark.parametrize("shape, world_size, rank", RANK_CASES)
def test_shard_sizes_follow_torch_chunk(mesh, shape, world_size, rank):
    p = _sharded(mesh, shape, rank, world_size)
    full = _orig_param(shape).detach()
    expected = _expected_rows(full, rank, world_size)
    row_numel = math.prod(shape[1:])
    case = f"shape {shape}, rank {rank} of {world_size}"
    assert p.orig_size == torch.Size(shape), f"{case}: orig_size {p.orig_size}"
    assert p.shard_rows == torch.chunk(full, world_size)[0].size(0), (
        f"{case}: shard_rows {p.shard_rows}"
    )
    assert p.shard_rows == -(-shape[0] // world_size), f"{case}: shard_rows {p.shard_rows}"
    assert p.local_rows == expected.size(0), (
        f"{case}: local_rows {p.local_rows}, torch.chunk gives {expected.size(0)}"
    )
    assert p.local_numel == expected.numel(), f"{case}: local_numel {p.local_numel}"
    assert p.shard_numel == p.shard_rows * row_numel, f"{case}: shard_numel {p.shard_numel}"
    assert p.padded_numel == world_size * p.shard_numel, f"{case}: padded_numel {p.padded_numel}"
    assert p.padded_numel >= full.numel(), f"{case}: padded_numel {p.padded_numel} < numel"
    assert p.padded_numel - full.numel() < world_size * row_numel, (
        f"{case}: padded_numel {p.padded_numel} pads more than one row per rank"
    )


@pytest.mark.parametrize("shape, world_size, rank", RANK_CASES)
def test_sharded_flat_holds_this_rank_rows_then_zero_padding(mesh, shape, world_size, rank):
    p = _sharded(mesh, shape, rank, world_size)
    expected = _expected_rows(_orig_param(shape).detach(), rank, world_size).reshape(-1)
    case = f"shape {shape}, rank {rank} of {world_size}"
    assert p.sharded_flat.shape == (p.shard_numel,), (
        f"{case}: sharded_flat shape {tuple(p.sharded_flat.shape)}"
    )
    assert p.sharded_flat.dtype == torch.float32, (
        f"{case}: sharded_flat dtype {p.sharded_flat.dtype}"
    )
    torch.testing.assert_close(
        p.sharded_flat[: p.local_numel],
        expected,
        rtol=0,
        atol=0,
        msg=lambda m: f"{case}: rows: {m}",
    )
    padding = p.sharded_flat[p.local_numel :]
    assert bool((padding == 0).all()), f"{case}: padding {padding.tolist()} is not all zeros"


@pytest.mark.parametrize("shape, world_size, rank", RANK_CASES)
def test_sharded_param_is_a_shard0_dtensor_viewing_sharded_flat(mesh, shape, world_size, rank):
    p = _sharded(mesh, shape, rank, world_size)
    expected = _expected_rows(_orig_param(shape).detach(), rank, world_size)
    case = f"shape {shape}, rank {rank} of {world_size}"
    assert isinstance(p.sharded_param, nn.Parameter), f"{case}: sharded_param is not a Parameter"
    assert isinstance(p.sharded_param, DTensor), f"{case}: sharded_param is not a DTensor"
    assert p.sharded_param.placements == (Shard(0),), f"{case}: {p.sharded_param.placements}"
    assert p.sharded_param.shape == torch.Size(shape), (
        f"{case}: global shape {p.sharded_param.shape}"
    )
    assert p.sharded_param.requires_grad, f"{case}: sharded_param lost requires_grad"
    local = p.sharded_param.to_local()
    torch.testing.assert_close(
        local, expected, rtol=0, atol=0, msg=lambda m: f"{case}: to_local(): {m}"
    )
    if p.local_numel:  # an empty tensor's data_ptr says nothing
        assert local.data_ptr() == p.sharded_flat.data_ptr(), (
            f"{case}: to_local() does not view sharded_flat"
        )


@pytest.mark.parametrize("shape, world_size", WORLD_CASES)
def test_shards_of_all_ranks_concatenate_to_the_original(mesh, shape, world_size):
    full = _orig_param(shape).detach()
    shards = [_sharded(mesh, shape, rank, world_size) for rank in range(world_size)]
    gathered = torch.cat([p.sharded_flat for p in shards])  # what the all-gather assembles
    case = f"shape {shape}, world size {world_size}"
    assert gathered.numel() == shards[0].padded_numel, f"{case}: {gathered.numel()} elements"
    torch.testing.assert_close(
        gathered[: full.numel()], full.reshape(-1), rtol=0, atol=0, msg=lambda m: f"{case}: {m}"
    )
    assert bool((gathered[full.numel() :] == 0).all()), f"{case}: padding after the last row"


def test_in_place_update_of_sharded_param_reaches_sharded_flat(mesh):
    # The optimizer steps sharded_param in place; the next all-gather reads sharded_flat.
    p = _sharded(mesh, (7, 3), rank=1, world_size=3)
    before = p.sharded_flat.clone()
    with torch.no_grad():
        p.sharded_param.add_(100.0)
    torch.testing.assert_close(
        p.sharded_flat[: p.local_numel],
        before[: p.local_numel] + 100.0,
        rtol=0,
        atol=0,
        msg=lambda m: f"7x3 rank 1 of 3: sharded_flat after sharded_param.add_: {m}",
    )


def test_requires_grad_false_is_kept_on_sharded_and_unsharded_param(mesh):
    p = _sharded(mesh, (4, 2), rank=0, world_size=2, requires_grad=False, name="frozen")
    assert not p.requires_grad, "frozen: requires_grad recorded as True"
    assert not p.sharded_param.requires_grad, "frozen: sharded_param requires grad"
    assert not p.unsharded_param.requires_grad, "frozen: unsharded_param requires grad"


# ---- storage ------------------------------------------------------------------------------------


def test_free_storage_and_alloc_storage_round_trip():
    tensor = torch.arange(6.0)
    view = tensor[2:].view(2, 2)
    free_storage(tensor)
    assert tensor.untyped_storage().nbytes() == 0, "tensor: storage not freed"
    assert view.untyped_storage().nbytes() == 0, "view: shares the storage, so it is freed too"
    assert tensor.shape == (6,) and view.shape == (2, 2), "free_storage changed a shape"
    free_storage(tensor)  # a second free is a no-op
    assert tensor.untyped_storage().nbytes() == 0, "tensor: second free"

    alloc_storage(tensor, 6 * tensor.element_size())
    assert tensor.untyped_storage().nbytes() == 24, "tensor: storage not given back"
    tensor.copy_(torch.arange(10.0, 16.0))
    torch.testing.assert_close(
        view,
        torch.tensor([[12.0, 13.0], [14.0, 15.0]]),
        rtol=0,
        atol=0,
        msg=lambda m: f"view of the reallocated storage: {m}",
    )
    data_ptr = tensor.data_ptr()
    alloc_storage(tensor, 24)  # already that size: keeps the memory and its contents
    assert tensor.data_ptr() == data_ptr, "tensor: alloc of the same size reallocated"
    torch.testing.assert_close(
        tensor,
        torch.arange(10.0, 16.0),
        rtol=0,
        atol=0,
        msg=lambda m: f"tensor after alloc of the same size: {m}",
    )


@pytest.mark.parametrize("shape, world_size", WORLD_CASES)
def test_unsharded_param_views_unsharded_flat_and_starts_freed(mesh, shape, world_size):
    p = _sharded(mesh, shape, rank=world_size - 1, world_size=world_size)
    case = f"shape {shape}, world size {world_size}"
    assert p.unsharded_param.shape == torch.Size(shape), f"{case}: {p.unsharded_param.shape}"
    assert not isinstance(p.unsharded_param, DTensor), f"{case}: unsharded_param is a DTensor"
    assert p.unsharded_flat.shape == (p.padded_numel,), f"{case}: {p.unsharded_flat.shape}"
    assert p.unsharded_flat.untyped_storage().nbytes() == 0, f"{case}: unsharded_flat allocated"
    assert p.unsharded_param.untyped_storage().nbytes() == 0, f"{case}: unsharded_param allocated"

    p.alloc_unsharded()
    nbytes = p.padded_numel * p.unsharded_flat.element_size()
    assert p.unsharded_flat.untyped_storage().nbytes() == nbytes, f"{case}: alloc_unsharded"
    assert p.unsharded_param.untyped_storage().data_ptr() == (
        p.unsharded_flat.untyped_storage().data_ptr()
    ), f"{case}: unsharded_param has its own storage"
    assert p.unsharded_param.data_ptr() == p.unsharded_flat.data_ptr(), (
        f"{case}: unsharded_param does not start at unsharded_flat[0]"
    )
    with torch.no_grad():
        p.unsharded_flat.copy_(torch.arange(float(p.padded_numel)))
    torch.testing.assert_close(
        p.unsharded_param,
        torch.arange(float(math.prod(shape))).view(shape),
        rtol=0,
        atol=0,
        msg=lambda m: f"{case}: unsharded_param after writing unsharded_flat: {m}",
    )

    p.free_unsharded()
    assert p.unsharded_param.untyped_storage().nbytes() == 0, f"{case}: free_unsharded"


@pytest.mark.parametrize("shape, world_size, rank", RANK_CASES)
def test_writeback_copies_this_rank_rows_into_the_shard(mesh, shape, world_size, rank):
    p = _sharded(mesh, shape, rank, world_size)
    p.alloc_unsharded()
    changed = _orig_param(shape).detach() * -10.0  # as if the user edited the full param
    with torch.no_grad():
        p.unsharded_param.copy_(changed)
        p.unsharded_flat[math.prod(shape) :].fill_(float("nan"))  # padding of the unsharded copy
    p.writeback(p.unsharded_param)
    case = f"shape {shape}, rank {rank} of {world_size}"
    expected = _expected_rows(changed, rank, world_size)
    torch.testing.assert_close(
        p.sharded_flat[: p.local_numel],
        expected.reshape(-1),
        rtol=0,
        atol=0,
        msg=lambda m: f"{case}: shard after writeback: {m}",
    )
    torch.testing.assert_close(
        p.sharded_param.to_local(),
        expected,
        rtol=0,
        atol=0,
        msg=lambda m: f"{case}: sharded_param after writeback: {m}",
    )
    padding = p.sharded_flat[p.local_numel :]
    assert bool((padding == 0).all()), f"{case}: writeback touched the padding: {padding.tolist()}"


def test_land_shard_views_the_slice_then_accumulates(mesh):
    p = _sharded(mesh, (7, 3), rank=2, world_size=3)  # 1 real row, 2 padding rows
    reduce_scatter_output_slice = torch.arange(9.0)  # 1D, shard_numel
    p.land_shard(reduce_scatter_output_slice, keep_dtype=False)
    grad = p.sharded_param.grad
    assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), (
        "7x3 rank 2: grad placement"
    )
    assert grad.shape == torch.Size((7, 3)), f"7x3 rank 2: grad global shape {grad.shape}"
    torch.testing.assert_close(
        grad.to_local(),
        torch.tensor([[0.0, 1.0, 2.0]]),
        rtol=0,
        atol=0,
        msg=lambda m: f"7x3 rank 2: first grad: {m}",
    )
    p.land_shard(torch.full((9,), 10.0), keep_dtype=False)  # a second backward without no_sync adds
    torch.testing.assert_close(
        p.sharded_param.grad.to_local(),
        torch.tensor([[10.0, 11.0, 12.0]]),
        rtol=0,
        atol=0,
        msg=lambda m: f"7x3 rank 2: accumulated grad: {m}",
    )


# ---- what is not sharded ------------------------------------------------------------------------


def test_zero_dim_param_raises_not_implemented_naming_the_param(mesh):
    scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(NotImplementedError, match=r"parameter 'block\.scale' is 0-dimensional"):
        new_param(scale, [], "block.scale", mesh, rank=0, world_size=2, shard=True)


@pytest.mark.parametrize("shape", [(7, 3), (1,), ()], ids=["7x3", "bias numel 1", "0-dim scalar"])
def test_no_shard_keeps_the_original_param_whole(mesh, shape):
    orig = nn.Parameter(torch.ones(shape))
    p = new_param(orig, [], "w", mesh, rank=1, world_size=2, shard=False)
    case = f"NO_SHARD shape {shape}"
    assert isinstance(p, ReplicatedParam), f"{case}: built as {type(p).__name__}"
    assert p.sharded_param is orig, f"{case}: sharded_param is not the original parameter"
    assert p.unsharded_param is orig, f"{case}: forward does not run on the original parameter"
    assert p.unsharded_flat is None, f"{case}: has an unsharded copy"
    assert p.shard_numel == p.padded_numel == p.local_numel == orig.numel(), (
        f"{case}: numels {p.shard_numel}, {p.padded_numel}, {p.local_numel}"
    )
    assert p.sharded_flat.data_ptr() == orig.data_ptr(), f"{case}: sharded_flat is a copy"


def test_point_modules_to_rebinds_every_tied_location(mesh):
    first, second = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    second.weight = first.weight  # tied
    p = new_param(
        first.weight, [(first, "weight"), (second, "weight")], "weight", mesh, 0, 2, shard=True
    )
    p.point_modules_to(p.sharded_param)
    assert first.weight is p.sharded_param, "first.weight: not the sharded_param"
    assert second.weight is p.sharded_param, "second.weight (tied): not the sharded_param"
