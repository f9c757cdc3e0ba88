"""Model state dicts of a wrapped model: full, sharded and local, to save and to load.

Between steps every module attribute holds its ``sharded_param`` (a DTensor, Shard(0)), so plain
``nn.Module.state_dict()`` already yields the SHARDED_STATE_DICT. Each wrapper's ``state_dict`` and
``_load_from_state_dict`` (module.py) call into this file to turn its own unit's entries into the
configured type on the way out, and back into shards on the way in. The settings themselves
(``state_dict_type`` and friends, torch FSDP1's API) live here too. Optimizer state: optim_state.py.

Note [Full state dict, one unit at a time]: nn.Module.state_dict visits modules parent first and each
wrapper's override converts its entries after its subtree has returned, i.e. children first. A
wrapper gathers only its own unit, copies each parameter out and frees the gathered buffer before
the next unit starts, so the extra memory at any moment is one unit's ``all_gather_output``, not the
model. Ranks gather in the same (module) order, so their collectives match.

Note [What a loaded value means]: a DTensor is a shard already (copied, or resharded if its layout
differs); a plain tensor is a full parameter, except under LOCAL_STATE_DICT, where it is this rank's
rows. So one ``load_state_dict`` takes full, sharded (after ``dcp.load``) and local state dicts.
A ShardedTensor (torch FSDP1's SHARDED values) is taken when its local shard is this rank's rows.

Note [DTensor, not ShardedTensor]: SHARDED values are DTensors whatever ``_use_dtensor`` says.
torch FSDP1 gives ShardedTensor unless ``_use_dtensor=True``, but torch deprecates ShardedTensor
("Please use DTensor instead"), FSDP2 and torch's get_state_dict give DTensors, and DCP saves and
loads both alike, so a checkpoint round trip is unchanged. What differs is reading a value by
hand: ``.to_local()`` rather than ``.local_shards()`` / ``.local_tensor()``. Setting SHARDED
without ``_use_dtensor=True`` warns saying so, once per call site.

Note [torch's get_state_dict]: torch.distributed.checkpoint.state_dict puts native FSDP1 modules,
which it finds by their class, into SHARDED_STATE_DICT (or FULL) itself, then gathers, offloads
and distributes as its options say. It cannot find ours, so it treats them as FSDP2 modules and
takes ``model.state_dict()`` as it comes: under FSDP1's default FULL_STATE_DICT that would be
full tensors even for ``full_state_dict=False``. So while that helper is on the stack (its
``_get_model_state_dict`` or ``_load_model_state_dict``), a wrapper answers as FSDP2 does:
SHARDED, on the shards' device, whatever ``state_dict_type`` says (FSDP1's settings are overridden
by the helper too). The helper does the rest, exactly as for FSDP2. Recognizing a caller by its
frame reads no private state and patches nothing; if torch renames those functions, wrappers
fall back to their settings and ``set_state_dict_type(SHARDED_STATE_DICT)`` still works.

Note [Full state dicts for torch's helper]: asked for ``full_state_dict=True``, torch's helper
gathers each DTensor it gets with ``full_tensor()``: a functional all-gather on the DTensor's
mesh, which for fsdp_lite's units is the units' own group. That collective is neither logged nor
watched by the collective-order check (tools/order.py), and on gloo it takes its place among the
group's collectives: called on rank 0 only while rank 1 all-gathers something of its own (HF
Trainer's pattern), gloo paired the two and aborted rank 1 ("Received data size doesn't match
expected size"); same sizes would have exchanged the wrong data. So while the helper's
``_get_model_state_dict`` asks for a full state dict, each unit gathers its own entries itself
(``gather_for_torch_helper``): one ``gather_full`` per unit, children first as in Note [Full state
dict, one unit at a time], in phase "state_dict", with the unit's own point-to-point tags and the
order check watching, and hands the helper plain tensors, which it keeps as they are. With
``cpu_offload`` the helper keeps rank 0's values only (torch's ``ranks_only``): the values go to
CPU unit by unit, and the other ranks take part in each gather but keep nothing (their entries
become their local shards, which the helper drops; a DTensor left there would make the helper
gather on those ranks alone). Units whose parameters are tensor-parallel DTensors, or not sharded,
are left to the helper: a TP parameter's full value needs the TP mesh's gather too, and an
unsharded one needs none. The FSDP1 wrapper does it in ``after_state_dict``; a fully_shard
module through ``full_state_dict_hook``, its state dict post hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_lite.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    as_ours,
)
from fsdp_lite.engine.offload import with_local
from fsdp_lite.engine.param import ShardedParam
from fsdp_lite.engine.runtime import to_rest
from fsdp_lite.engine.unit import ShardedUnit, unit_owners
from fsdp_lite.names import clean_name

__all__ = [
    "after_state_dict",
    "as_shard",
    "before_load",
    "clean_load_result",
    "default_settings",
    "full_state_dict_hook",
    "gather_for_torch_helper",
    "get_state_dict_type",
    "set_state_dict_type",
    "settings_of",
    "state_dict_type",
    "torch_helper_wants_full",
    "wrappers_in",
]

# The config classes each type takes, as torch FSDP1 checks them (an exact type, not a subclass).
CONFIG_TYPES: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def wrappers_in(module: nn.Module) -> list[nn.Module]:
    return unit_owners(module)


# ---- settings ------------------------------------------------------------------------------------


def default_settings() -> StateDictSettings:
    """FULL_STATE_DICT with default configs: what a new wrapper uses, as in torch FSDP1."""
    return StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )


def settings_of(wrapper: nn.Module) -> StateDictSettings:
    """One wrapper's settings (``_state_dict_settings`` is None until someone sets them)."""
    if wrapper._state_dict_settings is None:
        wrapper._state_dict_settings = default_settings()
    return wrapper._state_dict_settings


# The functions of torch's state dict helper that call model.state_dict() / load_state_dict().
TORCH_STATE_DICT_HELPER = (
    "torch.distributed.checkpoint.state_dict",
    {"_get_model_state_dict", "_load_model_state_dict"},
)


def _called_by_torch_helper() -> bool:
    """Whether torch's get/set_state_dict is on the stack (Note [torch's get_state_dict])."""
    module_name, function_names = TORCH_STATE_DICT_HELPER
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name in function_names
            and frame.f_globals.get("__name__") == module_name
        ):
            return True
        frame = frame.f_back
    return False


def torch_helper_wants_full() -> bool | None:
    """Whether torch's helper is saving a full state dict (Note [Full state dicts for torch's
    helper]): None if not; else whether it asks for ``cpu_offload`` too. Read from the
    ``info`` of its ``_get_model_state_dict`` frame; None where torch renamed either."""
    module_name, _ = TORCH_STATE_DICT_HELPER
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == module_name:
            if frame.f_code.co_name == "_get_model_state_dict":
                info = frame.f_locals.get("info")
                if getattr(info, "full_state_dict", False) is not True:
                    return None
                return bool(getattr(info, "cpu_offload", False))
            if frame.f_code.co_name == "_load_model_state_dict":
                return None
        frame = frame.f_back
    return None


def effective_settings(wrapper: nn.Module) -> StateDictSettings:
    """The settings a state dict call uses: the wrapper's, or SHARDED under torch's helper."""
    if _called_by_torch_helper():
        return StateDictSettings(
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=True),
            ShardedOptimStateDictConfig(offload_to_cpu=False, _use_dtensor=True),
        )
    return settings_of(wrapper)


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state dict type and configs of every wrapper in ``module``'s tree.

    Args:
        module: the root (it need not be a wrapper itself).
        state_dict_type: FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT.
        state_dict_config: the model config; default: that type's config with its defaults.
        optim_state_dict_config: the optimizer config; default likewise.

    Returns:
        The settings that were in force before (those of the first wrapper).

    Warns:
        UserWarning: SHARDED_STATE_DICT without ``_use_dtensor=True``: the values are DTensors,
            not torch FSDP1's ShardedTensor (Note [DTensor, not ShardedTensor]).
    """
    if state_dict_type == StateDictType.SHARDED_STATE_DICT and not (
        getattr(state_dict_config, "_use_dtensor", False)
        and getattr(optim_state_dict_config, "_use_dtensor", True)  # None: the model's says it
    ):  # see Note [DTensor, not ShardedTensor]
        warnings.warn(SHARDED_TENSOR_NOTE, UserWarning, stacklevel=_user_stacklevel())
    return _set_settings(module, state_dict_type, state_dict_config, optim_state_dict_config)


SHARDED_TENSOR_NOTE = (
    "fsdp_lite's SHARDED_STATE_DICT values are DTensors (Shard(0)) whatever _use_dtensor says, "
    "where torch FSDP1 gives ShardedTensor unless _use_dtensor=True: read this rank's rows with "
    ".to_local(), not .local_shards() or .local_tensor(). torch.distributed.checkpoint saves and "
    "loads both alike. Pass ShardedStateDictConfig(_use_dtensor=True) and "
    "ShardedOptimStateDictConfig(_use_dtensor=True) to say you expect DTensors."
)


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside fsdp_lite (and contextlib, for ``with``), so
    the warning names the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("fsdp_lite") or name == "contextlib"):
            break
        frame, level = frame.f_back, level + 1
    return level


def _set_settings(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None,
    optim_state_dict_config: OptimStateDictConfig | None,
) -> StateDictSettings:
    # torch FSDP's enum and configs (what Accelerate and Lightning pass) are taken as ours.
    state_dict_type = as_ours(state_dict_type, StateDictType, "state_dict_type")
    if state_dict_type is None:
        raise TypeError("state_dict_type must be StateDictType, got None")
    config_type, optim_config_type = CONFIG_TYPES[state_dict_type]
    state_dict_config = _as_our_config(state_dict_config, "state_dict_config") or config_type()
    optim_state_dict_config = (
        _as_our_config(optim_state_dict_config, "optim_state_dict_config") or optim_config_type()
    )
    for what, config, expected in (
        ("state_dict_config", state_dict_config, config_type),
        ("optim_state_dict_config", optim_state_dict_config, optim_config_type),
    ):
        if type(config) is not expected:
            raise RuntimeError(
                f"Expected {what} of type {expected.__module__}.{expected.__qualname__} for "
                f"{state_dict_type.name}, got {type(config).__module__}.{type(config).__qualname__}"
            )
    previous = None
    for w in wrappers_in(module):
        mine = settings_of(w)
        if previous is None:
            previous = dataclasses.replace(mine)
        elif mine.state_dict_type != previous.state_dict_type:
            raise AssertionError("All FSDP modules should have the same state_dict_type.")
        w._state_dict_settings = StateDictSettings(
            state_dict_type, state_dict_config, optim_state_dict_config
        )
    return previous


# Every config class by name, so that torch FSDP's configs map to ours (api.as_ours).
_CONFIG_CLASSES = {c.__name__: c for pair in CONFIG_TYPES.values() for c in pair}


def _as_our_config(value: Any, what: str) -> Any:
    """A config as fsdp_lite's class of the same name; unknown classes pass through unchanged
    (the exact-type check after names them)."""
    ours = _CONFIG_CLASSES.get(type(value).__name__)
    return value if value is None or ours is None else as_ours(value, ours, what)


def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
    """The settings of the wrappers in ``module``'s tree (None if there are none).

    Raises:
        AssertionError: two wrappers have different settings.
    """
    settings = None
    for w in wrappers_in(module):
        mine = settings_of(w)
        if settings is None:
            settings = mine
        elif mine != settings:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings. Got {mine} and "
                f"{settings}."
            )
    return settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """``set_state_dict_type`` for the block, then the previous settings again."""
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        if previous is not None:  # no second warning: these settings were set before
            _set_settings(
                module,
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
            )


# ---- at rest -------------------------------------------------------------------------------------


# ---- saving --------------------------------------------------------------------------------------


def _own_keys(wrapper: nn.Module, prefix: str) -> dict[str, ShardedParam]:
    """The state dict keys under ``prefix`` that name this wrapper's own params (tied: several)."""
    unit: ShardedUnit = wrapper._unit
    by_location = {(id(m), attr): p for p in unit.params for m, attr in p.locations}
    keys: dict[str, ShardedParam] = {}
    for path, m in wrapper._fsdp_wrapped_module.named_modules(remove_duplicate=False):
        for attr in m._parameters:
            p = by_location.get((id(m), attr))
            if p is not None:
                # Clean: wrappers applied after this one (checkpoint_wrapper) drop their prefix
                # from the keys before this wrapper sees them, as nested wrappers drop theirs.
                keys[prefix + clean_name(f"{path}.{attr}" if path else attr)] = p
    return keys


def _restore_buffer_dtypes(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Buffers cast to MixedPrecision.buffer_dtype are saved in their original dtype, as torch does."""
    dtypes = wrapper._unit.buffer_dtypes
    for path, m in wrapper._fsdp_wrapped_module.named_modules():
        for name, buf in m._buffers.items():
            dtype = dtypes.get((m, name))
            key = prefix + clean_name(f"{path}.{name}" if path else name)
            if buf is not None and dtype is not None and key in state_dict:
                state_dict[key] = state_dict[key].to(dtype)


def after_state_dict(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str) -> dict:
    """Turn this wrapper's entries of a raw (sharded) state dict into the configured type.

    Called on the dict nn.Module.state_dict built for this wrapper's subtree, whose nested
    wrappers have already converted theirs (Note [Full state dict, one unit at a time]).
    """
    settings = effective_settings(wrapper)
    config = settings.state_dict_config
    unit: ShardedUnit = wrapper._unit
    own = _own_keys(wrapper, prefix)
    _restore_buffer_dtypes(wrapper, state_dict, prefix)
    cpu_offload = torch_helper_wants_full()
    if cpu_offload is not None:  # Note [Full state dicts for torch's helper]
        gather_for_torch_helper(unit, state_dict, own, cpu_offload)
        return state_dict
    cpu = torch.device("cpu")
    if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
        rank0_only = getattr(config, "rank0_only", False)
        keep = not rank0_only or unit.rank == 0
        if unit.rules.shard_params and unit.params:
            device = cpu if config.offload_to_cpu else None
            flats = [p.sharded_flat for p in unit.params]
            full = dict(zip(unit.params, unit.gather_full(flats, "state_dict", keep, device)))
            if keep:
                for key, p in own.items():
                    if key in state_dict:
                        state_dict[key] = full[p]
        if not keep:  # as torch: only rank 0 returns anything
            for key in [k for k in state_dict if k.startswith(prefix)]:
                del state_dict[key]
        elif config.offload_to_cpu:
            _to_cpu(state_dict, prefix)
        return state_dict
    is_local = settings.state_dict_type == StateDictType.LOCAL_STATE_DICT
    for key in own:
        value = state_dict.get(key)
        if not isinstance(value, DTensor):
            continue  # NO_SHARD: a plain parameter, the same in every type
        if is_local:
            value = value.to_local()  # (local_rows, *rest): this rank's rows, plain
        elif config.offload_to_cpu:
            value = with_local(value, value.to_local().cpu())
        state_dict[key] = value
    if config.offload_to_cpu:
        _to_cpu(state_dict, prefix)
    return state_dict


def gather_for_torch_helper(
    unit: ShardedUnit, state_dict: dict[str, Any], own: dict[str, ShardedParam], cpu_offload: bool
) -> None:
    """Replace the DTensor values of ``own`` (key -> parameter of ``unit``) in ``state_dict`` by
    the full parameters, gathered by ``unit``: Note [Full state dicts for torch's helper]."""
    if not (unit.rules.shard_params and unit.params) or any(p.tp is not None for p in unit.params):
        return  # left to torch's full_tensor(): no collective, or one over the TP mesh too
    keys = {key: p for key, p in own.items() if isinstance(state_dict.get(key), DTensor)}
    if not keys:
        return
    keep = not cpu_offload or dist.get_rank() == 0  # torch's ranks_only=(0,) under cpu_offload
    device = torch.device("cpu") if cpu_offload else None
    flats = [p.sharded_flat for p in unit.params]
    full = dict(zip(unit.params, unit.gather_full(flats, "state_dict", keep, device)))
    for key, p in keys.items():
        state_dict[key] = full[p] if keep else state_dict[key].to_local()


def full_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict
) -> None:
    """A fully_shard module's state dict post hook: under torch's helper saving a full state
    dict, its unit gathers the module's own entries (Note [Full state dicts for torch's
    helper]); otherwise it leaves the sharded DTensors as they are."""
    cpu_offload = torch_helper_wants_full()
    if cpu_offload is None:
        return
    unit: ShardedUnit = module._unit
    by_location = {(id(m), attr): p for p in unit.params for m, attr in p.locations}
    own: dict[str, ShardedParam] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for attr in m._parameters:
            p = by_location.get((id(m), attr))
            if p is not None:
                own[prefix + clean_name(f"{path}.{attr}" if path else attr)] = p
    gather_for_torch_helper(unit, state_dict, own, cpu_offload)


def _to_cpu(state_dict: dict[str, Any], prefix: str) -> None:
    for key, value in state_dict.items():
        if key.startswith(prefix) and torch.is_tensor(value) and not isinstance(value, DTensor):
            state_dict[key] = value.cpu()


# ---- loading -------------------------------------------------------------------------------------


def before_load(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Replace the values for this wrapper's params with shards laid out like ``sharded_param``.

    See Note [What a loaded value means]. Called from the wrapper's ``_load_from_state_dict`` on
    the dict nn.Module.load_state_dict hands it (its own copy), before the keys get the
    ``_fsdp_wrapped_module.`` prefix back. Wrong shapes are left for nn.Module to report.
    """
    to_rest(wrapper)
    is_local = effective_settings(wrapper).state_dict_type == StateDictType.LOCAL_STATE_DICT
    wrapped_prefix = prefix + "_fsdp_wrapped_module."
    for key, p in _own_keys(wrapper, prefix).items():
        for name in (key, wrapped_prefix + key[len(prefix) :]):  # clean or raw key
            if name in state_dict:
                state_dict[name] = as_shard(state_dict[name], p, is_local, name)


def as_shard(value: Any, p: ShardedParam, is_local: bool, key: str) -> Any:
    """``value`` laid out like ``p.sharded_param`` (see Note [What a loaded value means])."""
    if not torch.is_tensor(value):
        return value
    if not p.is_sharded:
        return value.full_tensor() if isinstance(value, DTensor) else value
    target: DTensor = p.sharded_param
    if _is_sharded_tensor(value):
        return with_local(target, _rows_of_sharded_tensor(value, p, key).to(target.device))
    if isinstance(value, DTensor):
        same_layout = (
            value.placements == target.placements
            and value.device_mesh == target.device_mesh
            and value.shape == target.shape
        )
        if same_layout:
            return value
        value = value.full_tensor()  # another layout (e.g. Replicate): every rank has it all
    elif is_local:
        local_size = (p.local_rows, *p.orig_size[1:])
        if value.shape != local_size:
            raise ValueError(
                f"LOCAL_STATE_DICT value for {key!r} has shape {tuple(value.shape)}, but this "
                f"rank's shard is {tuple(local_size)} (saved at another world size or rank?)"
            )
        return with_local(target, value.to(target.device))
    if value.shape != p.orig_size:
        return value  # nn.Module reports the size mismatch with the key's name
    start = p.rank * p.shard_rows
    rows = value[start : start + p.local_rows]  # this rank's rows, Note [Padding] in param.py
    return with_local(target, rows.to(target.device))


def _is_sharded_tensor(value: Any) -> bool:
    # Duck-typed: importing torch.distributed._shard would load the deprecated package for all.
    return hasattr(value, "local_shards") and hasattr(value, "metadata")


def _rows_of_sharded_tensor(value: Any, p: ShardedParam, key: str) -> torch.Tensor:
    """This rank's rows from a ShardedTensor, if its local shard holds exactly them."""
    start, rest = p.rank * p.shard_rows, tuple(p.orig_size[1:])
    shards = value.local_shards()
    if not shards and p.local_rows == 0:
        return p.sharded_param.to_local()  # no rows here, in either layout
    if len(shards) == 1:
        meta = shards[0].metadata
        if tuple(meta.shard_offsets) == (start,) + (0,) * len(rest) and tuple(meta.shard_sizes) == (
            p.local_rows,
            *rest,
        ):
            return shards[0].tensor
    held = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in shards]
    raise ValueError(
        f"{key!r} is a ShardedTensor whose local shards (offsets, sizes) {held} are not this "
        f"rank's rows [{start}, {start + p.local_rows}) (saved at another world size?): load it "
        "with torch.distributed.checkpoint into this model's SHARDED_STATE_DICT, which reshards"
    )


def clean_load_result(result: Any) -> Any:
    """Strip ``_fsdp_wrapped_module.`` from the key names nn.Module reports."""
    result.missing_keys[:] = [clean_name(k) for k in result.missing_keys]
    result.unexpected_keys[:] = [clean_name(k) for k in result.unexpected_keys]
    return result
