"""One parameter under sharding: its shard, its padding, its unsharded copy and its gradient shard.

A ``Param`` is created when a unit is built (``new_param``) and lives as long as the wrapper. It
owns the storage of this rank's shard and of the unsharded copy, knows which module attributes
hold the parameter, and turns its slice of a reduced gradient into the optimizer's gradient; it
does not communicate (unit.py and collectives.py do).

Note [Parameter kinds]: what a strategy changes about one parameter is chosen once, by
``new_param``, as its class; the unit calls the same methods on every kind.

  ShardedParam         sharded strategies: 1/N rows kept; forward runs on a copy gathered by
                       the unit's all-gather; its gradient slice lands as its rows
                       (``land_shard``), or, from ZeRO-1's all-reduce, its rows of the whole
                       average (``land_whole``)
  ReplicatedParam      NO_SHARD: kept whole; forward runs on the parameter itself, so there is
                       nothing to allocate, fill or free; the average replaces its gradient
  ReplicatedCopyParam  NO_SHARD under a param_dtype or CPU offload: forward runs on a local copy
                       (cast, no collective); the average is added to its gradient

NO_SHARD is not a shard group of one: a ShardedParam on a 1-rank mesh would make the optimizer
step DTensors where torch's NO_SHARD (and every client) has plain parameters.

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

Note [SPMD mesh parameters]: under ``fully_shard(dp_mesh_dims=...)`` (torch 2.13's SPMD mode) the
parameters arrive as DTensors on the whole SPMD mesh, ``Replicate()`` on its data-parallel dims and
tensor parallel's placements on the others; the inputs are DTensors sharded on the batch. It is
the TP case above with the TP mesh replaced by the whole mesh (``SpmdLayout``): the local tensor is
sharded over the shard dim's group; ``unsharded_param`` is a DTensor on the whole mesh with the
original placements; ``sharded_param`` has Shard(d) (or ``_StridedShard`` where later mesh dims
cut dim d too) on the shard dim and Replicate on HSDP's replica dim, as torch lays it out; a
gradient keeps its placements (Partial) on the data-parallel dims, whose reduction is the flat
one, and only its other dims are redistributed to the parameter's placements, as torch does.

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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdp_lite.engine import local_step, offload

if TYPE_CHECKING:  # disk.py builds on this file
    from fsdp_lite.engine.disk import DiskStore, ParamFiles

__all__ = [
    "Param",
    "dtensor_like",
    "ReplicatedCopyParam",
    "ReplicatedParam",
    "ParamOptions",
    "ShardedParam",
    "SpmdLayout",
    "refuse_all_gather_extension",
    "TensorParallel",
    "alloc_storage",
    "free_storage",
    "new_param",
    "padded_numel",
    "shard_rows",
]


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
class SpmdLayout:
    """``fully_shard(dp_mesh_dims=...)``: the whole SPMD mesh and its data-parallel dims (Note
    [SPMD mesh parameters])."""

    mesh: DeviceMesh
    shard_dim: int  # the mesh dim FSDP shards over
    replicate_dim: int | None  # HSDP's replica dim, or None

    @property
    def dp_dims(self) -> frozenset[int]:
        return frozenset(d for d in (self.shard_dim, self.replicate_dim) if d is not None)


@dataclass(frozen=True)
class ParamOptions:
    """How one parameter is built beyond its place in the unit: the dtype forward runs in, where
    its shard and its forward copy live, a buffer it must live in (meta init), its files (disk
    offload), the dim it is cut on and an SPMD mesh (``new_param``'s choices come from these)."""

    compute_dtype: torch.dtype | None = None  # MixedPrecision.param_dtype; None: its own
    storage_device: torch.device | None = None  # the shard's (CPU under CPUOffload)
    compute_device: torch.device | None = None  # where forward runs; None: where it is
    unsharded_buffer: torch.Tensor | None = None  # meta init's buffer for the unsharded copy
    disk: DiskStore | None = None  # disk offload's files
    shard_dim: int = 0
    spmd: SpmdLayout | None = None


@dataclass(frozen=True)
class TensorParallel:
    """The TP layout of a parameter that arrived as a DTensor (Note [Tensor parallel parameters]),
    or one on an SPMD mesh (Note [SPMD mesh parameters])."""

    mesh: DeviceMesh  # the mesh of the original DTensor: TP's, or the whole SPMD mesh
    placements: tuple[Placement, ...]  # its placements there
    shape: torch.Size  # its global shape
    stride: tuple[int, ...]  # its global stride
    sharded_mesh: DeviceMesh  # (dp, tp): the data-parallel mesh's dims, then the TP mesh's
    sharded_placements: tuple[Placement, ...]  # (dp placement, *placements)
    dp_dims: frozenset[int] = frozenset()  # dims of ``mesh`` the flat reduction reduces over

    @staticmethod
    def check_spmd(param: torch.Tensor, fqn: str, spmd: SpmdLayout) -> None:
        """Raise, with torch's classes and words, unless ``param`` is a DTensor on ``spmd.mesh``
        replicated on its data-parallel dims; local, no collective."""
        if not isinstance(param, DTensor):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full "
                "SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
                f"'{fqn}'."
            )
        if param.device_mesh is not spmd.mesh:
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but "
                f"got different mesh objects (parameter {fqn!r})"
            )
        names = spmd.mesh.mesh_dim_names
        for idx, kind in ((spmd.shard_dim, "shard"), (spmd.replicate_dim, "replicate")):
            if idx is not None and not isinstance(param.placements[idx], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{names[idx]}' (index {idx}) but "
                    f"got {param.placements[idx]}"
                )
        if not all(type(pl) in (Shard, Replicate) for pl in param.placements):
            raise NotImplementedError(
                f"parameter {fqn!r} has placements {param.placements}; only Shard and Replicate "
                "on the non-data-parallel dims are built"
            )

    @classmethod
    def of_spmd(
        cls, param: DTensor, fqn: str, spmd: SpmdLayout, shard_dim: int = 0
    ) -> TensorParallel:
        """The layout of ``param`` sharded on ``shard_dim`` over ``spmd``'s shard dim (raises
        as ``check_spmd``)."""
        TensorParallel.check_spmd(param, fqn, spmd)
        mesh, placements = spmd.mesh, tuple(param.placements)
        # torch's split factor: the later mesh dims that cut the same tensor dim.
        split = math.prod(
            mesh.size(j)
            for j in range(spmd.shard_dim + 1, mesh.ndim)
            if isinstance(placements[j], Shard) and placements[j].dim == shard_dim
        )
        sharded = list(placements)
        sharded[spmd.shard_dim] = (
            _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        )
        return cls(
            mesh=mesh,
            placements=placements,
            shape=param.size(),
            stride=param.stride(),
            sharded_mesh=mesh,
            sharded_placements=tuple(sharded),
            dp_dims=spmd.dp_dims,
        )

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
        # Equal, not identical: torch FSDP2 takes a TP mesh from another init_device_mesh call
        # of the same shape and names (DeviceMesh equality).
        if dp_mesh._get_root_mesh() != tp_mesh._get_root_mesh():
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


def dtensor_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``param``'s spec around ``local`` (of its local shape, dtype and device),
    made as torch FSDP2 makes its gradients: the spec is shared, not rebuilt, and no autograd
    function runs (``from_local`` costs about as much as the rest of a unit's backward on the
    host, scripts/bench_host_overhead.py). DTensor's constructor and ``_spec`` are torch's
    private names (torch 2.4-2.13), used here only; tests/test_local_step.py pins them."""
    return DTensor(local, param._spec, requires_grad=False)


def refuse_all_gather_extension(tensor: torch.Tensor, fqn: str) -> None:
    """Raise if ``tensor`` (a parameter, or a shard's local tensor) carries torch FSDP2's
    all-gather extension, which fsdp_lite does not call: gathering its plain data instead would
    train something else than torch does (float8 and other tensor subclasses use it)."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    for hook in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
        if hasattr(local, hook):
            raise NotImplementedError(
                f"parameter {fqn!r} ({type(local).__name__}) defines {hook}, torch FSDP2's "
                "all-gather extension; fsdp_lite does not call it: not built"
            )


class Param:
    """What every parameter a unit holds has, whatever its kind: its name and places in the
    modules, its shapes, the tensor the optimizer steps (``sharded_param``) and its buffer
    (``sharded_flat``). Built once per parameter by ``new_param``; lives as long as the unit.

    The kinds differ in how forward gets an unsharded copy and where a reduced gradient lands
    (Note [Parameter kinds]); a unit calls the same methods on every kind, and chooses nothing.
    """

    is_sharded: bool  # the kind's, for state dicts: sharded_param is 1/N of the parameter
    orig_size: torch.Size
    shard_dim: int  # the dim cut into shards: 0 unless shard_placement_fn said (Note [Shard dim])
    shard_rows: int  # rows of the shard dim each rank stores, padding included
    local_rows: int  # rows this rank really has (fewer on the last ranks, see Note [Padding])
    local_shape: torch.Size  # this rank's shard: orig_size with local_rows on the shard dim
    local_numel: int  # local_rows * row_numel: the unpadded part of sharded_flat
    shard_numel: int  # shard_rows * row_numel: this rank's piece of the flat buffers
    padded_numel: int  # world_size * shard_numel
    sharded_flat: torch.Tensor  # 1D, shard_numel; padding rows stay zero
    disk_files: ParamFiles | None  # its files under CPUOffload(offload_dir=...), else None
    sharded_param: nn.Parameter  # what the optimizer steps
    tp: TensorParallel | None  # its tensor-parallel layout (Note [Tensor parallel parameters])

    def __init__(
        self,
        orig_param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        fqn: str,
        mesh: DeviceMesh | None,
        rank: int,
        world_size: int,
    ) -> None:
        self.fqn = fqn
        self.locations = locations  # every (module, attribute) holding this parameter: tied weights
        self.requires_grad = orig_param.requires_grad
        self.world_size = world_size
        self.rank = rank
        self.mesh = mesh
        # Weak, so the full-size original can be freed; still alive only if something outside the
        # unit holds it, which is how a parameter tied across two units is detected.
        self.orig_param_ref = weakref.ref(orig_param)
        self.shard_dim = 0
        self.tp = None
        self.disk_files = None
        self.hooked_copy: torch.Tensor | None = None  # the copy runtime.register_grad_hooks hooked
        # Unsynced backwards' gradients in the reduce dtype (keep_unsynced_grad); 1D or the
        # copy's shape, a plain tensor.
        self.unsharded_accumulated_grad: torch.Tensor | None = None

    def point_modules_to(self, param: nn.Parameter) -> None:
        """Make every module attribute that holds this parameter hold ``param``."""
        for module, name in self.locations:
            # Writing _parameters directly: setattr would reject a non-Parameter and run hooks.
            module._parameters[name] = param

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient autograd left on the copy forward ran on (a plain tensor), added to what
        backwards without gradient sync kept (``keep_unsynced_grad``), dropped from both: the
        reduction's buffer holds its data from now on."""
        self._add_to_accumulated()
        grad, self.unsharded_accumulated_grad = self.unsharded_accumulated_grad, None
        if grad is None:
            holder = self.unsharded_param
            grad = self.local_grad(holder.grad)
            holder.grad = None
        return grad

    def keep_unsynced_grad(self, reduce_dtype: torch.dtype) -> None:
        """A backward without gradient sync ended: keep its gradient in ``reduce_dtype``, where
        the next ones add theirs, instead of summing them in the compute dtype (torch FSDP2's
        accumulation; Note [Unsynced accumulation] in unit.py)."""
        self._add_to_accumulated()
        grad = self.local_grad(self.unsharded_param.grad)
        if self.unsharded_accumulated_grad is None and grad is not None:
            if grad.dtype != reduce_dtype:
                self.unsharded_accumulated_grad = grad.to(reduce_dtype)
                self.unsharded_param.grad = None

    def _add_to_accumulated(self) -> None:
        grad = self.local_grad(self.unsharded_param.grad)
        if self.unsharded_accumulated_grad is not None and grad is not None:
            self.unsharded_accumulated_grad += grad
            self.unsharded_param.grad = None

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad

    def drop_unsharded_grad(self) -> None:
        """Forget the gradient autograd left on the unsharded copy, and what backwards without
        gradient sync kept (a step that raised)."""
        self.unsharded_param.grad = None
        self.unsharded_accumulated_grad = None

    def run_grad_hooks(self) -> None:
        """Run ``sharded_param``'s post-accumulate-grad hooks, its reduced gradient just landed:
        torch FSDP2 does (an optimizer stepped from a hook, per parameter), and autograd never
        accumulates into the parameter the optimizer holds
        (``UnitSettings.runs_sharded_grad_hooks``)."""
        hooks = getattr(self.sharded_param, "_post_accumulate_grad_hooks", None) or {}
        for hook in tuple(hooks.values()):
            hook(self.sharded_param)

    def reset_sharded_param(self, param_dtype: torch.dtype | None) -> bool:
        """Take back the parameter after ``nn.Module._apply`` (``to``, ``double``, ``to_empty``...).

        ``_apply`` leaves new values (maybe of a new dtype) in the module's parameter, no longer
        in ``sharded_flat``; they go back where they belong (the same buffer when the dtype is
        unchanged), so that the optimizer's tensor, the all-gather's input and the state dict are
        one tensor again. Without a ``param_dtype`` the unsharded copy follows the new dtype.
        Returns whether ``unsharded_param`` is a new tensor (hooks to register).
        """
        with torch.no_grad():
            module, attr = self.locations[0]
            current = module._parameters[attr]
            if current is not self.sharded_param:  # _apply made a new Parameter (overwrite mode)
                self.sharded_param = current
                local_step.track(self)
                self.point_modules_to(current)
            return self._take_back(current, param_dtype)

    def _take_back(self, current: nn.Parameter, param_dtype: torch.dtype | None) -> bool:
        raise NotImplementedError

    def replacement(self, held: torch.Tensor, fqn: str) -> nn.Parameter | None:
        """The parameter the modules hold instead of ``held`` (what the unit left there), checked;
        None if they hold ``held`` (runtime.py, Note [Replaced parameters]); errors name it ``fqn``
        (its path from the root). Local: no collective."""
        current = [module._parameters.get(name) for module, name in self.locations]
        if all(c is held for c in current):
            return None
        places = [f"{type(m).__name__}.{n}" for m, n in self.locations]
        if any(c is None for c in current):
            where = places[next(i for i, c in enumerate(current) if c is None)]
            raise ValueError(
                f"parameter {fqn!r} ({where}) was deleted or set to None after wrapping; "
                "a wrapped module's parameter can be replaced by another, not removed"
            )
        new = current[0]
        if any(c is not new for c in current):
            raise ValueError(
                f"parameter {fqn!r} is tied ({', '.join(places)}) and was replaced after "
                "wrapping in some of these and not the others, or by different parameters; "
                "replace it by one parameter in all of them (or untie it before wrapping)"
            )
        self._check_replacement(new, fqn)
        return new

    def _check_replacement(self, new: torch.Tensor, fqn: str) -> None:
        """Raise unless ``new`` can take this parameter's place (shape, layout, requires_grad)."""
        old = self.sharded_param
        if new.requires_grad != old.requires_grad:
            raise ValueError(
                f"parameter {fqn!r} was replaced after wrapping by one with requires_grad="
                f"{new.requires_grad} (it had {old.requires_grad}); set requires_grad before "
                "wrapping, or on the replacement to match"
            )
        if new.device.type == "meta":
            raise ValueError(
                f"parameter {fqn!r} was replaced after wrapping by a meta tensor; replace it "
                "by one with values (or use to_empty and initialize before the first forward)"
            )
        if self.disk_files is not None and _local(new).dtype != self.sharded_flat.dtype:
            raise ValueError(
                f"parameter {fqn!r} is disk-offloaded and was replaced after wrapping by one "
                f"in {_local(new).dtype} (its shards are {self.sharded_flat.dtype}); keep its dtype"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedParam(Param):
    """One original parameter of a unit, sharded on dim 0 (or ``shard_dim``) across the unit's
    process group: this rank keeps its rows in ``sharded_flat``, and forward runs on
    ``unsharded_param``, copied out of the unit's all-gather."""

    is_sharded = True
    unsharded_flat: torch.Tensor  # 1D, padded_numel, param_dtype; storage freed while resharded
    unsharded_param: nn.Parameter  # full shape, a view of unsharded_flat

    def __init__(
        self,
        orig_param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        fqn: str,
        mesh: DeviceMesh | None,
        rank: int,
        world_size: int,
        options: ParamOptions = ParamOptions(),
    ) -> None:
        compute_dtype, storage_device = options.compute_dtype, options.storage_device
        compute_device, unsharded_buffer = options.compute_device, options.unsharded_buffer
        disk, shard_dim, spmd = options.disk, options.shard_dim, options.spmd
        if orig_param.dim() == 0:
            raise NotImplementedError(
                f"parameter {fqn!r} is 0-dimensional; sharding on dim 0 needs at least one dim"
            )
        super().__init__(orig_param, locations, fqn, mesh, rank, world_size)
        self.shard_dim = shard_dim
        if spmd is not None:  # Note [SPMD mesh parameters]
            self.tp = TensorParallel.of_spmd(orig_param, fqn, spmd, shard_dim)
        elif isinstance(orig_param, DTensor):  # Note [Tensor parallel parameters]
            self.tp = TensorParallel.of(orig_param, fqn, mesh, shard_dim)
        local = orig_param._local_tensor if self.tp is not None else orig_param
        self.orig_size = local.size()  # the TP-local shape for a DTensor
        self.numel = local.numel()
        self.disk_files = None if disk is None else disk.new_param(fqn, grads=self.requires_grad)

        rows = self.orig_size[shard_dim]
        row_numel = self.numel // rows if rows else 0
        self.shard_rows = shard_rows(rows, world_size)
        self.local_rows = max(0, min(self.shard_rows, rows - rank * self.shard_rows))
        self.local_shape = _with_size(self.orig_size, shard_dim, self.local_rows)
        self.shard_numel = self.shard_rows * row_numel
        self.padded_numel = self.shard_numel * world_size
        self.local_numel = self.local_rows * row_numel

        data = local.detach()
        # The shard lives on storage_device (CPU under CPUOffload); forward runs on compute_device.
        compute = compute_device or data.device
        storage = storage_device or compute
        self.sharded_flat = offload.new_shard(
            self.shard_numel, data.dtype, storage, compute, self.disk_files
        )
        self.sharded_flat[: self.local_numel].copy_(self._block(data).reshape(-1))
        offload.after_shard_written(self.disk_files)
        self.sharded_param = nn.Parameter(
            self._to_dtensor(self.sharded_flat[: self.local_numel]),
            requires_grad=self.requires_grad,
        )
        local_step.track(self)
        # In compute_dtype (MixedPrecision.param_dtype) when set: forward and backward run on it.
        # Meta init materializes the param inside this buffer already (construct._materialize), so
        # the unit is never allocated twice.
        self.unsharded_flat = (
            unsharded_buffer
            if unsharded_buffer is not None
            else torch.empty(self.padded_numel, dtype=compute_dtype or data.dtype, device=compute)
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
            for i, pl in enumerate(self.tp.placements):  # one TP dim cuts a tensor dim
                if isinstance(pl, Shard):
                    chunk = -(-self.tp.shape[pl.dim] // self.tp.mesh.size(i))
                    start = min(self.tp.mesh.get_local_rank(i) * chunk, self.tp.shape[pl.dim])
                    box[pl.dim] = (start, start + self.orig_size[pl.dim])
        d = self.shard_dim
        first = box[d][0] + self.rank * self.shard_rows
        box[d] = (min(first, box[d][1]), min(first + self.local_rows, box[d][1]))
        return box

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The plain tensor the flat reduction takes for ``unsharded_param``'s gradient: for a TP
        parameter, the local tensor of the gradient in the parameter's placements."""
        if grad is None or self.tp is None:
            return grad
        # The data-parallel dims (an SPMD mesh's) keep theirs: the flat reduction is theirs.
        target = tuple(
            grad.placements[i] if i in self.tp.dp_dims else pl
            for i, pl in enumerate(self.tp.placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)  # e.g. Partial -> Replicate
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

    def _take_back(self, current: nn.Parameter, param_dtype: torch.dtype | None) -> bool:
        local = current._local_tensor if isinstance(current, DTensor) else current.data
        if local.dtype != self.sharded_flat.dtype:
            self.sharded_flat = offload.new_shard(
                self.shard_numel, local.dtype, self.sharded_flat.device, self.unsharded_flat.device
            )
        flat = self.sharded_flat[: self.local_numel]
        if local.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            flat.copy_(local.reshape(-1))
        # What FSDP2's reset_sharded_param does: the DTensor views the shard buffer again.
        current._local_tensor = flat.view(self.local_shape)
        return self._follow_dtype(param_dtype or local.dtype)

    def _check_replacement(self, new: torch.Tensor, fqn: str) -> None:
        """A replacement must be laid out as ``sharded_param``: a DTensor on the same mesh, with
        the same placements, global shape and this rank's shape of it, as torch FSDP2 requires
        (its lazy init reads the replacement's local tensor as the shard)."""
        old = self.sharded_param
        layout = (
            f"a DTensor on the parameter's mesh with placements {tuple(old.placements)}, global "
            f"shape {tuple(old.shape)} and local shape {tuple(self.local_shape)} (e.g. "
            "DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, "
            "stride=p.stride()) of the parameter p it replaces)"
        )
        if not isinstance(new, DTensor):
            raise TypeError(
                f"parameter {fqn!r} was replaced after wrapping by a plain "
                f"{type(new).__name__} of shape {tuple(new.shape)}; a replacement of a sharded "
                f"parameter must be {layout}"
            )
        if (
            new.device_mesh != old.device_mesh
            or tuple(new.placements) != tuple(old.placements)
            or new.shape != old.shape
            or new._local_tensor.shape != self.local_shape
        ):
            raise ValueError(
                f"parameter {fqn!r} was replaced after wrapping by a DTensor with placements "
                f"{tuple(new.placements)}, global shape {tuple(new.shape)} and local shape "
                f"{tuple(new._local_tensor.shape)}; it must be {layout}"
            )
        super()._check_replacement(new, fqn)

    def _follow_dtype(self, dtype: torch.dtype) -> bool:
        """A new unsharded copy in ``dtype`` if the old one is in another (see _take_back)."""
        if self.unsharded_flat.dtype == dtype:
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

    def land_shard(self, reduce_scatter_output_slice: torch.Tensor, keep_dtype: bool) -> None:
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
        if local.dtype == self.sharded_param.dtype:
            grad = dtensor_like(self.sharded_param, local.view(self.local_shape))
        else:
            grad = self._to_dtensor(local)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad += grad

    def land_whole(self, averaged_grad: torch.Tensor, keep_dtype: bool) -> None:
        """ZeRO-1: every rank holds the whole averaged gradient; this rank's rows become its
        ``sharded_param.grad`` (a view for shard dim 0)."""
        self.land_shard(self.rows_of(averaged_grad), keep_dtype)

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


class ReplicatedParam(Param):
    """A NO_SHARD parameter: every rank holds it whole, ``sharded_param`` is the original
    parameter itself, and forward runs on it (it is its own unsharded copy)."""

    is_sharded = False

    def __init__(
        self,
        orig_param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        fqn: str,
        mesh: DeviceMesh | None,
        rank: int,
        world_size: int,
        storage_device: torch.device | None = None,
    ) -> None:
        if isinstance(orig_param, DTensor):
            raise NotImplementedError(
                f"parameter {fqn!r} is a DTensor; only sharding strategies take DTensors"
            )
        super().__init__(orig_param, locations, fqn, mesh, rank, world_size)
        self.orig_size = orig_param.size()
        self.numel = orig_param.numel()
        self.shard_rows = self.local_rows = self.orig_size[0] if orig_param.dim() else 1
        self.local_shape = self.orig_size
        self.shard_numel = self.padded_numel = self.local_numel = self.numel
        storage = storage_device or orig_param.device
        if orig_param.device != storage:  # CPU offload: the whole param lives in CPU memory
            moved = offload.new_shard(self.numel, orig_param.dtype, storage, storage)
            orig_param.data = moved.view(self.orig_size).copy_(orig_param.data)
        self.sharded_param = orig_param
        self.sharded_flat = orig_param.data.view(-1)

    @property
    def unsharded_param(self) -> nn.Parameter:
        return self.sharded_param

    @property
    def unsharded_flat(self) -> None:
        return None  # nothing of its own to allocate or free

    def alloc_unsharded(self) -> None:
        """Nothing to allocate: forward runs on the parameter itself."""

    def free_unsharded(self) -> None:
        """Nothing to free: the parameter is what the optimizer steps."""

    def fill_unsharded(self) -> None:
        """Nothing to fill: forward runs on the parameter itself."""

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient autograd accumulated on the parameter; it stays there, and the average
        is written into it (``land_whole``), as DDP does."""
        return self.sharded_param.grad

    def drop_unsharded_grad(self) -> None:
        """Nothing: the parameter's own gradient is the optimizer's too (a step that raised
        leaves it, as DDP does)."""

    def keep_unsynced_grad(self, reduce_dtype: torch.dtype) -> None:
        """Nothing: autograd accumulates in the parameter's own grad, as DDP does."""

    def run_grad_hooks(self) -> None:
        """Nothing: autograd accumulated into the parameter itself and ran its hooks."""

    def land_whole(self, averaged_grad: torch.Tensor, keep_dtype: bool) -> None:
        """The averaged gradient, in the parameter's own dtype (forward ran in it), written
        over what autograd accumulated (which is in the average); a parameter unused on this
        rank gets it as a new grad."""
        average = averaged_grad.view(self.orig_size)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = average.to(self.sharded_param.dtype)
        else:
            self.sharded_param.grad.copy_(average)

    def _check_replacement(self, new: torch.Tensor, fqn: str) -> None:
        """NO_SHARD keeps parameters whole: a replacement is a plain tensor of the same shape."""
        if isinstance(new, DTensor) or new.shape != self.orig_size:
            raise ValueError(
                f"parameter {fqn!r} (NO_SHARD: kept whole) was replaced after wrapping by a "
                f"{type(new).__name__} of shape {tuple(new.shape)}; it must be a plain tensor of "
                f"shape {tuple(self.orig_size)}"
            )
        super()._check_replacement(new, fqn)

    def _take_back(self, current: nn.Parameter, param_dtype: torch.dtype | None) -> bool:
        storage = self.sharded_flat.device
        if current.device != storage:  # CPU offload keeps the whole param in CPU memory
            current.data = current.data.to(storage)
        self.sharded_flat = current.data.view(-1)
        return False


class ReplicatedCopyParam(ReplicatedParam):
    """A NO_SHARD parameter whose forward runs on a copy: in ``MixedPrecision.param_dtype``, or on
    the compute device when CPU offload keeps the parameter in CPU memory. The copy is refilled
    locally (a cast, no collective) before each forward."""

    def __init__(
        self,
        orig_param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        fqn: str,
        mesh: DeviceMesh | None,
        rank: int,
        world_size: int,
        compute_dtype: torch.dtype,
        storage_device: torch.device,
        compute_device: torch.device,
    ) -> None:
        super().__init__(orig_param, locations, fqn, mesh, rank, world_size, storage_device)
        self._unsharded_flat = torch.empty(self.numel, dtype=compute_dtype, device=compute_device)
        self._unsharded_param = nn.Parameter(
            self._unsharded_flat.view(self.orig_size), requires_grad=self.requires_grad
        )
        free_storage(self._unsharded_flat)

    @property
    def unsharded_param(self) -> nn.Parameter:
        return self._unsharded_param

    @property
    def unsharded_flat(self) -> torch.Tensor:
        return self._unsharded_flat

    def alloc_unsharded(self) -> None:
        alloc_storage(self._unsharded_flat, self.numel * self._unsharded_flat.element_size())

    def free_unsharded(self) -> None:
        free_storage(self._unsharded_flat)

    def fill_unsharded(self) -> None:
        """Cast the parameter into its copy (autograd saved the copy: keep its version)."""
        self.alloc_unsharded()
        with (
            torch.no_grad(),
            torch.autograd._unsafe_preserve_version_counter(self._unsharded_param),
        ):
            self._unsharded_param.copy_(self.sharded_param)

    take_unsharded_grad = Param.take_unsharded_grad  # the copy's, dropped from it
    drop_unsharded_grad = Param.drop_unsharded_grad
    keep_unsynced_grad = Param.keep_unsynced_grad
    run_grad_hooks = Param.run_grad_hooks  # autograd accumulated into the copy

    def land_whole(self, averaged_grad: torch.Tensor, keep_dtype: bool) -> None:
        """The averaged gradient of the copy, moved to the parameter's device and, unless
        ``keep_dtype``, cast to its dtype; added to a gradient already there (the copy's
        gradient is fresh each backward, so accumulation happens here)."""
        grad = offload.to_device(averaged_grad.view(self.orig_size), self.sharded_flat.device)
        if not keep_dtype:
            grad = grad.to(self.sharded_param.dtype)
        elif grad.dtype != self.sharded_param.dtype:
            self.sharded_param.grad_dtype = None  # torch refuses another dtype otherwise
        if self.sharded_param.grad is None:
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad += grad

    def _take_back(self, current: nn.Parameter, param_dtype: torch.dtype | None) -> bool:
        super()._take_back(current, param_dtype)
        dtype = param_dtype or current.dtype
        if self._unsharded_flat.dtype == dtype:
            return False
        old = self._unsharded_param
        self._unsharded_flat = torch.empty(
            self.numel, dtype=dtype, device=self._unsharded_flat.device
        )
        self._unsharded_param = nn.Parameter(
            self._unsharded_flat.view(self.orig_size), requires_grad=self.requires_grad
        )
        if old.grad is not None:  # accumulated under no_sync: it follows the dtype too
            self._unsharded_param.grad = old.grad.to(dtype)
        free_storage(self._unsharded_flat)
        return True


def new_param(
    orig_param: nn.Parameter,
    locations: list[tuple[nn.Module, str]],
    fqn: str,
    mesh: DeviceMesh | None,
    rank: int,
    world_size: int,
    shard: bool,
    options: ParamOptions = ParamOptions(),
) -> Param:
    """The kind of ``orig_param`` the strategy and its dtypes and devices call for (Note
    [Parameter kinds]), built: the one place the kind is chosen."""
    common = (orig_param, locations, fqn, mesh, rank, world_size)
    if shard:
        return ShardedParam(*common, options)
    compute = options.compute_device or orig_param.device
    storage = options.storage_device or compute
    dtype = options.compute_dtype or orig_param.dtype
    if dtype != orig_param.dtype or storage != compute:
        return ReplicatedCopyParam(*common, dtype, storage, compute)
    return ReplicatedParam(*common, storage)


def _with_size(shape: torch.Size, dim: int, size: int) -> torch.Size:
    return torch.Size((*shape[:dim], size, *shape[dim + 1 :]))
