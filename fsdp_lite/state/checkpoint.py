"""Safe checkpoints of a model and its optimizer: sharded, reshardable, never half-written.

``save`` writes the SHARDED_STATE_DICT of the model and the name-keyed optimizer state with
``torch.distributed.checkpoint`` (each rank writes its own shards, nothing is gathered) as a new
generation of files in ``path``, beside anything else there, and names it in the manifest only
when every rank has finished. ``load`` checks the checkpoint against the model, on every rank,
before any of DCP's collectives, and checks each item it reads against the manifest's checksums.
The layout is ``{"model": ..., "optim": ...}`` as torch's DCP recipes use, so native FSDP2
checkpoints load here and the reverse. Guarantees and their tests: docs/checkpoints.md.

Note [Replacing a checkpoint safely]: the manifest names a whole generation, or the previous one.
  1. rank 0 takes the save lock (another job saving there: every rank raises, nothing changed),
     refuses a regular file or a checkpoint fsdp_lite did not write, picks the next generation
     and writes it into the lock file; every rank reads that back (the directory is shared);
  2. every rank writes its data files, named after the generation (checkpoint_files.py, Note [The
     files of a checkpoint]); dcp.save returns on every rank after rank 0 wrote the metadata;
  3. every rank checksums its share of the files, and rank 0 gets them all;
  4. rank 0 writes the manifest beside, syncs it and renames it into place (the commit), then
     replaces ``.metadata`` the same way (for torch's readers), syncs the directory, and deletes
     the files of older generations unless a load holds the readers' lock (the next save does).
Each step ends with every rank knowing how it went on every rank (a broadcast or an all-gather),
so a failure raises the same CheckpointError on every rank at once. Killed before 4's rename, a
save leaves the previous generation named everywhere; after it, the new one for fsdp_lite, and
torch's ``.metadata`` still names files that exist until 4 ends.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import resource
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fsdp_lite.api import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
from fsdp_lite.engine.collectives import all_gather_objects
from fsdp_lite.state import checkpoint_files as files
from fsdp_lite.state import optim_state
from fsdp_lite.state.checkpoint_files import CheckpointError, Manifest
from fsdp_lite.state.state_dict import state_dict_type, wrappers_in

__all__ = ["CheckpointError", "load", "save"]

log = logging.getLogger("fsdp_lite")


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


def _is_rank0(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_rank(group) == 0


# One optimizer, or several over disjoint parameters (Muon for the matrices, AdamW for the rest).
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _optimizers(optim: Optimizers) -> list[torch.optim.Optimizer]:
    if optim is None:
        return []
    return [optim] if isinstance(optim, torch.optim.Optimizer) else list(optim)


def checkpoint_state(model: nn.Module, optim: Optimizers) -> dict[str, Any]:
    """``{"model": sharded model state dict, "optim": name-keyed sharded optimizer state}``.

    The tensors are the live shards (no copies), which is what dcp.load fills in place.
    A model without wrappers gives plain tensors, so one process can load a sharded save.
    Several optimizers share one ``"optim"``: their states by name side by side, their groups
    one after another (as ``torch.distributed.checkpoint.state_dict`` merges a list of them).
    """
    config = ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=True)
    optim_config = ShardedOptimStateDictConfig(offload_to_cpu=False, _use_dtensor=True)
    # The FSDP1 front's wrappers choose their state dict by settings; the FSDP2 front's always
    # give their DTensor shards, as torch's fully_shard does.
    fsdp1 = [w for w in wrappers_in(model) if hasattr(w, "_state_dict_settings")]
    context = (
        state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config, optim_config)
        if fsdp1
        else contextlib.nullcontext()
    )
    with context:
        state: dict[str, Any] = {"model": model.state_dict()}
    optims = _optimizers(optim)
    if optims:
        named = [optim_state.named_optim_state_dict(model, o, full=False) for o in optims]
        state["optim"] = {
            "state": {name: entry for one in named for name, entry in one["state"].items()},
            "param_groups": [group for one in named for group in one["param_groups"]],
        }
    return state


def save(model: nn.Module, optim: Optimizers, path: str | os.PathLike) -> None:
    """Save ``model`` (and ``optim``) into the directory ``path``, replacing only a previous
    fsdp_lite checkpoint there, and only once the new one is complete.

    Every rank calls it. Files already in ``path`` that are not fsdp_lite's stay. See Note
    [Replacing a checkpoint safely].

    Args:
        model: the root module (wrapped or not).
        optim: its optimizer, a list of optimizers over disjoint parameters (``fsdp_lite.Muon``
            for the matrices and AdamW for the rest), or None to save the model alone.
        path: a directory (made if missing) on a filesystem every rank shares.

    Raises:
        CheckpointError: on every rank alike: ``path`` is a regular file, or holds a checkpoint
            fsdp_lite did not write; another job is saving there; a rank does not see the
            directory; or writing failed (the message names the path, the bytes free and the
            file size limit, and begins with "no space left" when the disk is full). The previous
            checkpoint is then as it was.
    """
    path = Path(path)
    group = _group(model)
    state = checkpoint_state(model, optim)
    claimed: dict[str, Any] = {}  # rank 0: the lock's descriptor, the generation, the commit

    def claim() -> tuple[int, str]:
        claimed["lock"], claimed["generation"], note, claimed["previous"] = _claim(path)
        return claimed["generation"], note

    def commit() -> None:
        metadata = _describe_metadata(path, generation)
        dcp_metadata = _describe_dcp_metadata(path, metadata, claimed["previous"])
        manifest = Manifest(generation, metadata, described, dcp_metadata)
        files.write_atomically(path / files.MANIFEST, manifest.dumps(), generation, "manifest")
        claimed["committed"] = True  # from here on the new generation is the checkpoint
        _after_commit(path, generation, manifest)

    try:
        generation, note = _on_rank0(group, claim, f"could not prepare {path}")
        sees = _read_note(path) == note
        _agree(
            group,
            None
            if sees
            else f"saving checkpoint {path}: {path / files.SAVE_LOCK} is not as rank 0 wrote it: "
            "the checkpoint directory must be on a filesystem every rank shares",
        )
        try:
            with _single_process_is_intended(group):
                metadata = dcp.save(
                    state,
                    storage_writer=files.GenerationWriter(path, generation),
                    process_group=group,
                    no_dist=group is None,
                )
        # DCP gathers every rank's failure into a CheckpointException, a BaseException
        except (Exception, CheckpointException) as e:
            raise _save_failed(e, path, state, group) from e
        described = _describe_my_share(path, metadata, group)
        _on_rank0(group, commit, f"could not write the manifest of {path}")
    finally:
        if "lock" in claimed:  # rank 0
            if not claimed.get("committed"):
                _discard(path, claimed["generation"])
            files.unlock(claimed["lock"])


def _claim(path: Path) -> tuple[int, int, str, Manifest | None]:
    """Rank 0: (the save lock's descriptor, the next generation, the note in the lock file, the
    manifest there: None if there is none, empty if it is damaged)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"checkpoint path {path} is a file, not a directory; save writes a directory of "
            "files and does not replace other files: save to another path"
        )
    path.mkdir(parents=True, exist_ok=True)
    if not (path / files.MANIFEST).exists() and (path / files.DCP_METADATA).exists():
        raise CheckpointError(  # checked before the lock file is made: nothing is written there
            f"{path} holds a DCP checkpoint that fsdp_lite did not write (it has no "
            f"{files.MANIFEST}); save replaces only its own checkpoints: save to another "
            "path, or remove that checkpoint first"
        )
    lock = files.try_lock(path / files.SAVE_LOCK, exclusive=True, create=True)
    if lock is None:
        held = _read_note(path) or "its note is not written yet"
        raise CheckpointError(
            f"checkpoint {path} is being saved by another job ({held}): two jobs cannot save to "
            "one path at once; this save changed nothing"
        )
    try:
        try:
            manifest = files.read_manifest(path)
        except CheckpointError:  # a damaged manifest of ours: this save replaces it
            manifest = Manifest(0, {}, {})
        found = [int(m["generation"]) for m in map(files.OURS.match, os.listdir(path)) if m]
        generation = max([0, *found, manifest.generation if manifest else 0]) + 1
        note = files.lock_note(generation)
        os.ftruncate(lock, 0)
        os.pwrite(lock, note.encode(), 0)  # for messages only: not synced
        # Loads lock this one; they open it read-only, so it is made here.
        files.unlock(files.try_lock(path / files.READERS_LOCK, exclusive=False, create=True))
    except BaseException:
        files.unlock(lock)
        raise
    return lock, generation, note, manifest


def _read_note(path: Path) -> str:
    try:
        return (path / files.SAVE_LOCK).read_text()
    except OSError:
        return ""


def _describe_my_share(
    path: Path, metadata: Metadata, group: dist.ProcessGroup | None
) -> dict[str, dict[str, Any]]:
    """Every data file's manifest entry, each rank reading back its share of the files."""
    names = sorted({info.relative_path for info in metadata.storage_data.values()})
    rank, world_size = (
        (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    )
    error, mine = None, {}
    try:
        mine = files.describe_files(path, metadata, names[rank::world_size])
    except OSError as e:
        error = f"could not read back its data files: {e}"
    shares = _agree(group, error, mine)
    return {name: entry for share in shares for name, entry in share.items()}


def _describe_metadata(path: Path, generation: int) -> dict[str, Any]:
    name = f"{files.generation_prefix(generation)}.metadata"
    return {
        "name": name,
        "size": (path / name).stat().st_size,
        "crc32": files.crc32_of(path / name),
    }


def _describe_dcp_metadata(
    path: Path, metadata: dict[str, Any], previous: Manifest | None
) -> dict[str, Any]:
    """The manifest's entry for ``.metadata`` (Note [The manifest] in checkpoint_files.py): the
    copy of this generation's ``metadata`` that _after_commit writes, and what ``.metadata``
    holds now, which stays if this save stops before the copy, when the previous manifest
    covered it."""
    entry = {"name": files.DCP_METADATA, "size": metadata["size"], "crc32": metadata["crc32"]}
    try:
        held = files.size_and_crc32(path / files.DCP_METADATA)
    except FileNotFoundError:  # a first save: nothing to leave behind
        held = None
    covered = (
        previous is not None and bool(previous.metadata) and held in previous.dcp_metadata_states()
    )
    same = held == (metadata["size"], metadata["crc32"])
    entry["previous"] = (
        {"size": held[0], "crc32": held[1]} if held is not None and covered and not same else None
    )
    return entry


def _after_commit(path: Path, generation: int, manifest: Manifest) -> None:
    """Rank 0, once the manifest names the new generation: torch's ``.metadata`` too, one sync
    of the directory for both renames, then the older files go. Past the manifest's rename the
    checkpoint is saved, so a failure to update ``.metadata`` is logged, not raised."""
    try:
        metadata = (path / manifest.metadata["name"]).read_bytes()
        files.write_atomically(path / files.DCP_METADATA, metadata, generation, "dcp")
        updated = True
    except OSError:
        # torch's readers still see the previous generation, whose files then stay
        log.warning(
            "checkpoint %s is saved, but its .metadata is the previous one", path, exc_info=True
        )
        updated = False
    files.fsync_dir(path)  # the renames are durable before any file they replaced is deleted
    if updated:
        try:
            _delete_older(path, manifest.names())
        except OSError:
            log.warning("checkpoint %s is saved; deleting older files failed", path, exc_info=True)


def _delete_older(path: Path, keep: set[str]) -> None:
    """Files of older generations (and of saves that died), unless a load is reading them."""
    readers = files.try_lock(path / files.READERS_LOCK, exclusive=True, create=False)
    if readers is None:
        log.info("a load is reading %s: its previous files go with the next save", path)
        return
    try:
        for name in os.listdir(path):
            if files.OURS.match(name) and name not in keep:
                os.unlink(path / name)
    finally:
        files.unlock(readers)


def _discard(path: Path, generation: int) -> None:
    """Rank 0, after a failed save: the files this generation wrote (every rank is done)."""
    prefix = files.generation_prefix(generation)
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if files.OURS.match(name) and name.startswith(prefix):
                os.unlink(path / name)


def _save_failed(
    e: BaseException, path: Path, state: dict, group: dist.ProcessGroup | None
) -> CheckpointError:
    """DCP's failure, with what a full disk or a file size limit would show: torch's own error
    is then its zip writer's ("unexpected pos 704 vs 598"), naming neither.

    A full disk leads the message ("no space left ..."), since torch's words come first
    otherwise. It is known by ENOSPC or EDQUOT in the chain, or, because the zip writer's
    RuntimeError carries no errno and DCP's gather of other ranks' errors drops their causes,
    by fewer bytes free on ``path``'s filesystem than this rank writes, measured right after the
    failure, before the partial generation is removed."""
    error = _from_dcp(e, f"saving checkpoint {path}", group)
    needed = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in _tensors(state))
    try:
        free: int | None = shutil.disk_usage(path).free
    except OSError:
        free = None
    errnos = {getattr(x, "errno", None) for x in _chain(e)}
    full = bool(errnos & {errno.ENOSPC, errno.EDQUOT}) or (free is not None and free < needed)
    free_text = "an unknown number of" if free is None else str(free)
    if full:
        head = (
            f"no space left on the device of checkpoint {path}: this rank writes about {needed} "
            f"bytes there and {free_text} bytes are free; "
        )
        facts = ""
    else:
        head = ""
        facts = f"; {path} has {free_text} bytes free and this rank writes about {needed}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        facts += f"; this process may write files of at most {limit} bytes (ulimit -f)"
    if errno.EFBIG in errnos:
        facts += "; the disk is full or a file is too large"
    return CheckpointError(f"{head}{error}{facts}; the previous checkpoint there is unchanged")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e``, the exceptions DCP gathered in it, and their causes."""
    todo = [e] + (
        [error for error, _ in e.failures.values()] if isinstance(e, CheckpointException) else []
    )
    seen: set[int] = set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        todo += [error.__cause__, error.__context__]


def _on_rank0(group: dist.ProcessGroup | None, step: Callable[[], Any], what: str) -> Any:
    """Run ``step`` on rank 0 and give every rank its result, or raise its failure on every
    rank, at once and with one message (fsdp_lite's own in its words).

    The other ranks wait in the broadcast of the outcome rather than in a barrier, so a failed
    step does not leave them blocked until the process group's timeout.
    """
    outcome, cause = [None, None], None
    if _is_rank0(group):
        try:
            outcome[1] = step()
        except CheckpointError as e:
            outcome[0], cause = str(e), e
        except Exception as e:  # noqa: BLE001 - every rank re-raises it below
            outcome[0], cause = f"saving checkpoint: rank 0 {what}: {type(e).__name__}: {e}", e
    if group is not None:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0]) from cause
    return outcome[1]


def _agree(group: dist.ProcessGroup | None, error: str | None, value: Any = None) -> list[Any]:
    """Every rank's ``value``, or, if any rank has an ``error``, that error raised on every rank:
    one small collective before any of DCP's, so that no rank enters DCP for a rank that failed."""
    if group is None:
        if error is not None:
            raise CheckpointError(error)
        return [value]
    seen = all_gather_objects((error, value), group=group)
    failed = [(dist.get_global_rank(group, r), e) for r, (e, _) in enumerate(seen) if e]
    if failed:
        ranks = [r for r, _ in failed]
        where = "" if len(failed) == len(seen) else f" (on rank {', '.join(map(str, ranks))} only)"
        raise CheckpointError(f"{failed[0][1]}{where}")
    return [v for _, v in seen]


def load(
    model: nn.Module,
    optim: Optimizers,
    path: str | os.PathLike,
    strict: bool = True,
    allow_code_execution: bool = False,
) -> None:
    """Load a checkpoint written by ``save`` (or a DCP ``{"model", "optim"}`` checkpoint).

    The world size may differ from the save's; a model without wrappers loads it in one process.
    Nothing in the files runs: see Note [What a checkpoint may run] in checkpoint_files.py. Every
    rank checks what it reads against the manifest's checksums (a checkpoint without a manifest,
    as torch writes, is read unchecked).

    Args:
        model: the root module, built as when saving (wrapped or not, any world size).
        optim: its optimizer, or the list saved (state is created if it has none yet; Muon's
            momentum too), or None for the model alone.
        path: the checkpoint directory.
        strict: also fail on model keys that the checkpoint has and the model lacks.
        allow_code_execution: read the metadata and non-tensor items with plain pickle, as
            torch's ``dcp.load`` does: a crafted checkpoint then runs its code in this process.
            Default False: only for trusted files that hold other Python objects.

    Raises:
        CheckpointError: on every rank alike, before any rank reads a tensor: the checkpoint is
            missing (on any rank), incomplete (no metadata, a missing or short data file), refers
            to code (naming the file and the global), is damaged (its manifest's checksums,
            torch's ``.metadata`` included), or does not match the model (naming the keys).
            While reading: an item whose bytes do not match the manifest, naming the file and the
            byte range.
    """
    path = Path(path)
    group = _group(model)
    for o in _optimizers(optim):
        _init_optim_state(o)
    state = checkpoint_state(model, optim)
    # Held while reading, so that a save finishing meanwhile keeps the files this load reads.
    readers = files.wait_for_shared_lock(path / files.READERS_LOCK) if path.is_dir() else None
    try:
        error, found = None, None
        try:
            found = _open(path, state, strict, allow_code_execution)
        except CheckpointError as e:
            error = str(e)
        generations = _agree(group, error, found[1].generation if found and found[1] else None)
        if len(set(generations)) > 1:
            raise CheckpointError(
                f"checkpoint {path} changed while it was being loaded (the ranks read "
                f"generations {sorted(set(generations), key=str)}: a save to it finished "
                "meanwhile); load again"
            )
        metadata, manifest = found
        try:
            with _single_process_is_intended(group):
                dcp.load(
                    state,
                    storage_reader=files.SafeReader(path, metadata, manifest),
                    planner=files.SafeLoadPlanner(path, allow_code_execution),
                    process_group=group,
                    no_dist=group is None,
                )
        # DCP gathers every rank's failure into a CheckpointException, a BaseException
        except (Exception, CheckpointException) as e:
            raise _from_dcp(e, f"loading checkpoint {path}", group) from e
    finally:
        files.unlock(readers)
    # dcp.load wrote into the live shards already; loading again goes through the checks and
    # puts each tensor where the model and optimizer keep it.
    model.load_state_dict(state["model"], strict=strict)
    for o in _optimizers(optim):  # each takes the names of its own parameters and groups
        o.load_state_dict(optim_state.named_to_loadable(model, o, state["optim"]))


def _open(
    path: Path, state: dict, strict: bool, allow_code_execution: bool
) -> tuple[Metadata, Manifest | None]:
    """This rank's checks before reading: the metadata (safely unpickled, checksummed when
    there is a manifest), every data file, and the keys against the model."""
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    manifest = files.read_manifest(path)
    data = None  # read by read_metadata
    if manifest is None:  # a DCP checkpoint fsdp_lite did not write, or from before manifests
        metadata_file = path / files.DCP_METADATA
        if not metadata_file.exists() and (path / files.SAVE_LOCK).exists():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: it has neither {files.MANIFEST} nor "
                f"{files.DCP_METADATA} (its first save has not finished, or they were removed)"
            )
        if not metadata_file.exists():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: it has no {files.DCP_METADATA} file, which "
                "DCP writes last (the save did not finish, or the file was removed)"
            )
    else:
        _check_dcp_metadata(path, manifest)
        metadata_file = path / manifest.metadata["name"]
        if not files.inside(path, manifest.metadata["name"]) or not metadata_file.exists():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: its metadata file {manifest.metadata['name']} "
                "is missing"
            )
        data = metadata_file.read_bytes()  # checked, then unpickled: the same bytes
        if zlib.crc32(data) != manifest.metadata["crc32"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: its metadata file {manifest.metadata['name']} "
                "does not match the checksum its manifest recorded; restore it, or save again"
            )
    try:
        metadata = files.read_metadata(metadata_file, allow_code_execution, data)
    except (EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {path} has an unreadable {metadata_file.name}: {e}"
        ) from e
    _check_files(path, metadata, manifest)
    _check_keys(path, state, metadata, strict)
    return metadata, manifest


def _check_dcp_metadata(path: Path, manifest: Manifest) -> None:
    """``.metadata``, which fsdp_lite does not read and torch's ``dcp.load`` unpickles, holds
    what the save wrote or left there (Note [The manifest] in checkpoint_files.py)."""
    try:
        held = files.size_and_crc32(path / files.DCP_METADATA)
    except FileNotFoundError:
        return  # a first save stopped between its commit and the copy: nothing to unpickle
    if held not in manifest.dcp_metadata_states():
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its {files.DCP_METADATA}, which torch's dcp.load "
            f"unpickles (fsdp_lite reads {manifest.metadata['name']}), does not match the "
            "checksum its manifest recorded: it changed after the save; replace it with a copy "
            f"of {manifest.metadata['name']}, or save again"
        )


def _from_dcp(e: BaseException, doing: str, group: dist.ProcessGroup | None) -> CheckpointError:
    """One error for every rank from DCP's failure: fsdp_lite's own check in its words (with the
    rank that found it), else each failing rank's error in one line."""
    if isinstance(e, CheckpointException):
        failures = {rank: error for rank, (error, _) in sorted(e.failures.items())}
    else:
        failures = {dist.get_rank(group) if group is not None else 0: e}
    if group is not None:  # DCP numbers the ranks of the group
        failures = {dist.get_global_rank(group, rank): error for rank, error in failures.items()}
    everyone = group is None or len(failures) == dist.get_world_size(group)
    where = "" if everyone else f" (on rank {', '.join(map(str, failures))} only)"
    for error in failures.values():
        if isinstance(error, CheckpointError):
            return CheckpointError(f"{error}{where}")
    lines = "; ".join(
        f"rank {rank}: {type(error).__name__}: {(str(error).strip() or '?').splitlines()[0]}"
        for rank, error in failures.items()
    )
    return CheckpointError(f"{doing} failed: {lines}")


def _check_files(path: Path, metadata: Metadata, manifest: Manifest | None) -> None:
    """Every data file the metadata points to is inside ``path``, exists, and is as long as the
    metadata needs (and as the manifest recorded)."""
    needs: dict[str, int] = {}
    holds: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
        holds.setdefault(info.relative_path, set()).add(index.fqn)
    problems = []
    for name, size in sorted(needs.items()):
        file = path / name
        if not files.inside(path, name):
            raise CheckpointError(
                f"checkpoint {path} names a data file outside its directory: {name!r}"
            )
        if manifest is not None:
            size = manifest.files.get(name, {}).get("size", size)
        if not file.exists():
            problem = "is missing"
        elif file.stat().st_size < size:
            problem = f"is truncated ({file.stat().st_size} of {size} bytes)"
        elif manifest is not None and file.stat().st_size != size:
            problem = f"has {file.stat().st_size} bytes, {size} when saved"
        else:
            continue
        problems.append(f"data file {name} {problem}; it holds {_some(sorted(holds[name]))}")
    if problems:
        raise CheckpointError(f"checkpoint {path} is incomplete: " + "; ".join(problems))


def _check_keys(path: Path, state: dict, metadata: Metadata, strict: bool) -> None:
    """The checkpoint has every tensor the model and optimizer need, in the same global shape
    (a parameter whose optimizer state the checkpoint lacks entirely is left out of ``state``)."""
    # DCP's own flattening, so the names are the ones its metadata uses ("model.fc1.weight").
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = metadata.state_dict_metadata
    # A parameter the saved optimizer held no state for (it never had a gradient: an unused
    # parameter) has none of its keys in the checkpoint: it loads stateless, as it was saved.
    optim_state_by_name = state.get("optim", {}).get("state", {})
    for name in list(optim_state_by_name):
        keys = [f"optim.state.{name}.{key}" for key in optim_state_by_name[name]]
        if keys and not any(key in saved for key in keys):
            del optim_state_by_name[name]
    flat, _ = flatten_state_dict(state)
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
