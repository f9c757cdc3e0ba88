"""Building a wrapper: its arguments checked and resolved into a ``UnitConfig``, the model moved and
checked across ranks, and its ``ShardedUnit`` built (materializing meta-device modules first).

module.py calls these from ``FullyShardedModule.__init__``; nothing here runs at step time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_lite import wrap
from fsdp_lite.api import (
    STRATEGY_RULES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    Rules,
    ShardingStrategy,
    as_ours,
)
from fsdp_lite.engine import collectives, offload
from fsdp_lite.engine.disk import DiskStore, check_offload_dir
from fsdp_lite.engine.mixed_precision import (
    Precision,
    cast_buffers,
    resolve,
)
from fsdp_lite.engine.offload import with_local
from fsdp_lite.engine.param import (
    Param,
    ParamOptions,
    SpmdLayout,
    TensorParallel,
    new_param,
    padded_numel,
    refuse_all_gather_extension,
)
from fsdp_lite.engine.unit import ShardedUnit, UnitSettings, owns_unit
from fsdp_lite.names import clean_name
from fsdp_lite.tools import order

__all__ = ["UnitConfig"]


@dataclass(frozen=True)
class UnitConfig:
    """Everything a wrapper needs from the constructor's arguments, checked once."""

    strategy: ShardingStrategy
    rules: Rules
    group: dist.ProcessGroup  # the shard group: parameters are cut into its size
    mesh: DeviceMesh  # 1-D (shard) or, for HYBRID_SHARD, 2-D (replicate, shard)
    replicate_group: dist.ProcessGroup | None  # HYBRID_SHARD: the same shard on other groups
    cpu_offload: CPUOffload | None
    storage_device: torch.device  # where shards, grads and optimizer state live (offload.py)
    disk: DiskStore | None  # their files under CPUOffload(offload_dir=...); one per rank
    param_init_fn: Callable[[nn.Module], None] | None  # for meta-device modules
    sync_module_states: bool
    device: torch.device
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    ignored_params: frozenset[nn.Parameter]
    ignored_modules: frozenset[nn.Module]
    precision: Precision
    spmd: SpmdLayout | None = None  # fully_shard(dp_mesh_dims=...): params on the whole mesh


def _check_type(name: str, value: Any, types: type | tuple, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, types):
        expected = " or ".join(
            t.__name__ for t in (types if isinstance(types, tuple) else (types,))
        )
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}: {value!r}")


# The constructor arguments, in torch FSDP1's order; module.py passes them all by name.
ARGUMENTS = (
    "process_group",
    "sharding_strategy",
    "cpu_offload",
    "auto_wrap_policy",
    "backward_prefetch",
    "mixed_precision",
    "ignored_modules",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
    "device_mesh",
)


def _resolve_configs(kw: dict[str, Any]) -> dict[str, Any]:
    """torch FSDP's enums and configs as fsdp_lite's (api.as_ours); the rest as given."""
    kw = dict(kw)
    for name, ours in (
        ("sharding_strategy", ShardingStrategy),
        ("cpu_offload", CPUOffload),
        ("mixed_precision", MixedPrecision),
        ("backward_prefetch", BackwardPrefetch),
    ):
        kw[name] = as_ours(kw[name], ours, name)
    return kw


def _make_config(module: nn.Module, kw: dict[str, Any]) -> UnitConfig:
    """Check every constructor argument and resolve defaults; no collective runs here.

    ``kw`` holds the ``ARGUMENTS``, already through ``_resolve_configs``.
    """
    _check_type("module", module, nn.Module, allow_none=False)
    if owns_unit(module):
        raise ValueError("module is already a FullyShardedModule")
    strategy = kw["sharding_strategy"] or ShardingStrategy.FULL_SHARD
    offload_params, _ = _check_offload(kw["cpu_offload"], strategy)
    precision = resolve(kw["mixed_precision"])
    _check_init_fn(kw["param_init_fn"])
    policy = kw["auto_wrap_policy"]
    # torch's ModuleWrapPolicy / CustomPolicy are not ours: auto_wrap takes any _run_policy.
    is_policy = isinstance(policy, wrap.Policy) or callable(getattr(policy, "_run_policy", None))
    if policy is not None and not (callable(policy) or is_policy):
        raise TypeError(
            "auto_wrap_policy must be a callable or a Policy (ModuleWrapPolicy, CustomPolicy), "
            f"got {type(policy).__name__}"
        )
    for flag in ("sync_module_states", "limit_all_gathers", "use_orig_params"):
        _check_type(flag, kw[flag], bool, allow_none=False)
    _check_type("forward_prefetch", kw["forward_prefetch"], bool)
    group, mesh_given = kw["process_group"], kw["device_mesh"]
    hybrid = STRATEGY_RULES[strategy].replicate
    if isinstance(group, tuple):
        if not hybrid:
            raise ValueError(
                f"a (shard, replicate) process_group tuple needs HYBRID_SHARD, not {strategy.name}"
            )
        if len(group) != 2:
            raise ValueError("process_group tuple must be (shard_group, replicate_group)")
        for g in group:
            _check_type("process_group[i]", g, dist.ProcessGroup, allow_none=False)
    elif collectives.is_stand_in(group):
        _check_stand_in(group, kw, hybrid)
    else:
        _check_type("process_group", group, dist.ProcessGroup)
    _check_type("device_mesh", mesh_given, DeviceMesh)
    if group is not None and mesh_given is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if mesh_given is not None and mesh_given.ndim != (2 if hybrid else 1):
        raise ValueError(
            f"{strategy.name} needs a {2 if hybrid else 1}-D device_mesh, got {mesh_given.ndim}-D"
        )
    stand_in = collectives.is_stand_in(group)
    if not stand_in and (not dist.is_available() or not dist.is_initialized()):
        raise RuntimeError(
            "FullyShardedModule needs torch.distributed initialized first: "
            "call torch.distributed.init_process_group (torchrun sets up the environment)"
        )

    device = _resolve_device(module, kw["device_id"])
    replicate_group = None
    if hybrid:
        mesh = mesh_given if mesh_given is not None else _hybrid_mesh(group, device)
        replicate_group, group = mesh.get_group(0), mesh.get_group(1)
    elif mesh_given is not None:
        mesh, group = mesh_given, mesh_given.get_group()
    elif stand_in:
        mesh = collectives.stand_in_mesh(group, device.type)
    else:
        group = group or dist.group.WORLD
        mesh = DeviceMesh.from_group(group, device.type)

    ignored_modules, ignored_params = _resolve_ignored(
        module, kw["ignored_modules"], kw["ignored_states"]
    )
    # A unit wrapped by hand below this one leaves what it ignores to nobody: torch FSDP1 counts
    # a nested FSDP's ignored modules and parameters as the parent's own. (Units a policy makes
    # do not exist yet: their ignored_states go to this unit, _ignored_by_nested.)
    for sub in module.modules():
        if sub is not module and owns_unit(sub):
            ignored_modules |= sub._config.ignored_modules
            ignored_params |= sub._config.ignored_params
    return UnitConfig(
        strategy=strategy,
        rules=STRATEGY_RULES[strategy],
        group=group,
        mesh=mesh,
        replicate_group=replicate_group,
        cpu_offload=kw["cpu_offload"],
        storage_device=offload.storage_device(device, offload_params),
        disk=None,  # made with the other ranks: open_disk_store
        param_init_fn=kw["param_init_fn"],
        sync_module_states=kw["sync_module_states"],
        device=device,
        backward_prefetch=kw["backward_prefetch"],
        forward_prefetch=True if kw["forward_prefetch"] is None else kw["forward_prefetch"],
        ignored_params=frozenset(ignored_params),
        ignored_modules=frozenset(ignored_modules),
        precision=precision,
    )


# Note [Stand-in process groups]: torch FSDP1 reads only ``rank()`` and ``size()`` of its
# process group while it wraps (collectives come at the first forward), so torch's own tests build
# wrappers in one process with no process group, passing ``DummyProcessGroup(rank, size)``, and
# check what got wrapped, ``rank``, ``world_size`` and ``process_group`` (test_wrap.py's
# TestAutoWrap). fsdp_lite takes such a stand-in too: the wrapper and its units are built, the
# shards cut at ``rank()`` of ``size()`` on a DeviceMesh with no process group behind it
# (collectives.stand_in_mesh), and the steps that need the other ranks (the cross-rank model
# check, the sends' group) are left out. What needs collectives is refused before any: the
# constructor arguments that communicate (``_check_stand_in``), and running the wrapper
# (runtime.lazy_init: forward, state dicts, summon_full_params, clip_grad_norm_).


def _check_stand_in(group: object, kw: dict[str, Any], hybrid: bool) -> None:
    """Refuse what a stand-in process group cannot do at construction, naming it."""
    what = f"process_group {type(group).__name__} is a stand-in (rank() and size(), no collectives)"
    rank, size = group.rank(), group.size()
    if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
        raise ValueError(f"{what} with rank() {rank!r} and size() {size!r}: need 0 <= rank < size")
    needs = [
        name
        for name, asked in (
            ("sync_module_states=True", kw["sync_module_states"]),
            ("CPUOffload(offload_dir=...)", getattr(kw["cpu_offload"], "offload_dir", None)),
            ("HYBRID_SHARD", hybrid),
        )
        if asked
    ]
    if needs:
        raise ValueError(
            f"{what}; {', '.join(needs)} needs the other ranks at construction: pass a "
            "torch.distributed ProcessGroup"
        )


def open_disk_store(config: UnitConfig, module: nn.Module) -> UnitConfig:
    """``config`` with this rank's files for ``CPUOffload(offload_dir=...)``: checked and made on
    every rank, then one all-gather, so a rank whose directory is missing, whose disk lacks the
    room for ``module``'s shards or that another run uses fails every rank before any other
    collective (see ``on_every_rank``)."""
    if config.cpu_offload is None or config.cpu_offload.offload_dir is None:
        return config
    needs = _shard_bytes(module, config)
    disk = _agreed(config, lambda: _disk_store(config.cpu_offload, dist.get_rank(), needs))
    return dataclasses.replace(config, disk=disk)


def job_token() -> str:
    """A random token, the same on every rank of this job: the first rank to ask sets it in the
    default process group's store (disk.py Note [One run per directory])."""
    store = dist.distributed_c10d._get_default_store()
    return store.compare_set("fsdp_lite/job", "", uuid.uuid4().hex[:8]).decode()


def _shard_bytes(module: nn.Module, config: UnitConfig) -> list[int]:
    """The sizes of this rank's files for ``module``'s parameter shards and their grads (disk.py
    Note [Space first]): dim 0 cut into equal blocks, as param.py pads it."""
    ranks = dist.get_world_size(config.group)
    sizes = []
    for p in dict.fromkeys(module.parameters()):  # a tied parameter once
        if p in config.ignored_params:
            continue
        rows = p.shape[0] if p.dim() > 0 else 1
        shard = -(-rows // ranks) * (p.numel() // max(rows, 1)) * p.element_size()
        sizes += [shard] * (2 if p.requires_grad else 1)
    return sizes


def on_every_rank(config: UnitConfig, step: Callable[[], Any]) -> Any:
    """``step()``; under disk offload, whose files a full disk can refuse on one rank only,
    followed by one all-gather of whether it failed anywhere, so that no rank goes on into a
    collective that a failed rank will never join."""
    return step() if config.disk is None else _agreed(config, step)


def _agreed(config: UnitConfig, step: Callable[[], Any]) -> Any:
    """``step()`` here, then every rank learns whether it failed on any rank: the failed rank
    raises its own error, the others a RuntimeError naming it. Shard group first, then across
    replicas, each passing on what it heard, so every rank has heard of every failure."""
    try:
        result, error = step(), None
    except Exception as e:  # noqa: BLE001 - raised below, after the other ranks heard of it
        result, error = None, e
    heard = None if error is None else f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    for group in _data_parallel_groups(config):
        failures = [f for f in collectives.all_gather_objects(heard, group=group) if f]
        heard = heard or (failures[0] if failures else None)
    if error is not None:
        raise error
    if heard is not None:
        raise RuntimeError(f"wrapping failed on {heard}")
    return result


def _disk_store(cpu_offload: CPUOffload | None, rank: int, needs: list[int]) -> DiskStore | None:
    """This rank's files for ``CPUOffload(offload_dir=...)``, or None; checks the directory first."""
    if cpu_offload is None or cpu_offload.offload_dir is None:
        return None
    if not cpu_offload.offload_params:
        raise ValueError("CPUOffload.offload_dir needs offload_params=True")
    return DiskStore(check_offload_dir(cpu_offload.offload_dir), rank, job_token(), needs)


def _check_init_fn(param_init_fn: Any) -> None:
    if param_init_fn is not None and not callable(param_init_fn):
        # torch FSDP1's class and words (its test_bad_arg_meta matches "to be callable")
        raise ValueError(
            f"param_init_fn must be callable: expected {param_init_fn!r} to be callable but got "
            f"{type(param_init_fn)}"
        )


# Per-unit arguments torch FSDP1 takes from a CustomPolicy (each nested FSDP is an instance of its
# own), and the ones it needs equal on every unit (its HOMOGENEOUS_ATTR_NAMES) or builds only once.
PER_UNIT = (
    "sharding_strategy",
    "mixed_precision",
    "cpu_offload",
    "backward_prefetch",
    "forward_prefetch",
    "ignored_modules",
    "ignored_states",
    "param_init_fn",
    "sync_module_states",
)
SAME_AS_ROOT = {
    "use_orig_params": (ValueError, "torch FSDP requires one value for all units"),
    "limit_all_gathers": (ValueError, "torch FSDP requires one value for all units"),
    "process_group": (NotImplementedError, "units on other process groups are not built"),
    "device_mesh": (NotImplementedError, "units on other device meshes are not built"),
    "device_id": (NotImplementedError, "every unit computes on the root's device"),
    "auto_wrap_policy": (ValueError, "a nested unit does not auto-wrap again"),
}


def _nested_config(
    config: UnitConfig, module: nn.Module, name: str, overrides: dict[str, Any]
) -> UnitConfig:
    """A nested unit's config: the root's, with the per-unit arguments a policy overrode.

    ``overrides`` holds only the arguments whose value differs from the root's; auto-wrap passes
    the root's explicitly, so ``mixed_precision=None`` here means a policy asked for full
    precision (as for BatchNorm), not "unset".

    Raises:
        ValueError, NotImplementedError: an override that cannot apply to one unit,
            naming the argument and the submodule, before any collective.
    """
    for arg, (error, why) in SAME_AS_ROOT.items():
        if arg in overrides:
            raise error(
                f"auto_wrap_policy gave submodule {name!r} {arg}={overrides[arg]!r}, unlike the "
                f"root's: {why}"
            )
    kw = _resolve_configs({arg: overrides.get(arg) for arg in PER_UNIT})
    changes: dict[str, Any] = {}
    strategy = config.strategy
    if "sharding_strategy" in overrides:
        strategy = kw["sharding_strategy"] or config.strategy
        if STRATEGY_RULES[strategy].replicate != config.rules.replicate:
            raise NotImplementedError(
                f"submodule {name!r} with {strategy.name} under a root with "
                f"{config.strategy.name}: mixing hybrid and non-hybrid units needs another "
                "process group layout (not built)"
            )
        changes.update(strategy=strategy, rules=STRATEGY_RULES[strategy])
    if "mixed_precision" in overrides:
        changes["precision"] = resolve(kw["mixed_precision"])
    if "cpu_offload" in overrides or "sharding_strategy" in overrides:
        cpu_offload = kw["cpu_offload"] if "cpu_offload" in overrides else config.cpu_offload
        offload_params, on_disk = _check_offload(cpu_offload, strategy)
        changes.update(
            cpu_offload=cpu_offload,
            storage_device=offload.storage_device(config.device, offload_params),
            # Nested units share the root's directory; a policy can turn disk offload off for one.
            disk=config.disk if on_disk else None,
        )
    if "backward_prefetch" in overrides:
        changes["backward_prefetch"] = kw["backward_prefetch"]
    if "forward_prefetch" in overrides:
        _check_type("forward_prefetch", kw["forward_prefetch"], bool)
        changes["forward_prefetch"] = kw["forward_prefetch"] is not False
    if "param_init_fn" in overrides:
        _check_init_fn(kw["param_init_fn"])
        changes["param_init_fn"] = kw["param_init_fn"]
    if "sync_module_states" in overrides:
        _check_type("sync_module_states", kw["sync_module_states"], bool, allow_none=False)
        changes["sync_module_states"] = kw["sync_module_states"]
    if "ignored_modules" in overrides:
        raise ValueError(  # torch FSDP1's words: its auto-wrap passes ignored_states on too
            f"auto_wrap_policy gave submodule {name!r} ignored_modules; torch FSDP1 refuses it: "
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just "
            "pass ignored_states."
        )
    if "ignored_states" in overrides:
        # Left out of this unit; its parent takes them (_ignored_by_nested), as in torch FSDP1.
        mods, params = _resolve_ignored(module, None, kw["ignored_states"])
        if params - {p for m in mods for p in m.parameters()}:
            raise NotImplementedError(
                f"auto_wrap_policy gave submodule {name!r} parameters to ignore: a nested unit "
                "ignores modules only (the parent unit takes them, as in torch FSDP1)"
            )
        changes.update(
            ignored_modules=config.ignored_modules | mods,
            ignored_params=config.ignored_params | params,
        )
    return dataclasses.replace(config, **changes)


def _check_offload(cpu_offload: CPUOffload | None, strategy: ShardingStrategy) -> tuple[bool, bool]:
    """(params offloaded, offloaded to disk), once the combination is known to be built."""
    offload_params = cpu_offload is not None and cpu_offload.offload_params
    on_disk = offload_params and cpu_offload.offload_dir is not None
    if on_disk and not STRATEGY_RULES[strategy].shard_params:
        raise NotImplementedError(
            "cpu_offload with offload_dir and NO_SHARD is not built: disk offload keeps shards; "
            "use a sharded strategy, or CPUOffload(offload_params=True) without offload_dir"
        )
    return offload_params, on_disk


def _hybrid_mesh(groups: tuple | None, device: torch.device) -> DeviceMesh:
    """The (replicate, shard) mesh for HYBRID_SHARD from a group tuple, or by default one shard
    group per node (LOCAL_WORLD_SIZE ranks, as torch FSDP1 shards within a node)."""
    world_size = dist.get_world_size()
    if groups is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % local:
            raise ValueError(f"world size {world_size} is not a multiple of {local} ranks per node")
        return init_device_mesh(
            device.type, (world_size // local, local), mesh_dim_names=("replicate", "shard")
        )
    shard_group, replicate_group = groups
    # Every rank says where it sits; the mesh tensor is the same on all ranks.
    me = (dist.get_rank(replicate_group), dist.get_rank(shard_group), dist.get_rank())
    seats = collectives.all_gather_objects(me)
    layout = torch.empty(
        dist.get_world_size(replicate_group), dist.get_world_size(shard_group), dtype=torch.int
    )
    for replica, shard, global_rank in seats:
        layout[replica, shard] = global_rank
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device.type,
        mesh=layout,
        mesh_dim_names=("replicate", "shard"),
    )


def _resolve_device(module: nn.Module, device_id: int | str | torch.device | None) -> torch.device:
    if device_id is None:
        devices = {p.device for p in module.parameters() if not p.is_meta}
        if len(devices) > 1:
            names = sorted(map(str, devices))
            raise ValueError(f"module has parameters on several devices {names}; pass device_id")
        if devices:
            return devices.pop()
        # Nothing materialized (or no params): the current accelerator if there is one.
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"device_id must be an int, a str or a torch.device, got {type(device_id).__name__}"
        )
    # torch FSDP1's reading: what torch.device makes of it ("cpu", "cuda:1", 0); an accelerator
    # without an index means its current device.
    device = device_id if isinstance(device_id, torch.device) else torch.device(device_id)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def _resolve_ignored(
    module: nn.Module, ignored_modules: Iterable | None, ignored_states: Iterable | None
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(  # torch FSDP1's words
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just "
            "pass ignored_states."
        )
    items = list(ignored_modules if ignored_modules is not None else ignored_states or [])
    types = sorted({type(item) for item in items}, key=repr)
    if ignored_modules is not None and not all(isinstance(i, nn.Module) for i in items):
        raise ValueError(  # torch FSDP1's class and words
            f"ignored_modules expects nn.Module list elements but got types {types}"
        )
    if not (
        all(isinstance(i, nn.Parameter) for i in items)
        or all(isinstance(i, nn.Module) for i in items)
    ):
        raise ValueError(
            "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
            f"types {types}"
        )
    mods: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for item in items:
        if isinstance(item, nn.Parameter):
            params.add(item)
        else:
            # A module outside the wrapped one is taken, as torch FSDP1 takes it (one list of
            # ignored modules passed to several wrappers): it has nothing here to leave alone.
            if owns_unit(item):
                raise ValueError("an ignored module cannot be a FullyShardedModule")
            if item is module:
                warnings.warn(  # torch FSDP1's words (its test_fsdp_ignored_modules matches them)
                    "Trying to ignore the top-level module passed into the FSDP constructor "
                    "itself will result in all parameters being ignored and is not "
                    f"well-supported: {module}",
                    stacklevel=4,
                )
            mods.add(item)
    for m in mods:
        params.update(m.parameters())
    return mods, params


def _move_to_device(module: nn.Module, config: UnitConfig) -> None:
    if _has_meta(list(module.modules())):
        return  # materialized on config.device unit by unit (_materialize)
    if config.storage_device != config.device:
        # CPU offload: params stay where they are and are sharded straight into CPU memory;
        # only buffers, which forward uses whole, go to the compute device.
        for m in module.modules():
            for name, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[name] = buf.to(config.device)
        return
    if any(p.device != config.device for p in module.parameters()):
        module.to(config.device)


def params_to_shard(module: nn.Module, config: UnitConfig) -> Iterator[tuple[str, nn.Parameter]]:
    """(clean name, parameter) for each parameter the unit built from ``module`` will shard: not
    a nested unit's, not ignored; for checks before any collective."""
    nested = {id(p.sharded_param) for m in module.modules() if owns_unit(m) for p in m._unit.params}
    for name, param in module.named_parameters():
        if id(param) not in nested and param not in config.ignored_params:
            yield clean_name(name), param


def check_tensor_parallel_params(module: nn.Module, config: UnitConfig, front: str) -> None:
    """Raise, before any collective, for DTensor parameters this unit cannot take: any under
    the FSDP1 front; under ``fully_shard``, a layout ``param.TensorParallel.check`` refuses."""
    for name, param in params_to_shard(module, config):
        if config.spmd is not None:  # every parameter a DTensor on the SPMD mesh
            TensorParallel.check_spmd(param, name, config.spmd)
            continue
        if not isinstance(param, DTensor):
            continue
        if front != "fully_shard":
            raise NotImplementedError(
                f"parameter {name!r} is a DTensor (tensor parallel); {front} does "
                "not shard DTensors: use fully_shard(module, mesh=mesh['dp'])"
            )
        TensorParallel.check(param, name, config.mesh)


def check_unit_params(module: nn.Module, config: UnitConfig, front: str) -> None:
    """Raise, before the unit is built and before any collective of its own, for parameters one
    unit cannot hold: two dtypes (its flat buffers have one), or a parameter that two units
    nested in ``module`` both hold (each would train its own copy of it).

    Nested units that share a parameter are siblings, each built before its parent: their
    common parent is the first unit that can see both (see Note [A parameter in two units])."""
    dtypes: dict[torch.dtype, str] = {}  # first parameter of each dtype
    for name, param in params_to_shard(module, config):
        refuse_all_gather_extension(param, name)
        dtypes.setdefault(param.dtype, name)
    if len(dtypes) > 1:
        (first, first_name), (other, other_name) = list(dtypes.items())[:2]
        where = f"{first_name!r} is {first}, {other_name!r} is {other}"
        if front == "fully_shard":  # torch FSDP2's words, at its lazy init
            got = "{" + ", ".join(map(str, dtypes)) + "}"
            raise ValueError(
                f"FSDP expects uniform original parameter dtype but got {got}: {where}; give "
                "the parameters of one fully_shard call one dtype (convert them first, or "
                "shard the modules of the other dtype with a fully_shard call of their own)"
            )
        raise ValueError(  # torch FSDP1's words, at its wrap
            f"Must flatten tensors with uniform dtype but got {first} and {other}: {where}; "
            "the parameters of one unit need one dtype (convert them before wrapping, or make "
            "the modules of the other dtype a unit of their own)"
        )
    # Note [A parameter in two units]: a unit holds only a weak reference to each orig_param,
    # which is freed once the second sibling has replaced it by its own shard. But CPython hands
    # out one weak reference per object (weakref.ref without a callback), so the two units hold
    # the same reference object: that identity outlives the parameter.
    paths = {id(m): name for name, m in module.named_modules()}
    holders: dict[int, tuple[int, str]] = {}  # id of an orig_param_ref -> (unit, name)
    seen_units: set[int] = set()
    for m in module.modules():
        if m is module or not owns_unit(m) or id(m._unit) in seen_units:
            continue
        seen_units.add(id(m._unit))  # a fully_shard([a, b]) unit has two owners
        for p in m._unit.params:
            holder, attr = p.locations[0]
            name = clean_name(f"{paths[id(holder)]}.{attr}".lstrip("."))
            first = holders.setdefault(id(p.orig_param_ref), (id(m._unit), name))
            if first[0] == id(m._unit):
                continue
            if front == "fully_shard":  # torch FSDP2's words, at its lazy init
                raise ValueError(
                    f"Parameter {name!r} is shared with a parameter already managed by another "
                    f"FSDP group ({first[1]!r}). For shared/tied parameters, use "
                    "fully_shard([module_a, module_b]) to place them in the same FSDP group."
                )
            raise ValueError(
                f"parameter {name!r} is shared with {first[1]!r} of another unit; put the "
                "modules sharing it in one unit (do not wrap them apart)"
            )


def _check_same_model_across_ranks(module: nn.Module, config: UnitConfig) -> None:
    """Fail with a message naming the difference if ranks built different models.

    Mismatched models would otherwise give collectives of different sizes, which hang or corrupt.
    """

    # Ignored parameters are left out: they are neither sharded nor reduced, and ranks may ignore
    # different modules (torch FSDP1 takes that; its test_diff_ignored_modules_across_ranks).
    if collectives.is_stand_in(config.group):
        return  # no other rank to ask (Note [Stand-in process groups])
    mine = [
        (name, tuple(p.shape), str(p.dtype))
        for name, p in module.named_parameters()
        if p not in config.ignored_params
    ]
    for group in _data_parallel_groups(config):
        _compare_across(mine, group)
    # Now, while the ranks are known to be together (collectives.py, Note [A group for the sends]).
    collectives.open_sends(config.group, config.device)


def _data_parallel_groups(config: UnitConfig) -> list[dist.ProcessGroup]:
    # Shard group first, then replicas: after both, every rank agrees with global rank 0.
    return [config.group] + ([config.replicate_group] if config.replicate_group else [])


_SAME_MODULE_HINT = (
    "; the ranks of a shard group must hold the same module (under pipeline or tensor "
    "parallelism, shard over the data-parallel sub-mesh, e.g. mesh['dp'])"
)


def _compare_across(mine: list, group: dist.ProcessGroup) -> None:
    everyone = collectives.all_gather_objects(mine, group=group)
    reference, first = everyone[0], dist.get_global_rank(group, 0)
    for rank, theirs in enumerate(everyone[1:], start=1):
        rank = dist.get_global_rank(group, rank)
        # Shapes and dtypes in order, not names: ranks may ignore different modules, which
        # renumbers the rest of a Sequential (torch's test_diff_ignored_modules_across_ranks).
        if [t[1:] for t in theirs] == [t[1:] for t in reference]:
            continue
        if len(theirs) != len(reference):
            raise ValueError(
                f"ranks built different models: rank {first} has {len(reference)} parameters, "
                f"rank {rank} has {len(theirs)}{_SAME_MODULE_HINT}"
            )
        for ref, other in zip(reference, theirs):
            if ref[1:] != other[1:]:
                raise ValueError(
                    "ranks built different models: parameter "
                    f"{ref[0]!r} is {ref[1]} {ref[2]} on rank {first} but {other[0]!r} is "
                    f"{other[1]} {other[2]} on rank {rank}{_SAME_MODULE_HINT}"
                )


def _broadcast_module_states(module: nn.Module, config: UnitConfig) -> None:
    _broadcast_from_rank0([*module.parameters(), *module.buffers()], config)


def _broadcast_from_rank0(tensors: list[torch.Tensor], config: UnitConfig) -> None:
    """Give every rank rank 0's values (shard group first, then across replicas)."""
    with torch.no_grad():
        for group in _data_parallel_groups(config):
            source = dist.get_global_rank(group, 0)
            for tensor in tensors:
                dist.broadcast(tensor.data, src=source, group=group)


def _build_unit(
    module: nn.Module, config: UnitConfig, shard_dims: dict[nn.Parameter, int] | None = None
) -> ShardedUnit:
    """Collect the parameters this wrapper owns (not nested wrappers', not ignored) and shard them,
    each on dim 0 or on its dim in ``shard_dims`` (param.py Note [Shard dim])."""
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    names: dict[nn.Parameter, str] = {}
    nested_params: dict[int, Param] = {}
    own_modules: list[nn.Module] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        path, m = stack.pop()
        if owns_unit(m):
            for p in m._unit.params:
                orig = p.orig_param_ref()
                if orig is not None:
                    nested_params[id(orig)] = p
            # What a nested unit ignores (a policy's override) and this one does not is this
            # unit's: torch FSDP1's parent takes it too.
            for sub, sub_path in _ignored_by_nested(m, path, config):
                stack.append((sub_path, sub))
            continue
        if m in config.ignored_modules:
            continue
        own_modules.append(m)
        for attr, param in m._parameters.items():
            if param is None or param in config.ignored_params:
                continue
            locations.setdefault(param, []).append((m, attr))
            names.setdefault(param, f"{path}{attr}")
        for child_name, child in reversed(list(m._modules.items())):
            if child is not None:
                stack.append((f"{path}{child_name}.", child))
    for param, name in names.items():
        if id(param) in nested_params:
            raise ValueError(
                f"parameter {clean_name(name)!r} is shared with a nested unit "
                f"({nested_params[id(param)].fqn!r}); put the modules sharing it in one unit"
            )
    buffers: dict[nn.Parameter, torch.Tensor] = {}  # param -> the unsharded buffer it lives in
    # By name: meta init below replaces the parameter objects.
    dim_of = {names[p]: dim for p, dim in (shard_dims or {}).items() if p in names}
    if _has_meta(own_modules):
        locations, names, buffers = _materialize(own_modules, locations, names, config, dim_of)
    # ``names`` is in registration (pre-order) order, so the flat layout is the same on every rank.
    ordered = list(names)
    # The group's own rank and size (a stand-in's too, Note [Stand-in process groups]).
    rank, world_size = config.group.rank(), config.group.size()
    params = [
        new_param(
            p,
            locations[p],
            clean_name(names[p]),
            config.mesh,
            rank,
            world_size,
            shard=config.rules.shard_params,
            options=ParamOptions(
                compute_dtype=config.precision.param_dtype,
                storage_device=config.storage_device,
                compute_device=config.device,
                unsharded_buffer=buffers.get(p),
                disk=config.disk,
                shard_dim=dim_of.get(names[p], 0),
                spmd=config.spmd,
            ),
        )
        for p in ordered
    ]
    # Buffers live whole on every rank; under mixed precision they compute in buffer_dtype.
    # The original dtypes are kept so that state dicts can hand them back in full precision.
    buffer_dtypes = {
        (m, name): buf.dtype
        for m in own_modules
        for name, buf in m._buffers.items()
        if buf is not None
    }
    unit = ShardedUnit(
        params,
        config.group,
        config.rules,
        config.precision,
        config.replicate_group,
        UnitSettings(
            forward_prefetch=config.forward_prefetch,
            backward_prefetch=config.backward_prefetch,
        ),
        buffer_dtypes,
    )
    unit.watch(order.CHECK)  # on by default; set_collective_order_check takes it off
    for p in params:
        if p.disk_files is not None:
            p.disk_files.unit_key = id(unit)  # disk.py groups and reads ahead by unit
    for m in own_modules:
        cast_buffers(m, config.precision.buffer_dtype, skip=(), recurse=False)
    return unit


def _ignored_by_nested(
    wrapper: nn.Module, path: str, config: UnitConfig
) -> list[tuple[nn.Module, str]]:
    """The outermost modules that nested ``wrapper`` ignores and ``config`` does not, with their
    paths (``path`` is the wrapper's)."""
    extra = wrapper._config.ignored_modules - config.ignored_modules
    found: list[tuple[nn.Module, str]] = []
    stack = [
        (f"{path}{name}.", child)
        for name, child in reversed(list(wrapper._modules.items()))
        if child is not None and not owns_unit(child)
    ]
    while stack:
        sub_path, sub = stack.pop()
        if sub in extra:
            found.append((sub, sub_path))
            continue
        for child_name, child in reversed(list(sub._modules.items())):
            if child is not None and not owns_unit(child):
                stack.append((f"{sub_path}{child_name}.", child))
    return found


def _has_meta(modules: list[nn.Module]) -> bool:
    return any(
        t is not None and t.is_meta
        for m in modules
        for t in (*m._parameters.values(), *m._buffers.values())
    )


def _materialize(
    own_modules: list[nn.Module],
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]],
    names: dict[nn.Parameter, str],
    config: UnitConfig,
    dim_of: dict[str, int],
) -> tuple[dict, dict, dict]:
    """Allocate and initialize this unit's meta-device params and buffers, just before sharding.

    Units are built children first, so only one unit is ever unsharded in memory: the model is
    never whole on one rank. Each param lives inside the padded unsharded buffer its
    ShardedParam will use (returned, param -> buffer). A tied parameter gets one tensor for all
    its places (``to_empty`` would untie it).

    Without ``param_init_fn``, params are allocated in their buffers and each module's
    ``reset_parameters()`` initializes them there: the unit exists once, not twice. A
    ``param_init_fn(module)`` is first called as torch FSDP1 calls it, on each module that holds
    meta tensors while it still does (torch's examples test ``is_meta`` and allocate with
    ``to_empty``); what it made is copied into the buffers. A module it left on the meta device
    (an init function that only initializes) gets its tensors allocated in the buffers and is
    passed to ``param_init_fn`` again. With ``sync_module_states`` rank 0's values are then
    broadcast.

    Raises:
        ValueError: ``param_init_fn`` gave a parameter another shape.
    """
    touched = [m for m in own_modules if _has_meta([m])]
    again = touched  # the modules to initialize once their tensors are allocated here
    if config.param_init_fn is not None:
        with torch.no_grad():
            for m in touched:
                config.param_init_fn(m)
        again = [m for m in touched if _has_meta([m])]
    real_locations: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    real_names: dict[nn.Parameter, str] = {}
    buffers: dict[nn.Parameter, torch.Tensor] = {}
    world_size = config.group.size()
    for param, where in locations.items():
        real = param
        # What the init function left in the parameter's (first) place, or the meta param.
        made = where[0][0]._parameters[where[0][1]]
        if param.is_meta:
            if not made.is_meta and made.shape != param.shape:
                raise ValueError(
                    f"param_init_fn gave parameter {clean_name(names[param])!r} the shape "
                    f"{tuple(made.shape)}; it must keep its shape {tuple(param.shape)}"
                )
            # Materialized inside its unsharded buffer, which ShardedParam keeps, when that is
            # in the param's own dtype; under a param_dtype it gets a buffer of that dtype.
            compute_dtype = config.precision.param_dtype or param.dtype
            # A tensor-parallel DTensor is sharded as its local tensor (param.py Note [Tensor
            # parallel parameters]): that is what gets materialized.
            shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
            if config.rules.shard_params and param.dim() > 0 and compute_dtype == param.dtype:
                buffer = torch.empty(
                    padded_numel(shape, world_size, dim_of.get(names[param], 0)),
                    dtype=param.dtype,
                    device=config.device,
                )
                data = buffer[: math.prod(shape)].view(shape)
            else:
                buffer = None
                data = torch.empty(shape, dtype=param.dtype, device=config.device)
            if not made.is_meta:  # made by param_init_fn: its values
                with torch.no_grad():
                    data.copy_(made._local_tensor if isinstance(made, DTensor) else made)
            if isinstance(param, DTensor):
                data = with_local(param, data)  # its TP layout, around the real local tensor
            real = nn.Parameter(data, requires_grad=param.requires_grad)
            if buffer is not None:
                buffers[real] = buffer
            for m, attr in where:
                m._parameters[attr] = real
        real_locations[real], real_names[real] = where, names[param]
    for m in touched:
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                m._buffers[name] = torch.empty_like(buf, device=config.device)
    with torch.no_grad():
        for m in again:
            if config.param_init_fn is not None:
                config.param_init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
    if config.sync_module_states:
        tensors = [t for m in touched for t in (*m._parameters.values(), *m._buffers.values())]
        # dict.fromkeys: a tied parameter is in two modules but is sent once
        _broadcast_from_rank0([t for t in dict.fromkeys(tensors) if t is not None], config)
    return real_locations, real_names, buffers
