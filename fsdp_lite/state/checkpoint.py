"""Safe checkpoints of a model and its optimizer: sharded, reshardable, never half-written.

``save`` writes the SHARDED_STATE_DICT of the model and the name-keyed optimizer state with
``torch.distributed.checkpoint`` (each rank writes its own shards, nothing is gathered) into a
sibling directory, and only when every rank has finished does rank 0 rename it into place.
``load`` checks the checkpoint against the model before reading it, so a truncated or mismatched
checkpoint fails with the names of the keys at fault. The layout is ``{"model": ..., "optim": ...}``
as torch's DCP recipes use, so native FSDP2 checkpoints load here and the reverse.

Note [Replacing a checkpoint safely]: at ``path`` there is only ever a finished checkpoint.
  1. rank 0 clears ``.<name>.partial`` (left by a save that died) and every rank writes into it;
  2. dcp.save returns on every rank after rank 0 wrote ``.metadata``, which it writes last;
  3. barrier; rank 0 renames ``path`` -> ``.<name>.old``, ``.partial`` -> ``path``, fsyncs the
     directory, deletes ``.old``, and broadcasts how that went: if it failed, every rank raises
     the same CheckpointError at once (no rank is left in a barrier until the timeout).
A save killed in 1-2 leaves ``path`` as it was. Killed inside 3, between the two renames, it
leaves no ``path`` but a complete ``.old``, which ``load`` falls back to. The directory must be
one that every rank sees (a shared filesystem), as for DCP itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_lite.api import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
from fsdp_lite.state import optim_state
from fsdp_lite.state.checkpoint_files import (
    CheckpointError,
    SafeLoadPlanner,
    SafeReader,
    inside,
    read_metadata,
)
from fsdp_lite.state.state_dict import state_dict_type, wrappers_in

__all__ = ["CheckpointError", "load", "save"]

log = logging.getLogger("fsdp_lite")

METADATA = ".metadata"  # DCP's metadata file, written last by the coordinator rank


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.old")


def _group(model: nn.Module) -> dist.ProcessGroup | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    wrappers = wrappers_in(model)
    return wrappers[0]._unit.group if wrappers else dist.group.WORLD


@contextlib.contextmanager
def _single_process_is_intended(group: dist.ProcessGroup | None) -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group; here we mean it."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        yield


def _barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


def _is_rank0(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_rank(group) == 0


def checkpoint_state(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": sharded model state dict, "optim": name-keyed sharded optimizer state}``.

    The tensors are the live shards (no copies), which is what dcp.load fills in place.
    A model without wrappers gives plain tensors, so one process can load a sharded save.
    """
    config = ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=True)
    optim_config = ShardedOptimStateDictConfig(offload_to_cpu=False, _use_dtensor=True)
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config, optim_config):
        state: dict[str, Any] = {"model": model.state_dict()}
    if optim is not None:
        state["optim"] = optim_state.named_optim_state_dict(model, optim, full=False)
    return state


def save(model: nn.Module, optim: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Save ``model`` (and ``optim``) to the directory ``path``, replacing it only when complete.

    Every rank calls it. See Note [Replacing a checkpoint safely].

    Args:
        model: the root module (wrapped or not).
        optim: its optimizer, or None to save the model alone.
        path: a directory; a checkpoint already there stays until the new one is complete.

    Raises:
        CheckpointError: on every rank, with rank 0's message, if rank 0 could not prepare the
            directory or move the finished checkpoint into place.
    """
    path = Path(path)
    partial, old = _siblings(path)
    group = _group(model)
    state = checkpoint_state(model, optim)

    def prepare() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died before its rename
        partial.mkdir(parents=True)

    _on_rank0(group, prepare, f"could not create {partial}")
    with _single_process_is_intended(group):
        dcp.save(
            state,
            storage_writer=FileSystemWriter(partial),
            process_group=group,
            no_dist=group is None,
        )
    _barrier(group)

    def swap_in() -> None:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)  # path is complete, so .old is stale
            path.rename(old)
        partial.rename(path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)

    _on_rank0(
        group,
        swap_in,
        f"could not move the new checkpoint {partial} into place (the previous one is at "
        f"{path}, or at {old}, which load falls back to)",
    )


def _on_rank0(group: dist.ProcessGroup | None, step: Callable[[], None], what: str) -> None:
    """Run ``step`` on rank 0 and raise its failure on every rank, at once and with one message.

    The other ranks wait in the broadcast of the outcome rather than in a barrier, so a failed
    rename does not leave them blocked until the process group's timeout.
    """
    error, cause = None, None
    if _is_rank0(group):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - every rank re-raises it below
            error, cause = f"{type(e).__name__}: {e}", e
    if group is not None:
        outcome = [error]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
        error = outcome[0]
    if error is not None:
        raise CheckpointError(f"saving checkpoint: rank 0 {what}: {error}") from cause


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable: they live in the directory's entries."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    path: str | os.PathLike,
    strict: bool = True,
    allow_code_execution: bool = False,
) -> None:
    """Load a checkpoint written by ``save`` (or a DCP ``{"model", "optim"}`` checkpoint).

    The world size may differ from the save's; a model without wrappers loads it in one process.
    Nothing in the files runs: see Note [What a checkpoint may run] in checkpoint_files.py.

    Args:
        model: the root module, built as when saving (wrapped or not, any world size).
        optim: its optimizer (state is created if it has none yet), or None for the model alone.
        path: the checkpoint directory.
        strict: also fail on model keys that the checkpoint has and the model lacks.
        allow_code_execution: read the metadata and non-tensor items with plain pickle, as
            torch's ``dcp.load`` does: a crafted checkpoint then runs its code in this process.
            Default False: only for trusted files that hold other Python objects.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete (no metadata, a missing or short
            data file), refers to code (naming the file and the global), or does not match the
            model; the message names the keys.
    """
    path = _existing(Path(path))
    group = _group(model)
    if optim is not None:
        _init_optim_state(optim)
    state = checkpoint_state(model, optim)
    metadata = _read_metadata(path, allow_code_execution)
    _check_files(path, metadata)
    _check_keys(path, state, metadata, strict)
    try:
        with _single_process_is_intended(group):
            dcp.load(
                state,
                storage_reader=SafeReader(path, metadata),
                planner=SafeLoadPlanner(path, allow_code_execution),
                process_group=group,
                no_dist=group is None,
            )
    # DCP gathers every rank's failure into a CheckpointException, a BaseException
    except (Exception, CheckpointException) as e:
        raise _from_dcp(e, f"loading checkpoint {path}", group) from e
    # dcp.load wrote into the live shards already; loading again goes through the checks and
    # puts each tensor where the model and optimizer keep it.
    model.load_state_dict(state["model"], strict=strict)
    if optim is not None:
        optim.load_state_dict(optim_state.named_to_loadable(model, optim, state["optim"]))


def _existing(path: Path) -> Path:
    if path.is_dir():
        return path
    partial, old = _siblings(path)
    if old.is_dir() and (old / METADATA).exists():
        log.warning(
            "checkpoint %s is missing; a save died while replacing it: loading %s", path, old
        )
        return old
    hint = f" (a save into it did not finish: {partial} is left over)" if partial.exists() else ""
    raise CheckpointError(f"no checkpoint at {path}{hint}")


def _from_dcp(e: BaseException, doing: str, group: dist.ProcessGroup | None) -> CheckpointError:
    """One error for every rank from DCP's failure: fsdp_lite's own check in its words (with the
    rank that found it), else each failing rank's error in one line."""
    if isinstance(e, CheckpointException):
        failures = {rank: error for rank, (error, _) in sorted(e.failures.items())}
    else:
        failures = {dist.get_rank(group) if group is not None else 0: e}
    everyone = group is None or len(failures) == dist.get_world_size(group)
    for rank, error in failures.items():
        if isinstance(error, CheckpointError):
            return CheckpointError(f"{error}" + ("" if everyone else f" (on rank {rank})"))
    lines = "; ".join(
        f"rank {rank}: {type(error).__name__}: {str(error).strip().splitlines()[0]}"
        for rank, error in failures.items()
    )
    return CheckpointError(f"{doing} failed: {lines}")


def _read_metadata(path: Path, allow_code_execution: bool) -> Metadata:
    metadata_file = path / METADATA
    if not metadata_file.exists():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {METADATA} file, which DCP writes last "
            f"(the save did not finish, or the file was removed)"
        )
    try:
        return read_metadata(metadata_file, allow_code_execution)
    except (EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable {METADATA}: {e}") from e


def _check_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata points to exists and is long enough."""
    needs: dict[str, int] = {}
    holds: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
        holds.setdefault(info.relative_path, set()).add(index.fqn)
    problems = []
    for name, size in sorted(needs.items()):
        file = path / name
        if not inside(path, name):
            raise CheckpointError(
                f"checkpoint {path} names a data file outside its directory: {name!r}"
            )
        if not file.exists():
            problem = "is missing"
        elif file.stat().st_size < size:
            problem = f"is truncated ({file.stat().st_size} of {size} bytes)"
        else:
            continue
        problems.append(f"data file {name} {problem}; it holds {_some(sorted(holds[name]))}")
    if problems:
        raise CheckpointError(f"checkpoint {path} is incomplete: " + "; ".join(problems))


def _check_keys(path: Path, state: dict, metadata: Metadata, strict: bool) -> None:
    """The checkpoint has every tensor the model and optimizer need, in the same global shape."""
    # DCP's own flattening, so the names are the ones its metadata uses ("model.fc1.weight").
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    shapes = []
    for key, value in flat.items():
        info = saved.get(key)
        if torch.is_tensor(value) and isinstance(info, TensorStorageMetadata):
            if tuple(info.size) != tuple(value.shape):
                shapes.append(f"{key} (checkpoint {tuple(info.size)}, model {tuple(value.shape)})")
    unexpected = sorted(k for k in saved if k.startswith("model.") and k not in flat)
    problems = []
    if missing:
        problems.append(f"{len(missing)} key(s) missing from the checkpoint: {_some(missing)}")
    if shapes:
        problems.append(f"{len(shapes)} key(s) with another shape: {_some(shapes)}")
    if unexpected and strict:
        problems.append(f"{len(unexpected)} key(s) the model lacks: {_some(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model: " + "; ".join(problems))


def _some(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give ``optim`` state tensors to load into: one step with zero grads and lr 0.

    dcp.load fills tensors that exist; a fresh Adam has none. lr 0 leaves every parameter as it
    was (the same trick as torch.distributed.checkpoint.state_dict); the loaded state replaces
    the step count it adds.
    """
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]  # put back afterwards: loading must not touch them
    lrs = [group["lr"] for group in optim.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optim.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, lrs):
        group["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
