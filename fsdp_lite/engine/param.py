"""One parameter under sharding: its shard, its padding, its unsharded copy and its gradient shard.

A ``ShardedParam`` is created when a unit is built and lives as long as the wrapper. It owns the
storage of this rank's shard and of the unsharded copy, and knows which module attributes hold the
parameter; it does not communicate (unit.py and collectives.py do).

Glossary (variables, trace labels and docs use these words exactly):

  orig_param         the nn.Parameter the user built                      ND, full shape
  padded_numel       ceil(dim0 / world_size) * world_size * row_numel     int
  sharded_param      this rank's rows of dim 0, a DTensor Shard(0)        ND, 1/N
                     (Note [Shard dim]: of dim d, Shard(d));
                     what the optimizer steps
  all_gather_input   the unit's sharded params, copied into one buffer    1D, unit_shard_numel
  all_gather_output  every rank's all_gather_input, concatenated          1D, N * unit_shard_numel
  unsharded_param    full-shape tensor copied out of all_gather_output;   ND, full
                     what forward and backward use
  unsharded_grad     the gradient autograd leaves on unsharded_param      ND, full
  reduce_scatter_input  the unit's padded unsharded_grads, rank-major     1D
  reduce_scatter_output this rank's summed slice; becomes sharded_param.grad   1D, 1/N

Note [Tensor parallel parameters]: a parameter that tensor parallelism (``parallelize_module``)
made a DTensor on a TP mesh is sharded as its *local* tensor: orig_size, the rows and the flat
buffers are the TP-local shard's, and the collectives run over the data-parallel group as for any
parameter. Only the DTensors the modules see carry the TP layout: ``unsharded_param`` is a DTensor
on the TP mesh with the original placements (what the TP module's forward expects), and
``sharded_param`` a DTensor on the (dp, tp) mesh with placements (dp placement, *TP placements),
laid out as torch FSDP2 lays it: where TP also cuts dim 0, the dp shard of a TP-local shard is
not one contiguous piece of the global tensor, so the dp placement is ``_StridedShard(0,
split_factor=TP's shards of dim 0)``. Gradients arrive as DTensors on the TP mesh; a Partial one
(a replicated LayerNorm weight under sequence parallelism) is reduced over TP first, then its
local tensor goes into the flat reduction as any gradient.

Note [Shard dim]: ``fully_shard(shard_placement_fn=...)`` may shard a parameter on a dim d other
than 0 (``Shard(1)`` for torchtitan's MoE experts). As in torch FSDP2, d > 0 must divide evenly
(no padding). This rank's shard is then its chunk of dim d, stored contiguous in its own shape
(``local_shape``), so ``sharded_flat`` and the flat collectives are exactly those of dim 0:
rank r's piece of the all-gather is its chunk. Only the two copies between that rank-major layout
and the whole parameter change: the all-gather's copy-out concatenates the N chunks on dim d
(``copy_out_gathered``), and the gradient is cut into its N chunks of dim d, stacked on dim 0,
before the reduce-scatter's copy-in (``rank_major_grad``), which is what torch FSDP2 does. "Rows"
in this file are slices of the shard dim.

Note [Padding]: dim 0 is cut into world_size chunks of ``shard_rows = ceil(dim0 / world_size)`` rows,
the torch.chunk rule that DTensor's Shard(0) also uses, so the last ranks may hold fewer rows or none.
Every rank still stores ``shard_numel`` elements (the missing rows are zeros) so that all ranks
contribute equal-sized pieces to the flat collectives.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdp_lite.engine import offload

__all__ = [
    "ShardedParam",
    "TensorParallel",
    "alloc_storage",
    "free_storage",
    "padded_numel",
    "shard_rows",
    "with_local",
]


def with_local(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor laid out like ``like`` (mesh, placements, global shape) around ``local``."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, by arithmetic (torch's rule: a dim of size
    0 counts as 1). Not from a meta tensor: memory trackers count those as allocations."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def shard_rows(dim0: int, world_size: int) -> int:
    """Rows of dim 0 in each rank's shard: ceil(dim0 / world_size) (Note [Padding])."""
    return -(-dim0 // world_size)


def padded_numel(shape: torch.Size, world_size: int, shard_dim: int = 0) -> int:
    """Elements of a parameter's unsharded buffer: the shard dim rounded up to a multiple of
    world_size."""
    rows = shape[shard_dim]
    return shard_rows(rows, world_size) * world_size * (math.prod(shape) // rows if rows else 0)


def free_storage(tensor: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor object (autograd still points at it)."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give a freed tensor its memory back (contents undefined until written)."""
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


@dataclass(frozen=True)
class TensorParallel:
    """The TP layout of a parameter that arrived as a DTensor (Note [Tensor parallel parameters])."""

    mesh: DeviceMesh  # the TP mesh of the original DTensor
    placements: tuple[Placement, ...]  # its placements there
    shape: torch.Size  # its global shape
    stride: tuple[int, ...]  # its global stride
    sharded_mesh: DeviceMesh  # (dp, tp): the data-parallel mesh's dims, then the TP mesh's
    sharded_placements: tuple[Placement, ...]  # (dp placement, *placements)

    @staticmethod
    def check(param: DTensor, fqn: str, dp_mesh: DeviceMesh | None) -> None:
        """Raise unless ``param`` can be sharded over ``dp_mesh``; local, no collective.

        Raises:
            ValueError: ``dp_mesh`` shares ranks with the TP mesh, or the two are not dims of
                one DeviceMesh.
            NotImplementedError: a layout not built (HSDP with TP, Partial or strided TP
                placements).
        """
        tp_mesh = param.device_mesh
        if dp_mesh is None:
            raise NotImplementedError(f"parameter {fqn!r} is a DTensor; that needs a sharding mesh")
        me = dist.get_rank()
        dp_ranks = set(dp_mesh.mesh.flatten().tolist())
        tp_ranks = set(tp_mesh.mesh.flatten().tolist())
        if dp_ranks & tp_ranks != {me}:
            raise ValueError(
                f"parameter {fqn!r} is a DTensor on a mesh of ranks {sorted(tp_ranks)} "
                f"(dims {tp_mesh.mesh_dim_names}), and the sharding mesh (ranks "
                f"{sorted(dp_ranks)}, dims {dp_mesh.mesh_dim_names}) spans some of them too; "
                "shard over the data-parallel sub-mesh, e.g. mesh['dp']"
            )
        if dp_mesh.ndim != 1:
            raise NotImplementedError(
                f"parameter {fqn!r}: tensor parallel with HSDP (a 2-D sharding mesh) is not built"
            )
        if tp_mesh.ndim != 1 or not all(type(pl) in (Shard, Replicate) for pl in param.placements):
            raise NotImplementedError(
                f"parameter {fqn!r} has placements {param.placements} on a {tp_mesh.ndim}-D mesh; "
                "only Shard and Replicate on a 1-D tensor-parallel mesh are built"
            )
        if dp_mesh._get_root_mesh() is not tp_mesh._get_root_mesh():
            raise ValueError(
                f"parameter {fqn!r}: its tensor-parallel mesh and the sharding mesh are not dims "
                "of one DeviceMesh; build one with init_device_mesh(..., mesh_dim_names=('dp', "
                "'tp')) and pass mesh['dp'] to fully_shard, mesh['tp'] to parallelize_module"
            )

    @classmethod
    def of(
        cls, param: DTensor, fqn: str, dp_mesh: DeviceMesh | None, shard_dim: int = 0
    ) -> TensorParallel:
        """The layout of ``param`` sharded on ``shard_dim`` over ``dp_mesh`` too (raises as
        ``check``)."""
        TensorParallel.check(param, fqn, dp_mesh)
        tp_mesh = param.device_mesh
        split = math.prod(
            tp_mesh.size(i) for i, pl in enumerate(param.placements) if pl == Shard(shard_dim)
        )
        dp_placement = (
            _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        )
        return cls(
            mesh=tp_mesh,
            placements=tuple(param.placements),
            shape=param.size(),
            stride=param.stride(),
            sharded_mesh=DeviceMesh._concatenate([dp_mesh, tp_mesh]),
            sharded_placements=(dp_placement, *param.placements),
        )


class ShardedParam:
    """One original parameter of a unit, sharded on dim 0 (or ``shard_dim``) across the unit's
    process group.

    With ``shard=False`` (NO_SHARD) the parameter stays whole: ``sharded_param`` is the original
    parameter itself and there is no unsharded copy.
    """

    orig_size: torch.Size
    shard_dim: int  # the dim cut into shards: 0 unless shard_placement_fn said (Note [Shard dim])
    shard_rows: int  # rows of the shard dim each rank stores, padding included
    local_rows: int  # rows this rank really has (fewer on the last ranks, see Note [Padding])
    local_shape: torch.Size  # this rank's shard: orig_size with local_rows on the shard dim
    local_numel: int  # local_rows * row_numel: the unpadded part of sharded_flat
    shard_numel: int  # shard_rows * row_numel: this rank's piece of the flat buffers
    padded_numel: int  # world_size * shard_numel
    sharded_flat: torch.Tensor  # 1D, shard_numel, fp32; padding rows stay zero
    disk_files: Any  # a disk_offload.ParamFiles under CPUOffload(offload_dir=...), else None
    sharded_param: nn.Parameter  # DTensor Shard(0) viewing sharded_flat[:local numel]
    unsharded_flat: torch.Tensor | None  # 1D, padded_numel; storage freed while resharded
    unsharded_param: nn.Parameter | None  # full shape, a view of unsharded_flat

    def __init__(
        self,
        orig_param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        fqn: str,
        mesh: DeviceMesh | None,
        rank: int,
        world_size: int,
        shard: bool,
        compute_dtype: torch.dtype | None = None,
        storage_device: torch.device | None = None,
        compute_device: torch.device | None = None,
        unsharded_buffer: torch.Tensor | None = None,
        disk: Any = None,  # a disk_offload.DiskStore (which imports this file)
        shard_dim: int = 0,
    ) -> None:
        if shard and orig_param.dim() == 0:
            raise NotImplementedError(
                f"parameter {fqn!r} is 0-dimensional; sharding on dim 0 needs at least one dim"
            )
        self.shard_dim = shard_dim
        self.tp = None
        if isinstance(orig_param, DTensor):  # Note [Tensor parallel parameters]
            if not shard:
                raise NotImplementedError(
                    f"parameter {fqn!r} is a DTensor; only sharding strategies take DTensors"
                )
            self.tp = TensorParallel.of(orig_param, fqn, mesh, shard_dim)
        self.fqn = fqn
        self.locations = locations  # every (module, attribute) holding this parameter: tied weights
        self.requires_grad = orig_param.requires_grad
        local = orig_param._local_tensor if self.tp is not None else orig_param
        self.orig_size = local.size()  # the TP-local shape for a DTensor
        self.numel = local.numel()
        self.is_sharded = shard
        self.world_size = world_size
        self.rank = rank
        self.mesh = mesh
        # Weak, so the full-size original can be freed; still alive only if something outside the
        # unit holds it, which is how a parameter tied across two units is detected.
        self.orig_param_ref = weakref.ref(orig_param)
        self.disk_files = disk.new_param(fqn) if disk is not None and shard else None
        if not shard:
            self.shard_rows = self.local_rows = self.orig_size[0] if orig_param.dim() else 1
            self.local_shape = self.orig_size
            self.shard_numel = self.padded_numel = self.local_numel = orig_param.numel()
            compute = compute_device or orig_param.device
            storage = storage_device or compute
            if orig_param.device != storage:  # CPU offload: the whole param lives in CPU memory
                moved = offload.new_shard(orig_param.numel(), orig_param.dtype, storage, compute)
                orig_param.data = moved.view(self.orig_size).copy_(orig_param.data)
            self.sharded_param = orig_param
            self.sharded_flat = orig_param.data.view(-1)
            self.unsharded_flat = None
            self.unsharded_param = None
            dtype = compute_dtype or orig_param.dtype
            if dtype != orig_param.dtype or storage != compute:
                # NO_SHARD under mixed precision or CPU offload: forward runs on a copy in the
                # compute dtype on the compute device.
                self.unsharded_flat = torch.empty(self.numel, dtype=dtype, device=compute)
                self.unsharded_param = nn.Parameter(
                    self.unsharded_flat.view(self.orig_size), requires_grad=self.requires_grad
                )
                free_storage(self.unsharded_flat)
            return

        rows = self.orig_size[shard_dim]
        row_numel = self.numel // rows if rows else 0
        self.shard_rows = shard_rows(rows, world_size)
        self.local_rows = max(0, min(self.shard_rows, rows - rank * self.shard_rows))
        self.local_shape = _with_size(self.orig_size, shard_dim, self.local_rows)
        self.shard_numel = self.shard_rows * row_numel
        self.padded_numel = self.shard_numel * world_size

        data = local.detach()
        # The shard lives on storage_device (CPU under CPUOffload); forward runs on compute_device.
        compute = compute_device or data.device
        storage = storage_device or compute
        self.sharded_flat = offload.new_shard(
            self.shard_numel, data.dtype, storage, compute, self.disk_files
        )
        self.local_numel = self.local_rows * row_numel
        self.sharded_flat[: self.local_numel].copy_(self._block(data).reshape(-1))
        self.sharded_param = nn.Parameter(
            self._to_dtensor(self.sharded_flat[: self.local_numel]),
            requires_grad=self.requires_grad,
        )

        # In compute_dtype (MixedPrecision.param_dtype) when set: forward and backward run on it.
        # Meta init materializes the param inside this buffer already (construct._materialize), so
        # the unit is never allocated twice.
        dtype = compute_dtype or data.dtype
        self.unsharded_flat = (
            unsharded_buffer
            if unsharded_buffer is not None
            else torch.empty(self.padded_numel, dtype=dtype, device=compute)
        )
        self.unsharded_param = self._new_unsharded_param()
        free_storage(self.unsharded_flat)

    def _new_unsharded_param(self) -> nn.Parameter:
        """The full-shape parameter forward uses, a view of ``unsharded_flat``; for a TP
        parameter a DTensor on its TP mesh around that view."""
        view = self.unsharded_flat[: self.numel].view(self.orig_size)
        if self.tp is not None:
            view = DTensor.from_local(
                view,
                self.tp.mesh,
                self.tp.placements,
                run_check=False,
                shape=self.tp.shape,
                stride=self.tp.stride,
            )
        return nn.Parameter(view, requires_grad=self.requires_grad)

    def global_box(self) -> list[tuple[int, int]]:
        """The [start, stop) of each dim of the global tensor that this rank's shard covers:
        its rows of the shard dim after tensor parallel's cut (Note [Tensor parallel parameters])."""
        box = [(0, size) for size in (self.tp.shape if self.tp is not None else self.orig_size)]
        if self.tp is not None:
            tp_rank = self.tp.mesh.get_local_rank()
            for pl in self.tp.placements:
                if isinstance(pl, Shard):
                    chunk = -(-self.tp.shape[pl.dim] // self.tp.mesh.size())
                    start = min(tp_rank * chunk, self.tp.shape[pl.dim])
                    box[pl.dim] = (start, start + self.orig_size[pl.dim])
        d = self.shard_dim
        first = box[d][0] + self.rank * self.shard_rows if self.is_sharded else box[d][0]
        rows = self.local_rows if self.is_sharded else self.orig_size[d]
        box[d] = (min(first, box[d][1]), min(first + rows, box[d][1]))
        return box

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The plain tensor the flat reduction takes for ``unsharded_param``'s gradient: for a TP
        parameter, the local tensor of the gradient in the parameter's placements."""
        if grad is None or self.tp is None:
            return grad
        if tuple(grad.placements) != self.tp.placements:
            grad = grad.redistribute(placements=self.tp.placements)  # e.g. Partial -> Replicate
        return grad._local_tensor

    def _to_dtensor(self, local_flat: torch.Tensor) -> DTensor:
        local = local_flat.view(self.local_shape)  # (local_rows, *rest) for shard dim 0
        if self.tp is not None:
            return DTensor.from_local(
                local,
                self.tp.sharded_mesh,
                self.tp.sharded_placements,
                run_check=False,
                shape=self.tp.shape,
                stride=_contiguous_strides(self.tp.shape),
            )
        return DTensor.from_local(
            local,
            self.mesh,
            # HYBRID_SHARD's 2-D (replicate, shard) mesh: the same shard on every replica.
            [Replicate(), Shard(self.shard_dim)]
            if self.mesh.ndim == 2
            else [Shard(self.shard_dim)],
            run_check=False,
            shape=self.orig_size,
            stride=_contiguous_strides(self.orig_size),
        )

    def reset_sharded_param(self, param_dtype: torch.dtype | None) -> bool:
        """Take back the parameter after ``nn.Module._apply`` (``to``, ``double``, ``to_empty``...).

        ``_apply`` leaves new values (maybe of a new dtype) in the module's parameter, no longer
        in ``sharded_flat``; they go back into a shard buffer where they belong (the same one
        when the dtype is unchanged), so that the optimizer's tensor, the all-gather's input and
        the state dict are one tensor again. Without a ``param_dtype`` the unsharded copy follows
        the new dtype. Returns whether ``unsharded_param`` is a new tensor (hooks to register).
        """
        with torch.no_grad():
            return self._reset_sharded_param(param_dtype)

    def _reset_sharded_param(self, param_dtype: torch.dtype | None) -> bool:
        module, attr = self.locations[0]
        current = module._parameters[attr]
        if current is not self.sharded_param:  # _apply made a new Parameter (overwrite mode)
            self.sharded_param = current
            self.point_modules_to(current)
        local = current._local_tensor if isinstance(current, DTensor) else current.data
        if self.is_sharded:
            if local.dtype != self.sharded_flat.dtype:
                self.sharded_flat = offload.new_shard(
                    self.shard_numel,
                    local.dtype,
                    self.sharded_flat.device,
                    self.unsharded_flat.device,
                )
            flat = self.sharded_flat[: self.local_numel]
            if local.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                flat.copy_(local.reshape(-1))
            # What FSDP2's reset_sharded_param does: the DTensor views the shard buffer again.
            current._local_tensor = flat.view(self.local_shape)
        else:
            storage = self.sharded_flat.device
            if local.device != storage:  # CPU offload keeps the whole param in CPU memory
                current.data = local.to(storage)
            self.sharded_flat = current.data.view(-1)
        dtype = param_dtype or local.dtype
        if self.unsharded_flat is None or self.unsharded_flat.dtype == dtype:
            return False
        old = self.unsharded_param
        self.unsharded_flat = torch.empty(
            self.padded_numel, dtype=dtype, device=self.unsharded_flat.device
        )
        self.unsharded_param = self._new_unsharded_param()
        if old.grad is not None:  # accumulated under no_sync: it follows the dtype too
            self.unsharded_param.grad = old.grad.to(dtype)
        free_storage(self.unsharded_flat)
        return True

    def alloc_unsharded(self) -> None:
        alloc_storage(self.unsharded_flat, self.padded_numel * self.unsharded_flat.element_size())

    def free_unsharded(self) -> None:
        free_storage(self.unsharded_flat)

    def point_modules_to(self, param: nn.Parameter) -> None:
        """Make every module attribute that holds this parameter hold ``param``."""
        for module, name in self.locations:
            # Writing _parameters directly: setattr would reject a non-Parameter and run hooks.
            module._parameters[name] = param

    def set_sharded_grad(self, reduce_scatter_output_slice: torch.Tensor, keep_dtype: bool) -> None:
        """Turn this parameter's slice of ``reduce_scatter_output`` into ``sharded_param.grad``.

        The grad takes the shard's (full precision) dtype unless ``keep_dtype``
        (``MixedPrecision.keep_low_precision_grads``). A gradient already there (accumulation
        across backwards without ``no_sync``) is added to.
        """
        local = reduce_scatter_output_slice[: self.local_numel]
        local = offload.to_device(local, self.sharded_flat.device)
        if not keep_dtype:
            local = local.to(self.sharded_flat.dtype)
        elif local.dtype != self.sharded_flat.dtype:
            self.sharded_param.grad_dtype = None  # torch refuses a grad of another dtype otherwise
        grad = self._to_dtensor(local)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad += grad

    def _block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the shard dim of a full-shape tensor (a view; a slice clamps, so
        the last ranks' short or empty blocks need no special case)."""
        start = self.rank * self.shard_rows
        index = (slice(None),) * self.shard_dim + (slice(start, start + self.local_rows),)
        return full[index]

    def rows_of(self, full_flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole, unpadded 1D tensor of this parameter's shape (a view for
        shard dim 0, a copy otherwise)."""
        return self._block(full_flat.view(self.orig_size)).reshape(-1)

    def full_from_rows(self, rows: torch.Tensor, device: torch.device | None) -> torch.Tensor:
        """This parameter, full and unpadded, from its gathered rows (N, shard_numel)."""
        out = torch.empty(self.orig_size, dtype=rows.dtype, device=device or rows.device)
        if self.shard_dim != 0:  # Note [Shard dim]: even, no padding
            return self._concat_shards(rows, out)
        dim0, row_numel = self.orig_size[0], math.prod(self.orig_size[1:])
        if dim0 == 0:
            return out
        out_rows = out.view(dim0, row_numel)  # (dim0, row_numel)
        blocks = rows.view(rows.size(0), self.shard_rows, row_numel)  # (N, shard_rows, row_numel)
        whole_ranks, rest = divmod(dim0, self.shard_rows)  # ranks with all rows; rows of the next
        out_rows[: whole_ranks * self.shard_rows].view(
            whole_ranks, self.shard_rows, row_numel
        ).copy_(blocks[:whole_ranks])
        if rest:
            out_rows[whole_ranks * self.shard_rows :].copy_(blocks[whole_ranks, :rest])
        return out

    # Note [Shard dim]: the copies between the rank-major layout of the flat collectives and the
    # whole parameter. For shard dim 0 they are no copies at all: the padded unsharded buffer is
    # rank-major already.

    def gather_target(self) -> torch.Tensor:
        """Where the all-gather's copy-out puts this parameter's N shards: the padded unsharded
        buffer itself for shard dim 0, else a temporary that ``copy_out_gathered`` concatenates."""
        if self.shard_dim == 0:
            return self.unsharded_flat
        return self.unsharded_flat.new_empty(self.padded_numel)

    def copy_out_gathered(self, target: torch.Tensor) -> None:
        """The N shards in ``target`` (from ``gather_target``) as the whole unsharded param."""
        if target is not self.unsharded_flat:
            self._concat_shards(target, self.unsharded_flat.view(self.orig_size))

    def _concat_shards(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The N shards in ``rows`` (N x shard_numel), concatenated on the shard dim into
        ``out`` (shard dim > 0: even, no padding)."""
        chunks = rows.view(self.world_size, *self.local_shape).unbind(0)
        return torch.cat(chunks, self.shard_dim, out=out)

    def gathered_rows(self, ranks: slice) -> torch.Tensor:
        """The shards of ``ranks`` from the unsharded buffer, (len(ranks), shard_numel)."""
        if self.shard_dim == 0:
            return self.unsharded_flat.view(self.world_size, -1)[ranks]
        chunks = self.unsharded_flat.view(self.orig_size).chunk(self.world_size, self.shard_dim)
        return torch.stack(chunks[ranks]).view(-1, self.shard_numel)

    def rank_major_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` laid out as the reduce-scatter's copy-in cuts it (on dim 0): for another
        shard dim, its N chunks of that dim stacked on dim 0, as torch FSDP2 does."""
        if self.shard_dim == 0:
            return grad
        return torch.cat(torch.chunk(grad, self.world_size, dim=self.shard_dim), dim=0)

    def writeback(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of a full-shape tensor into the shard (after summon_full_params)."""
        self.sharded_flat[: self.local_numel].copy_(self._block(full.detach()).reshape(-1))


def _with_size(shape: torch.Size, dim: int, size: int) -> torch.Size:
    return torch.Size((*shape[:dim], size, *shape[dim + 1 :]))
