"""Where each sharded matrix lies and which rank owns it: WholeMatrix's placement.

A matrix's shard group is the mesh dims that cut it, flattened (torch's ``DeviceMesh._flatten``
where there are several); each rank of the group holds one box of the matrix, from DTensor's own
layout rule. Owners: the matrices of one group, largest cost first (ties in parameter order),
each to the least loaded rank so far (ties to the lowest rank); every rank computes the same
placement from the shapes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["Layout", "balance", "flatten", "newton_schulz_cost", "spec_of"]


def newton_schulz_cost(shape: torch.Size) -> int:
    """Newton-Schulz's flops up to a constant, ``m * n * min(m, n)``: the default cost."""
    m, n = shape[0], shape[1]
    return m * n * min(m, n)


@dataclass(frozen=True)
class Layout:
    """How one sharded matrix lies across its shard group, and which rank of it owns it."""

    group: dist.ProcessGroup  # the shard group: the mesh dims that cut the matrix, flattened
    rank: int  # this rank in ``group``
    boxes: tuple[tuple[tuple[int, int], ...], ...]  # per group rank: [start, stop) of each dim
    shape: torch.Size  # the whole matrix
    owner: int  # the owner's rank in ``group``

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.boxes[rank])

    def piece_numel(self, rank: int) -> int:
        return math.prod(self.piece_shape(rank))

    def piece_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of a whole matrix (a view)."""
        return whole[tuple(slice(start, stop) for start, stop in self.boxes[rank])]

    def cut(self) -> str:
        """The pieces, for ``explain``: ``dim 0 cut 4/3`` where one dim is cut in rank order,
        else each rank's block (``blocks 0:4,0:12 8:12,0:12 ...``)."""
        shapes = [self.piece_shape(r) for r in range(len(self.boxes))]
        dims = [d for d in range(len(self.shape)) if any(s[d] != self.shape[d] for s in shapes)]
        starts = [box[dims[0]][0] for box in self.boxes] if len(dims) == 1 else []
        if starts and starts == sorted(starts):
            return f"dim {dims[0]} cut " + "/".join(str(s[dims[0]]) for s in shapes)
        return "blocks " + " ".join(
            ",".join(f"{start}:{stop}" for start, stop in box) for box in self.boxes
        )


def spec_of(param: torch.Tensor, name: str) -> dict | None:
    """The shard group (the mesh dims that cut ``param``, flattened), this rank in it and
    every group rank's piece of the matrix; None where it is held whole."""
    if not isinstance(param, DTensor):
        return None
    placements, mesh = param.placements, param.device_mesh
    if any(type(pl) not in (Shard, Replicate, _StridedShard) for pl in placements):
        raise NotImplementedError(
            f"{name} on a parameter with placements {placements}: only Shard, "
            "Replicate and FSDP's strided shard over tensor parallel's cut are built (not "
            "a partial one)"
        )
    cut = [d for d, pl in enumerate(placements) if type(pl) is not Replicate]
    cut = [d for d in cut if mesh.size(d) > 1]
    if not cut:
        return None
    if param.ndim != 2:
        raise ValueError(
            f"{name}: a sharded parameter of shape {tuple(param.shape)}; only matrices "
            "(2-D) are built"
        )
    for d in cut:
        pl = placements[d]
        # FSDP over TP's cut of the same tensor dim: each rank's piece is one box of the
        # matrix. Another strided layout interleaves rows, which the boxes cannot say.
        if type(pl) is _StridedShard and pl.split_factor != math.prod(
            mesh.size(j)
            for j in range(d + 1, mesh.ndim)
            if type(placements[j]) is Shard and placements[j].dim == pl.dim
        ):
            raise NotImplementedError(
                f"{name} on a parameter with placements {placements}: a strided shard "
                "other than FSDP's over tensor parallel's cut of the same dim is not built"
            )
    if len(cut) == 1:
        group, rank = mesh.get_group(cut[0]), mesh.get_local_rank(cut[0])
    else:  # FSDP's and tensor parallel's dims: one group over both
        flat = flatten(mesh, cut, name, placements)
        group, rank = flat.get_group(), flat.get_local_rank()
    boxes = []
    for global_rank in dist.get_process_group_ranks(group):
        coordinate = (mesh.mesh == global_rank).nonzero()[0].tolist()
        shape, offset = _compute_local_shape_and_global_offset(
            param.shape, mesh.shape, coordinate, placements
        )
        boxes.append(tuple((o, o + n) for o, n in zip(offset, shape)))
    return {"group": group, "rank": rank, "boxes": tuple(boxes)}


def flatten(mesh: DeviceMesh, dims: list[int], name: str, placements) -> DeviceMesh:
    """The 1-D mesh of ``mesh``'s ``dims`` flattened (torch's ``_flatten``, made once and kept)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError(
            f"{name} on a parameter with placements {placements} on a mesh without dim names: "
            "a matrix cut on several mesh dims needs their names to flatten them"
        )
    sub = mesh if len(dims) == mesh.ndim else mesh[tuple(names[d] for d in dims)]
    return sub._flatten()


def balance(costs: list[int], ranks: int) -> list[int]:
    """Greedy: largest cost first (ties: the earlier one), to the least loaded rank (ties: lowest)."""
    load, owners = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners
