"""Optimizer state keyed by parameter name: to save it, to reshard it, to load it (torch FSDP1's API).

The optimizer steps ``sharded_param`` DTensors, so its state (``exp_avg`` ...) is DTensors of the
same layout, keyed by position in ``optim.param_groups``. Here that becomes the layout torch FSDP1
(``use_orig_params=True``) and ``torch.distributed.checkpoint.state_dict`` save:

    {"state": {"fc1.weight": {"step": tensor(3.), "exp_avg": <DTensor or full tensor>, ...}, ...},
     "param_groups": [{"lr": 0.01, ..., "params": ["fc1.weight", "fc1.bias", ...]}]}

FULL gathers each DTensor to a full tensor (one tensor at a time); SHARDED keeps the DTensors.
Loading takes either and slices or reshards to this rank's rows, so world sizes may differ.
Model state dicts: state_dict.py.

Note [Full optimizer state on rank 0 only]: with ``rank0_only`` each state tensor is sent to rank 0
with ``dist.gather`` (gloo and NCCL have it), straight into the exact-size output there. A non-zero
rank sends its rows and allocates nothing (a short last shard: one padded copy of its rows), and
rank 0 holds the output plus at most one short block, where an all-gather would give every rank
each full tensor in turn.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_lite.api import OptimStateKeyType, StateDictType, as_ours
from fsdp_lite.engine.offload import with_local
from fsdp_lite.engine.param import shard_rows
from fsdp_lite.engine.runtime import to_rest
from fsdp_lite.names import clean_name
from fsdp_lite.state.state_dict import (
    as_shard,
    default_settings,
    get_state_dict_type,
    wrappers_in,
)

__all__ = [
    "OptimStateKeyType",
    "full_optim_state_dict",
    "named_optim_state_dict",
    "named_to_loadable",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "param_names",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]


# ---- names ---------------------------------------------------------------------------------------


def param_names(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every name of each parameter of ``model`` (the first is the canonical one; tied: more)."""
    for w in wrappers_in(model):
        to_rest(w)  # the optimizer holds sharded_param: the module attributes must too
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(clean_name(name))
    return names


def _param_groups(
    optim: torch.optim.Optimizer | None, model: nn.Module, optim_input: Iterable | None = None
) -> list[dict]:
    """The parameter groups whose order numbers the parameter ids, by torch FSDP1's rule.

    ``optim_input`` (deprecated in torch, what was passed to the optimizer: parameters or
    parameter groups) comes first, then ``optim.param_groups``, then ``model.parameters()``.
    Given both, they must list the same parameters in the same order: ``optim.state_dict()``
    numbers its state by ``optim``'s order, so another order would put state under wrong names.
    """
    if optim_input is None:
        if optim is not None:
            return optim.param_groups
        return [{"params": list(model.parameters())}]
    warnings.warn(
        "optim_input is deprecated, as in torch FSDP1: pass the optimizer as optim instead "
        "(parameter ids then follow optim.param_groups)",
        FutureWarning,
        stacklevel=3,
    )
    items = list(optim_input)
    if items and all(isinstance(item, dict) for item in items):
        if not all("params" in group for group in items):
            raise ValueError('optim_input: each parameter group must map "params" to a list')
        groups = [dict(group, params=list(group["params"])) for group in items]
    elif items and all(isinstance(item, torch.Tensor) for item in items):
        groups = [{"params": items}]
    else:
        raise TypeError(
            "optim_input must be a non-empty iterable of parameters or of parameter groups "
            f"(dicts), as passed to the optimizer; got {items[:3]!r}"
        )
    if optim is not None:
        given = [p for group in groups for p in group["params"]]
        stepped = [p for group in optim.param_groups for p in group["params"]]
        differ = [i for i, (a, b) in enumerate(zip(given, stepped)) if a is not b]
        if len(given) != len(stepped) or differ:
            where = f"first at position {differ[0]}" if differ else "another count"
            raise ValueError(
                f"optim_input does not list optim's parameters in optim's order ({len(given)} "
                f"given, {len(stepped)} in optim, {where}); optim's state is numbered by "
                "optim's order. Drop optim_input (deprecated): ids then follow optim."
            )
    return groups


def _optim_params(
    optim: torch.optim.Optimizer | None, model: nn.Module, optim_input: Iterable | None = None
) -> list[nn.Parameter]:
    """Parameters in the order their ids are counted (see ``_param_groups``)."""
    return [p for group in _param_groups(optim, model, optim_input) for p in group["params"]]


def _name_of(names: dict[nn.Parameter, list[str]], param: nn.Parameter) -> str:
    if param not in names:
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in the "
            "model (was the optimizer built before wrapping, on the original parameters?)"
        )
    return names[param][0]


def _group_of(model: nn.Module, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    wrappers = wrappers_in(model)
    if wrappers:
        return wrappers[0]._unit.group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


# ---- saving --------------------------------------------------------------------------------------


def named_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    *,
    full: bool,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    group: dist.ProcessGroup | None = None,
    optim_input: Iterable | None = None,
) -> dict[str, Any]:
    """Key ``optim.state_dict()`` by parameter name; with ``full``, gather each DTensor.

    Every rank must call this: a full gather is one collective per DTensor, in the order of
    ``optim.param_groups``. With ``rank0_only`` the other ranks return ``{}``.
    """
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    names = param_names(model)
    params = _optim_params(optim, model, optim_input)  # before any collective: it may raise
    group = _group_of(model, group)
    rank = dist.get_rank(group) if group is not None else 0
    keep = not (full and rank0_only) or rank == 0
    state: dict[str, Any] = {}
    for index, param in enumerate(params):
        if index not in osd["state"]:
            continue
        name = _name_of(names, param)
        entry = {}
        for key, value in osd["state"][index].items():
            if isinstance(value, DTensor) and full and rank0_only:
                value = _gather_to_rank0(value)  # see Note [Full optimizer state on rank 0 only]
            elif isinstance(value, DTensor) and full:
                value = value.full_tensor()  # all ranks: one all-gather per state tensor
            elif isinstance(value, DTensor) and offload_to_cpu:
                value = with_local(value, value.to_local().cpu())
            if torch.is_tensor(value) and not isinstance(value, DTensor) and offload_to_cpu:
                value = value.cpu()
            entry[key] = value
        if keep:
            state[name] = entry
    if not keep:
        return {}
    groups = []
    for saved_group, group_now in zip(osd["param_groups"], optim.param_groups):
        named = {k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"}
        named["params"] = [_name_of(names, p) for p in group_now["params"]]
        groups.append(named)
    return {"state": state, "param_groups": groups}


def _gather_to_rank0(value: DTensor) -> torch.Tensor | None:
    """The full tensor of a Shard(0) DTensor on rank 0 of its shard group; None elsewhere.

    2 ranks, a state tensor of 3 rows (shard_rows 2, rank 1 holds one row and one of padding):
      rank 0 sends [r0 r1], receives [r0 r1] and [r2 pad] into out [r0 r1 r2]
      rank 1 sends [r2 pad], receives nothing
    """
    mesh = value.device_mesh
    if value.placements[-1] != Shard(0) or any(p != Replicate() for p in value.placements[:-1]):
        return value.full_tensor()  # not our layout (e.g. tensor parallel): DTensor's own gather
    group = mesh.get_group(mesh.ndim - 1)  # HYBRID_SHARD: gather within the shard group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = _group_device(group)
    local = value.to_local()  # (local_rows, *rest)
    rows = shard_rows(value.shape[0], world_size)
    send = local.to(device).contiguous()  # no copy for a CPU shard on gloo
    if send.shape[0] != rows:  # a short last shard: gather needs equal sizes, so pad
        padded = send.new_zeros((rows, *send.shape[1:]))  # (rows, *rest)
        padded[: send.shape[0]].copy_(send)
        send = padded
    dst = dist.get_global_rank(group, 0)
    if rank != 0:
        dist.gather(send, None, dst=dst, group=group)
        return None
    out = torch.empty(value.shape, dtype=send.dtype, device=device)
    # Each rank's rows land in place in ``out``; only a short last block goes through a temporary.
    blocks = [out[r * rows : (r + 1) * rows] for r in range(world_size)]
    recv = [b if b.shape[0] == rows else torch.empty_like(send) for b in blocks]
    dist.gather(send, recv, dst=dst, group=group)
    for block, received in zip(blocks, recv):
        if received is not block:
            block.copy_(received[: block.shape[0]])
    return out


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter name, of the type set by ``state_dict_type``.

    FULL_STATE_DICT: full tensors (``FullOptimStateDictConfig``: ``offload_to_cpu`` default True,
    ``rank0_only``). SHARDED / LOCAL: DTensors, as torch FSDP1 (its LOCAL also shards).

    Args:
        model: the root whose parameters ``optim`` steps.
        optim: the optimizer.
        optim_state_dict: ``optim.state_dict()`` already taken (default: take it now).
        group: the process group the parameters are sharded over (default: the model's).
    """
    settings = get_state_dict_type(model) or default_settings()
    config = settings.optim_state_dict_config
    return named_optim_state_dict(
        model,
        optim,
        optim_state_dict,
        full=settings.state_dict_type == StateDictType.FULL_STATE_DICT,
        rank0_only=getattr(config, "rank0_only", False),
        offload_to_cpu=config.offload_to_cpu,
        group=group,
    )


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Iterable | None = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Full (gathered, CPU) optimizer state keyed by name; only rank 0's is filled by default.

    ``optim_input`` (deprecated) must list ``optim``'s parameters in its order, if given.
    """
    return named_optim_state_dict(
        model,
        optim,
        full=True,
        rank0_only=rank0_only,
        offload_to_cpu=True,
        group=group,
        optim_input=optim_input,
    )


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Optimizer state keyed by name, each state tensor this rank's DTensor shard (on CPU)."""
    return named_optim_state_dict(model, optim, full=False, offload_to_cpu=True, group=group)


# ---- loading -------------------------------------------------------------------------------------


def named_to_loadable(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    named_osd: dict[str, Any] | None,
    *,
    broadcast_from_rank0: bool = False,
    keep_names: bool = False,
    group: dist.ProcessGroup | None = None,
    optim_input: Iterable | None = None,
) -> dict[str, Any]:
    """Turn a name-keyed optimizer state dict into one ``optim.load_state_dict`` takes.

    Each state tensor is laid out like its parameter here: a full tensor is cut to this rank's
    rows, a DTensor kept or resharded, so the world size may differ from the save's. With
    ``broadcast_from_rank0`` only rank 0 needs ``named_osd``; it sends one tensor at a time.
    """
    group = _group_of(model, group)
    param_groups = _param_groups(optim, model, optim_input)  # before any collective: it may raise
    if broadcast_from_rank0:
        named_osd = _broadcast_from_rank0(named_osd, group)
    names = param_names(model)
    params = [p for g in param_groups for p in g["params"]]
    sharded = {id(p.sharded_param): p for w in wrappers_in(model) for p in w._unit.params}
    saved_state = named_osd["state"]
    state: dict[Any, Any] = {}
    for index, param in enumerate(params):
        fqn = next((n for n in names.get(param, []) if n in saved_state), None)
        if fqn is None:
            continue  # no saved state for it (never stepped): the optimizer starts it fresh
        p = sharded.get(id(param))
        entry = {}
        for key, value in saved_state[fqn].items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"optimizer state {fqn}.{key} has shape {tuple(value.shape)}, but the "
                    f"parameter has shape {tuple(param.shape)}"
                )
            if p is not None and torch.is_tensor(value) and value.dim() > 0:
                value = as_shard(value, p, is_local=False, key=f"{fqn}.{key}")
            elif isinstance(value, DTensor):
                value = value.full_tensor()  # a plain (NO_SHARD, unwrapped) parameter here
            entry[key] = value
        state[fqn if keep_names else index] = entry
    groups = _match_groups(named_osd["param_groups"], param_groups, params, names, keep_names)
    return {"state": state, "param_groups": groups}


def _match_groups(saved_groups, groups_now, params, names, keep_names) -> list[dict]:
    """Pair each of the optimizer's groups with the saved group that holds its parameters."""
    ids = {param: index for index, param in enumerate(params)}
    result = []
    for group_now in groups_now:
        mine = [_name_of(names, p) for p in group_now["params"]]
        saved = next(
            (
                g
                for g in saved_groups
                if any(n in g["params"] for p in group_now["params"] for n in names[p])
            ),
            None,
        )
        if saved is None:
            raise ValueError(
                f"no saved param group holds any of the parameters {mine[:4]}"
                f"{' ...' if len(mine) > 4 else ''}"
            )
        group = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
        group["params"] = mine if keep_names else [ids[p] for p in group_now["params"]]
        result.append(group)
    return result


def _broadcast_from_rank0(named_osd: dict | None, group: dist.ProcessGroup) -> dict:
    """Send rank 0's name-keyed state to every rank: the structure as an object, then each
    tensor by itself, so no rank holds more than one extra full tensor while receiving."""
    rank = dist.get_rank(group)
    skeleton = None
    if rank == 0:
        skeleton = {
            "state": {
                fqn: {
                    k: ("tensor", v.shape, v.dtype) if torch.is_tensor(v) else ("value", v)
                    for k, v in entry.items()
                }
                for fqn, entry in named_osd["state"].items()
            },
            "param_groups": named_osd["param_groups"],
        }
    box = [skeleton]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    skeleton = box[0]
    device = _group_device(group)
    state = {}
    for fqn, entry in skeleton["state"].items():
        state[fqn] = {}
        for k, (kind, *rest) in entry.items():
            if kind == "value":
                state[fqn][k] = rest[0]
                continue
            shape, dtype = rest
            if rank == 0:
                tensor = named_osd["state"][fqn][k].detach().to(device)
                if isinstance(tensor, DTensor):
                    tensor = tensor.full_tensor()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
            state[fqn][k] = tensor
    return {"state": state, "param_groups": skeleton["param_groups"]}


def _group_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Turn a state dict from ``optim_state_dict`` (full or sharded, any world size) into one
    ``optim.load_state_dict`` takes. Under FULL_STATE_DICT with ``rank0_only`` only rank 0 needs
    it. ``is_named_optimizer``: keep the names as keys. ``load_directly``: also load it.
    """
    settings = get_state_dict_type(model) or default_settings()
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    rank0_only = full and getattr(settings.optim_state_dict_config, "rank0_only", False)
    result = named_to_loadable(
        model,
        optim,
        optim_state_dict,
        broadcast_from_rank0=rank0_only,
        keep_names=is_named_optimizer,
        group=group,
    )
    if load_directly:
        optim.load_state_dict(result)
    return result


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Iterable | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's part of a full, name-keyed optimizer state dict that every rank holds.

    Ids and groups follow ``optim_input`` (deprecated: what was passed to the optimizer) if
    given, else ``optim``, else ``model.parameters()``, as in torch FSDP1.
    """
    return named_to_loadable(model, optim, full_optim_state_dict, optim_input=optim_input)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Iterable | None = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    """Like ``shard_full_optim_state_dict``, but only rank 0 holds the full state dict."""
    return named_to_loadable(
        model,
        optim,
        full_optim_state_dict,
        broadcast_from_rank0=True,
        group=group,
        optim_input=optim_input,
    )


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: Iterable | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Re-key an optimizer state dict by parameter name or by id, wrapped model or not.

    To load a full state dict from a wrapped model into a plain one: rekey to PARAM_ID with the
    plain model; the reverse: rekey a plain optimizer's state dict to PARAM_NAME. Ids count
    ``optim_input``'s parameters if given (deprecated), else ``optim``'s, else
    ``model.parameters()``, as in torch FSDP1. As torch, each group's ``params`` comes back
    sorted.
    """
    try:  # torch FSDP's OptimStateKeyType is taken as ours
        key_type = as_ours(optim_state_key_type, OptimStateKeyType, "optim_state_key_type")
    except TypeError as e:
        raise ValueError(str(e)) from None
    if key_type is None:
        raise ValueError("optim_state_key_type must be OptimStateKeyType, got None")
    optim_state_key_type = key_type
    keys = [*optim_state_dict["state"]]
    keys += [k for group in optim_state_dict["param_groups"] for k in group["params"]]
    by_name = [isinstance(k, str) for k in keys]
    if any(by_name) and not all(by_name):
        raise ValueError(f"Invalid parameter keys: {keys}")
    want_names = optim_state_key_type == OptimStateKeyType.PARAM_NAME
    if not keys or all(by_name) == want_names:
        return optim_state_dict
    names = param_names(model)
    params = _optim_params(optim, model, optim_input)
    id_to_name = {index: _name_of(names, p) for index, p in enumerate(params)}
    name_to_id = {n: index for index, p in enumerate(params) for n in names.get(p, [])}
    rename = id_to_name if want_names else name_to_id
    groups = copy.deepcopy(optim_state_dict["param_groups"])
    for group in groups:
        group["params"] = sorted(rename[k] for k in group["params"])
    return {
        "state": {rename[k]: v for k, v in optim_state_dict["state"].items()},
        "param_groups": groups,
    }
