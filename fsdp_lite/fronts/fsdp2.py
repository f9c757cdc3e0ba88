"""The FSDP2 front: ``fully_shard(module, mesh=...)``, the API of torch FSDP2's ``fully_shard``.

``fully_shard`` turns its arguments into the same ``UnitConfig`` the FSDP1 front builds, builds the
module's ``ShardedUnit`` with construct.py, swaps the module's class to ``FSDP<Orig>(FSDPModule,
Orig)`` in place (names unchanged: no wrapper module) and registers forward hooks that hand each
stage to runtime.py. ``FSDPModule`` holds the methods client code calls between steps (``reshard``,
``unshard``, ``set_requires_gradient_sync`` ...). The engine underneath is the FSDP1 front's: this
file only translates arguments and calls.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_lite.api import STRATEGY_RULES, BackwardPrefetch, ShardingStrategy, as_ours
from fsdp_lite.engine import offload
from fsdp_lite.engine.mixed_precision import Precision, cast_floating
from fsdp_lite.engine.param import SpmdLayout
from fsdp_lite.engine.runtime import (
    eager,
    lazy_init,
    prepare_apply,
    register_grad_hooks,
    take_back_after_apply,
    take_replaced_params,
    to_rest,
)
from fsdp_lite.engine.unit import ShardedUnit, TrainingState, owns_unit, unit_owners
from fsdp_lite.fronts.construct import (
    UnitConfig,
    _build_unit,
    _check_same_model_across_ranks,
    _move_to_device,
    check_tensor_parallel_params,
    check_unit_params,
    params_to_shard,
)
from fsdp_lite.fronts.interop import TorchFSDPModule, register_state, registered_state

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for FSDP2's unsharded params, gradient reduction and outputs (torch's meaning).

    ``reduce_dtype`` None reduces in ``param_dtype``; ``output_dtype`` casts the module's floating
    outputs; ``cast_forward_inputs`` casts its floating inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of a whole SPMD mesh are data parallel, for ``fully_shard(dp_mesh_dims=...)``
    (torch's meaning): ``shard``, the dim FSDP shards over; ``replicate``, HSDP's replica dim.

    torch also takes tuples of names (flattened into one dim); fsdp_lite takes one name each.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:  # torch's words
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: shards, gradients and optimizer state on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Shards, their gradients and so the optimizer step in CPU memory (ZeRO-Offload).

    ``pin_memory``: pinned host memory where the compute device is an accelerator.
    """

    pin_memory: bool = True


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` lands the all-gather."""

    def __init__(self, unit: ShardedUnit | None = None) -> None:
        self._unit = unit

    def wait(self) -> None:
        """Wait for the all-gather; the module then holds its unsharded params."""
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


# The FSDP<Orig> class made for each original class, so that one class serves every instance.
_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters (those not already in a sharded submodule) across ``mesh``.

    Args:
        module: the module, called bottom-up (blocks first, then the root), as in torch; or a
            list of modules sharing one unit (e.g. a tied embedding and output head).
        mesh: a 1-D mesh to shard over, or a 2-D (replicate, shard) mesh for HSDP. Default: every
            rank, on the default process group's device type.
        reshard_after_forward: True frees the unsharded params after forward (ZeRO-3), False
            keeps them until after backward (ZeRO-2). None (default): True, but the root keeps its.
            An int k dividing the shard group's size: keep 1/k of them after forward, and gather
            backward's within groups of k consecutive ranks (ZeRO++'s hpZ; unit.py, Note
            [Post-forward shards]).
        shard_placement_fn: None, or returns ``Shard(dim)`` (negative counts from the end) or
            None (dim 0) for each parameter this call shards; a dim other than 0 must divide
            evenly, as in torch (param.py Note [Shard dim]).
        mp_policy: a ``MixedPrecisionPolicy``.
        offload_policy: ``OffloadPolicy()`` (default) or ``CPUOffloadPolicy()``.
        ignored_params: parameters left alone: not sharded, not reduced.
        dp_mesh_dims: ``mesh`` is then the whole SPMD mesh, the parameters DTensors on it
            replicated on these dims (param.py Note [SPMD mesh parameters]): FSDP shards over
            ``shard`` and, with ``replicate``, replicates over it (HSDP). One name each.

    Returns:
        ``module`` itself, its class now ``FSDP<Orig>`` (an ``FSDPModule`` and an ``Orig``); for
        a list, every member's is.

    Raises:
        ValueError: an int ``reshard_after_forward`` that does not divide the shard group; a
            placement that is not a ``Shard``; a ``ModuleList``/``ModuleDict`` (no forward); a
            scalar parameter; a mesh of 3+ dims.
        AssertionError: where torch raises it, with its words: a module sharded twice, a
            ``Shard`` dim the parameter lacks, a 2-D mesh without dim names.
        NotImplementedError: what is not built (uneven ``Shard(dim)`` for dim > 0; an int
            ``reshard_after_forward`` with CPU offload or DTensor parameters), before any
            collective.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Modules, got {type(m).__name__}")
        # torch's checks, classes and words (tests and wrappers match them):
        if owns_unit(m):
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard has already been applied to the following module:\n{m}"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # Its forward hooks would never run: nothing calls a container's forward.
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {m}"
            )
    # A list is one unit over all its modules' params (e.g. a tied embedding and output head);
    # the ModuleList is only the tree the unit is built from, no module's new parent.
    tree = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    # torch's policies (what Accelerate and transformers build) are taken as ours, by field.
    mp_policy = as_ours(mp_policy, MixedPrecisionPolicy, "mp_policy")
    cpu = type(offload_policy).__name__ == "CPUOffloadPolicy"
    offload_policy = as_ours(
        offload_policy, CPUOffloadPolicy if cpu else OffloadPolicy, "offload_policy"
    )
    _check_reshard_after_forward(reshard_after_forward, allow_int=True)
    spmd = None
    if dp_mesh_dims is not None:
        mesh, spmd = _spmd_mesh(mesh, as_ours(dp_mesh_dims, DataParallelMeshDims, "dp_mesh_dims"))
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(  # torch's words
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
    smaller_group = None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        mesh = _config(tree, mesh, True, mp_policy, offload_policy, ignored_params).mesh
        reshard_after_forward, smaller_group = _post_forward_size(
            reshard_after_forward, mesh, offload_policy
        )
    config = _config(tree, mesh, reshard_after_forward, mp_policy, offload_policy, ignored_params)
    if spmd is not None:
        config = dataclasses.replace(config, spmd=spmd)
    for name, param in params_to_shard(tree, config):
        if param.ndim == 0:  # torch's words, with the parameter's own name as torch gives it
            raise ValueError(
                "fully_shard doesn't support scalar parameters. "
                f"Change {name.rpartition('.')[2]} to a 1D tensor with numel equal to 1."
            )
    shard_dims = _shard_dims(tree, config, shard_placement_fn)
    _move_to_device(tree, config)
    check_tensor_parallel_params(tree, config, "fully_shard")
    # TP is a property of the parameters this unit itself shards: a nested unit's are DTensors
    # already (its shards), and are not this unit's.
    own = (p for _, p in params_to_shard(tree, config))
    if smaller_group is not None and any(isinstance(p, DTensor) for p in own):
        raise NotImplementedError(  # torch's FSDP2 refuses it too
            "reshard_after_forward as an int with tensor-parallel (DTensor) parameters"
        )
    check_unit_params(tree, config, "fully_shard")
    # A collective, after every argument was checked: different models fail here on every rank.
    _check_same_model_across_ranks(tree, config)
    unit = _build_unit(tree, config, shard_dims)
    if smaller_group is not None:
        unit.reshard_to_smaller_group(_post_forward_group(config.mesh, smaller_group))
    # torch: None frees after forward except at the root; True frees at the root too.
    unit.settings.root_keeps_params = reshard_after_forward is None
    # torch FSDP2 sums unsynced gradients in the reduce dtype (unit.py Note [Unsynced accumulation])
    unit.settings.unsynced_grads_in_reduce_dtype = True
    # torch FSDP2 keeps a unit unsharded after backward under reshard_after_backward=False
    # (unit.py Note [Unsharded after backward])
    unit.settings.unsharded_after_backward = True
    # torch FSDP2 runs the sharded params' post-accumulate-grad hooks after the reduction
    unit.settings.runs_sharded_grad_hooks = True
    register_grad_hooks(unit, unit.params)
    for p in unit.params:
        p.point_modules_to(p.sharded_param)
    group = _Group(tuple(modules)) if len(modules) > 1 else None
    for m in modules:
        m._unit = unit  # its owner now: what unit.owns_unit recognizes (every member of a group)
        m._config = config
        m._mp_policy = mp_policy
        m._fsdp_group = group
        m.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward)
        m.register_state_dict_pre_hook(_state_dict_pre_hook)
        m.register_state_dict_post_hook(_state_dict_post_hook)
        m.register_load_state_dict_post_hook(_load_state_dict_post_hook)
        m.__class__ = _fsdp_class(type(m))
        register_state(m, _PipelineView(unit))
    return module


# torch's ``fully_shard.state(module)``: the state object the call filed on the module (ours:
# what torch's pipelining reads, _PipelineView), or None where fully_shard was not applied.
fully_shard.state = registered_state  # type: ignore[attr-defined]


def _shard_dims(
    tree: nn.Module,
    config: UnitConfig,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
) -> dict[nn.Parameter, int]:
    """The dim other than 0 that ``shard_placement_fn`` gives each parameter this call shards
    (param.py Note [Shard dim]); checked here, before any collective, by torch FSDP2's rules."""
    if shard_placement_fn is None:
        return {}
    shard_size = config.mesh.size(config.mesh.ndim - 1)
    dims = {}
    for name, param in params_to_shard(tree, config):
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"shard_placement_fn gave {name!r} {placement!r}; it must return Shard(dim) or None"
            )
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.ndim:
            raise AssertionError(  # torch's class and words, then which parameter
                f"Shard dim {placement.dim} is invalid for {param.ndim}D tensor: {param.shape} "
                f"(shard_placement_fn gave {name!r} {placement!r})"
            )
        shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
        if dim > 0 and shape[dim] % shard_size:
            raise NotImplementedError(  # torch FSDP2 refuses it too: no padding off dim 0
                f"shard_placement_fn gave {name!r} {Shard(dim)!r}, but its dim {dim} ({shape[dim]}) "
                f"does not divide into the shard group's {shard_size} ranks; only dim 0 shards "
                "unevenly"
            )
        if dim > 0:
            dims[param] = dim
    return dims


def _check_reshard_after_forward(value: Any, allow_int: bool) -> None:
    """torch's type check, in its words (an int means a group size, see _post_forward_size)."""
    if allow_int and value is not None and not isinstance(value, (bool, int)):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {value}"
        )
    if not allow_int and not isinstance(value, bool):
        raise ValueError(f"reshard_after_forward should be a bool, got {type(value)}")


def _post_forward_size(
    size: int, mesh: DeviceMesh, offload_policy: OffloadPolicy
) -> tuple[bool, int | None]:
    """An int ``reshard_after_forward`` as (reshard, the size of the group to reshard to), or
    None for the whole shard group; torch's rules and words."""
    shard_size = mesh.size(mesh.ndim - 1)
    if size < 1 or size > shard_size or shard_size % size:
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{shard_size}, not {size}"
        )
    if size == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)",
            stacklevel=3,
        )
        return False, None
    if size == shard_size:
        return True, None
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError("reshard_after_forward as an int with CPUOffloadPolicy")
    return True, size


def _post_forward_group(mesh: DeviceMesh, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of ``mesh`` (torch's post-forward mesh:
    the mesh's ranks viewed as rows of ``size``); every rank builds every group, as torch."""
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size)).get_group(1)


@dataclass
class _Group:
    """The modules of one ``fully_shard([...])`` call: one unit, unsharded at the first member's
    forward and resharded after the last's (``pending`` holds those still to run)."""

    members: tuple[nn.Module, ...]
    pending: set = dataclasses.field(default_factory=set)


def _config(
    module: nn.Module,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
) -> UnitConfig:
    """FSDP2's arguments as the engine's ``UnitConfig``; no collective runs here."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialized first")
    if mesh is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):  # torch's words
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # torch's class and words
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    hybrid = mesh.ndim == 2
    keep = reshard_after_forward is False
    strategy = {
        (False, False): ShardingStrategy.FULL_SHARD,
        (False, True): ShardingStrategy.SHARD_GRAD_OP,
        (True, False): ShardingStrategy.HYBRID_SHARD,
        (True, True): ShardingStrategy._HYBRID_SHARD_ZERO2,
    }[(hybrid, keep)]
    offload_params = isinstance(offload_policy, CPUOffloadPolicy)
    param_dtype = mp_policy.param_dtype
    ignored = frozenset(ignored_params or ())
    return UnitConfig(
        strategy=strategy,
        rules=STRATEGY_RULES[strategy],
        group=mesh.get_group(mesh.ndim - 1),
        mesh=mesh,
        replicate_group=mesh.get_group(0) if hybrid else None,
        cpu_offload=None,
        storage_device=offload.storage_device(device, offload_params),
        disk=None,
        # A meta-device module stays uninitialized, as in torch: the caller runs to_empty() and
        # its own init (reset_parameters, init_weights) on the shards afterwards.
        param_init_fn=_leave_uninitialized,
        sync_module_states=False,
        device=device,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,  # FSDP2 always prefetches pre-backward
        forward_prefetch=True,
        ignored_params=ignored,
        ignored_modules=frozenset(),
        precision=Precision(
            param_dtype=param_dtype,
            reduce_dtype=mp_policy.reduce_dtype or param_dtype,
            cast_forward_inputs=mp_policy.cast_forward_inputs,
        ),
    )


def _spmd_mesh(
    mesh: DeviceMesh | None, dims: DataParallelMeshDims
) -> tuple[DeviceMesh, SpmdLayout]:
    """The data-parallel mesh ``_config`` takes (the shard dim's, or (replicate, shard) for HSDP)
    and the layout of the whole mesh; torch's checks and words first. No collective."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"dp_mesh_dims needs mesh, the whole SPMD DeviceMesh; got {mesh!r}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    if len(dims.shard_names) > 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"dp_mesh_dims={dims}: several mesh dims flattened into one is not built; "
            "name one shard dim and at most one replicate dim"
        )
    if not dims.shard_names:
        raise NotImplementedError(
            f"dp_mesh_dims={dims}: replicate only (DDP over the mesh) is not built; name a shard dim"
        )
    shard = names.index(dims.shard_names[0])
    replicate = names.index(dims.replicate_names[0]) if dims.replicate_names else None
    if replicate is None:
        dp_mesh = mesh[names[shard]]
    else:
        dp_mesh = DeviceMesh._concatenate([mesh[names[replicate]], mesh[names[shard]]])
    return dp_mesh, SpmdLayout(mesh, shard, replicate)


def _leave_uninitialized(module: nn.Module) -> None:
    """Meta-device materialization that initializes nothing (see ``_config``)."""


# ---- hooks: each stage goes to runtime.py -----------------------------------------------------


@eager
def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    unit: ShardedUnit = module._unit
    runtime = lazy_init(module)  # the first FSDPModule to run is the root
    group: _Group | None = module._fsdp_group
    if group is None or unit.training_state != TrainingState.FORWARD:
        args, kwargs = runtime.pre_forward(unit, args, kwargs)
        if group is not None and unit.training_state == TrainingState.FORWARD:
            group.pending = set(group.members)  # this forward's first member unsharded the unit
    if unit.precision.cast_forward_inputs and unit.precision.param_dtype is not None:
        args, kwargs = cast_floating(unit.precision.param_dtype, (args, kwargs))
    return args, kwargs


@eager
def _post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
    unit: ShardedUnit = module._unit
    group: _Group | None = module._fsdp_group
    if group is not None and unit.training_state == TrainingState.FORWARD:
        group.pending.discard(module)
        if group.pending:  # members still to run keep the unit unsharded
            unit.runtime.register_pre_backward(unit, output)
            return cast_floating(module._mp_policy.output_dtype, output)
    output = unit.runtime.post_forward(unit, output)
    return cast_floating(module._mp_policy.output_dtype, output)


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    to_rest(module)  # the modules hold the sharded DTensors, whose storage the values share


def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
    # Under torch's get_model_state_dict(full_state_dict=True) the unit gathers its own entries,
    # watched by the order check (state_dict.py Note [Full state dicts for torch's helper]).
    from fsdp_lite.state import state_dict as impl  # lazily, as fsdp1.py does

    impl.full_state_dict_hook(module, state_dict, prefix, metadata)


def _load_state_dict_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    # load_state_dict(assign=True) put new DTensors in the modules: take them back as shards.
    take_back_after_apply(module._unit, lambda t: t)


# ---- the class every sharded module becomes ------------------------------------------------------


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


class FSDPModule(TorchFSDPModule):
    """What ``fully_shard`` makes a module also be: its unit's methods, torch FSDP2's names.

    A subclass of torch's ``FSDPModule`` only so that ``isinstance`` checks in client code hold
    (interop.py); every method torch's class has is defined here, so none of torch's runs.
    ``recurse=True`` methods act on every ``FSDPModule`` in this module's tree.
    """

    _unit: ShardedUnit
    # FSDP<Orig>, FSDPModule, torch's FSDPModule, Orig: where torch's code looks for Orig.
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # nn.ModuleList slicing builds type(self)(...): give it the original class, as torch does.
        orig = next(c for c in cls.__mro__ if not issubclass(c, TorchFSDPModule))
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> _ForwardStages:
        """What torch's ``register_fsdp_forward_method`` calls: our pre/post-forward stages."""
        return _ForwardStages()

    def _set_unshard_async_op(self, async_op: bool) -> None:
        _not_built("FSDPModule._set_unshard_async_op")

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization."
        )

    def _owners(self, recurse: bool) -> list[nn.Module]:
        return unit_owners(self) if recurse else [self]

    def reshard(self) -> None:
        """Free the unsharded params; the module holds the sharded ones again."""
        self._unit.assert_state(TrainingState.IDLE)
        self._unit.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the params now; with ``async_op``, the returned handle's ``wait()`` lands it."""
        unit = self._unit
        if unit.training_state == TrainingState.IDLE:
            take_replaced_params(unit)  # before the gather reads the shards (runtime.py Note)
        unit.unshard("forward", async_op=async_op)
        if async_op:
            return UnshardHandle(unit)
        unit.wait_for_unshard()
        return None

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward keeps local unsharded gradients (to accumulate) and reduces nothing.
        Under HSDP it sets the all-reduce too (``set_requires_all_reduce``), as torch's does."""
        for m in self._owners(recurse):
            m._unit.settings.requires_gradient_sync = requires_gradient_sync
            # torch sets both: else a set_requires_all_reduce(False) before would keep skipping
            # the all-reduce, and no gradient would land, with no error.
            m._unit.settings.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters within the shard group but skips the all-reduce across
        replicas, keeping the sum for the next backward that all-reduces (gradient accumulation
        with less traffic); the gradients land then. No effect without replicas."""
        for m in self._owners(recurse):
            m._unit.settings.requires_all_reduce = requires_all_reduce

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: a parameter that received no gradient on any rank gets a zero gradient, as
        torch's does. Either way a parameter some ranks used is reduced with zeros from the
        others (torch needs True for that; Note [Unused parameters] in unit.py)."""
        for m in self._owners(recurse):
            m._unit.settings.lands_unused_grads = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reductions may be in flight at once, each holding its unit's
        gradient buffer (default 1); the largest any unit of the model asks for applies, as in
        torch. Memory against overlap: the numbers are the same."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for m in self._owners(recurse):
            m._unit.settings.reductions_in_flight = max_input_buffers

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's backward needs none of its parameters (an embedding: its weight's
        gradient reads only the indices and the output's gradient), so it all-gathers nothing."""
        self._unit.settings.unshard_in_backward = unshard_in_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the unsharded params (the root's too, as an explicit True does)."""
        _check_reshard_after_forward(reshard_after_forward, allow_int=False)
        for m in self._owners(recurse):
            unit = m._unit
            unit.set_rules(
                dataclasses.replace(unit.rules, reshard_after_forward=reshard_after_forward)
            )
            unit.settings.root_keeps_params = False

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False: the unit stays unsharded after backward, its gradients unreduced (no gradient
        sync) on the unsharded params; the next forward gathers only if the shards changed
        (Note [Unsharded after backward] in unit.py)."""
        for m in self._owners(recurse):
            unit = m._unit
            unit.set_rules(
                dataclasses.replace(unit.rules, reshard_after_backward=reshard_after_backward)
            )

    def set_modules_to_forward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """Start these modules' all-gathers in this module's pre-forward, instead of the next's."""
        self._unit.settings.forward_prefetch_units = [_unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """Start these modules' all-gathers in this module's pre-backward, instead of the next's."""
        self._unit.settings.backward_prefetch_units = [_unit_of(m) for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Sum this module's gradients over the ranks, then divide by ``factor`` (1.0: the sum)."""
        self._unit.settings.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name for ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: fsdp_lite's collectives always sum, and divide in separate steps."""

    def set_post_optim_event(self, event: Any) -> None:
        """The next forward's first all-gather here waits for ``event`` (an optimizer step's)."""
        self._unit.settings.post_optim_event = event

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: more backwards of this step follow (pipelining's microbatches); the step ends
        at the next backward with True. Every backward still lands the gradients it reduced."""
        for m in unit_owners(self):
            m._unit.settings.is_last_backward = is_last_backward

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, caught by the training loop: land every
        collective in flight and put every unit at rest, dropping the failed step's unreduced
        gradients (torch's semantics). The next root forward does it by itself too."""
        unit = self._unit
        if unit.runtime is None:
            return  # nothing ran yet
        if not unit.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        lazy_init(self).reset_iter_state()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to``, ``double``, ``to_empty``...: shards stay the tensors the optimizer steps (see
        the FSDP1 front's ``_apply``)."""
        prepare_apply(self, fn)
        # Past torch's FSDPModule in the MRO: its _apply is torch's FSDP code (interop.py).
        result = super(TorchFSDPModule, self)._apply(fn, recurse)
        take_back_after_apply(self._unit, fn)
        return result


class _ForwardStages:
    """The two methods of torch's FSDP state that torch's ``register_fsdp_forward_method`` uses,
    as fsdp_lite's hooks; anything else torch's internals would read raises, naming it."""

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _post_forward(module, args, output)

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(f"torch FSDP2 state attribute {name!r} is not in fsdp_lite")


class _PipelineView:
    """What torch's pipelining gets from ``fully_shard.state(module)`` (interop.register_state):
    the three names its ``perform_reduce_grad`` reads, each fsdp_lite's own. After a step's
    microbatch backwards ran without gradient sync, it calls ``post_backward`` of every unit (our
    ``reduce_after_backward``), then ``_root_post_backward_final_callback`` (our
    ``finalize_backward``). Anything else torch's internals would read raises, naming it."""

    def __init__(self, unit: ShardedUnit) -> None:
        self._unit = unit

    @property
    def _state_ctx(self) -> _PipelineView:
        return self

    @property
    def all_states(self) -> list[_PipelineView]:
        runtime = self._unit.runtime
        return [] if runtime is None else [_PipelineView(u) for u in runtime.units]

    @property
    def _fsdp_param_groups(self) -> list[_PipelineView]:
        return [self]

    def post_backward(self) -> None:
        if self._unit.runtime is not None:
            self._unit.runtime.reduce_after_backward(self._unit)

    def _root_post_backward_final_callback(self) -> None:
        if self._unit.runtime is not None:
            self._unit.runtime.finalize_backward()

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(f"torch FSDP2 state attribute {name!r} is not in fsdp_lite")


def _unit_of(module: Any) -> ShardedUnit:
    if not owns_unit(module):
        raise ValueError(f"{type(module).__name__} is not an FSDPModule (call fully_shard on it)")
    return module._unit


def _not_built(what: str) -> None:
    raise NotImplementedError(f"{what} is not built in fsdp_lite's FSDP2 front")


def _not_built_method(name: str) -> Callable:
    def method(self, *args: Any, **kwargs: Any) -> None:
        _not_built(f"FSDPModule.{name}")

    method.__name__ = name
    method.__doc__ = f"Not built: raises NotImplementedError (torch's FSDPModule.{name})."
    return method


for _name in (
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_all_reduce_hook",
    "set_separate_reduce_scatter_group",
    "set_allocate_memory_from_process_group_for_comm",
    "set_symm_mem_for_comm",
):
    setattr(FSDPModule, _name, _not_built_method(_name))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` (e.g. ``generate``) between the pre- and post-forward stages,
    as its ``forward`` is; a no-op for a module that is not an ``FSDPModule``, as in torch."""
    if not owns_unit(module):
        return
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _pre_forward(module, args, kwargs)
        return _post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)
