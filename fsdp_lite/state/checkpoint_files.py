"""The files of a checkpoint: which are fsdp_lite's, their checksums, their locks, and reading
them without running what they hold.

checkpoint.py saves and loads through torch.distributed.checkpoint (DCP); this file gives DCP the
writer, reader and load planner it uses, and owns the names in a checkpoint directory (Note [The
files of a checkpoint]), the manifest (Note [The manifest]) and the two lock files. It decides
nothing about when to write or read: checkpoint.py does (Note [Replacing a checkpoint safely]).

Note [What a checkpoint may run]: DCP's reader unpickles ``.metadata`` with ``pickle.load`` and
its default load planner reads every non-tensor item (an optimizer's ``param_groups`` entries)
with ``torch.load(weights_only=False)``: an object whose ``__reduce__`` names ``os.system`` runs
it during the load. Here the metadata goes through an unpickler that admits only the classes DCP
writes into it (``METADATA_GLOBALS``) and plain containers, and non-tensor items through
``torch.load(weights_only=True)``, as DCP's reader already reads tensors. A refused global raises
``CheckpointError`` naming the file and the global before anything is called. ``load(...,
allow_code_execution=True)`` reads with plain pickle instead, for trusted files that hold other
objects.

Note [The files of a checkpoint]: a save writes into the directory, beside whatever else is there,
only names it owns:
  fsdp_lite-<generation>__<rank>_<n>.distcp   DCP's data files of one save (a generation: 1, 2 ...)
  fsdp_lite-<generation>.metadata             DCP's metadata of that save
  fsdp_lite_manifest.json                     which generation is the checkpoint, with checksums
  .metadata                                   a copy of the current generation's, for torch's readers
  .fsdp_lite.lock, .fsdp_lite.readers         held by a save (exclusive) and by loads (shared)
and deletes only names of the first two kinds that the new manifest does not list. Names of a new
generation never collide with the current one, so the previous checkpoint stays whole until the
manifest names the new one.

Note [The manifest]: written last, it lists each data file's size and the crc32 of every item
(tensor shard or value) DCP wrote into it, at its offset, and the metadata file's size and crc32;
its own crc32 covers the rest. Every rank checks the metadata before unpickling it and each item
it reads before using it, so a flipped byte is named by file and byte range. It also covers
``.metadata`` (``dcp_metadata``), which fsdp_lite never reads but torch's ``dcp.load`` unpickles:
a ``.metadata`` changed after the save fails fsdp_lite's load too, rather than loading through
fsdp_lite and running its pickle the first time torch reads the same directory. Two contents are
the save's: the copy of this generation's metadata, and what ``.metadata`` held when the manifest
was committed (``previous``), since the copy replaces it just after the commit (Note [Replacing a
checkpoint safely]) and a save killed or failing in between leaves that one; ``previous`` is
recorded only when the previous manifest covered it, so a ``.metadata`` changed before a save is
not blessed by it. No ``.metadata`` at all is the state a first save killed in between leaves.
crc32 finds accidental damage, not a forger, who can rewrite the manifest too (what a crafted file
may do is bounded by Note [What a checkpoint may run]).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import io
import json
import os
import pickle
import re
import socket
import zlib
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan
from torch.distributed.checkpoint.storage import WriteResult

__all__ = [
    "CheckpointError",
    "GenerationWriter",
    "Manifest",
    "SafeLoadPlanner",
    "SafeReader",
    "read_metadata",
]

MANIFEST = "fsdp_lite_manifest.json"
DCP_METADATA = ".metadata"  # DCP's name, read by torch's dcp.load
SAVE_LOCK = ".fsdp_lite.lock"
READERS_LOCK = ".fsdp_lite.readers"
# A generation's files (and the temporary files of a save); nothing else is ever deleted.
OURS = re.compile(r"^fsdp_lite-(?P<generation>\d{6,})(__\d+_\d+\.distcp|\.metadata|\.\w+\.tmp)$")
_CHUNK = 1 << 20  # bytes read at a time for a checksum


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, unsafe to read, or that does not match the model
    it is loaded into; or a save that could not finish."""


_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Everything DCP pickles into .metadata (torch 2.4 to 2.13), by module. Each is a dataclass, an
# enum or a value: calling one with any arguments builds data and runs nothing else.
METADATA_GLOBALS: dict[str, set[str]] = {
    _DCP_METADATA_MODULE: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    # where torch before 2.4 defined TensorProperties
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name: torch.strided
    "torch": {"Size"},  # and every dtype, see _SafeUnpickler.find_class
    "pathlib": {"PosixPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``METADATA_GLOBALS`` and torch's dtypes."""

    def __init__(self, file: Any, name: Path) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(_refused(f"checkpoint file {self.name}", f"{module}.{name}"))


def _refused(where: str, what: str) -> str:
    return (
        f"{where} refers to {what}, which fsdp_lite does not load: it reads only DCP's metadata "
        "classes, tensors and plain values (unpickling anything else can run code); pass "
        "allow_code_execution=True only for a checkpoint you trust"
    )


def read_metadata(
    file: Path, allow_code_execution: bool = False, data: bytes | None = None
) -> Metadata:
    """The ``Metadata`` pickled in ``file`` (whose bytes are ``data``, if already read),
    unpickled safely (Note [What a checkpoint may run])."""
    f = io.BytesIO(file.read_bytes() if data is None else data)
    metadata = pickle.load(f) if allow_code_execution else _SafeUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint file {file} holds a {type(metadata).__name__}, not DCP's Metadata"
        )
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, given the metadata already read and checked (so it is read once), and
    checking each item it reads against the manifest's crc32 (None: a checkpoint without one)."""

    def __init__(self, path: Path, metadata: Metadata, manifest: Manifest | None) -> None:
        super().__init__(path)
        self.metadata = metadata
        self.manifest = manifest
        self.crcs = manifest.item_crcs() if manifest is not None else {}
        self.holds = {  # (file, offset) -> the key stored there, for messages
            (info.relative_path, info.offset): index.fqn
            for index, info in metadata.storage_data.items()
        }

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    # torch's hook for one item's bytes (read_data calls it per item); should a torch release drop
    # it, test_checkpoint_safety's flipped bytes would load, and fail that test.
    def _slice_file(self, file: IO[bytes], sinfo: Any) -> IO[bytes]:
        if self.manifest is None:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        expected = self.crcs.get((sinfo.relative_path, sinfo.offset, sinfo.length))
        if expected is None or zlib.crc32(data) != expected:
            key = self.holds.get((sinfo.relative_path, sinfo.offset), "?")
            end = sinfo.offset + sinfo.length
            raise CheckpointError(
                f"checkpoint {self.path} is corrupt: data file {sinfo.relative_path} bytes "
                f"[{sinfo.offset}, {end}) ({key}) do not match the checksum its manifest "
                "recorded; restore the file from a copy, or save again"
            )
        return io.BytesIO(data)


class GenerationWriter(FileSystemWriter):
    """DCP's file writer, naming its files after one generation (Note [The files of a
    checkpoint]) and writing the metadata under that generation's name, not as ``.metadata``."""

    def __init__(self, path: Path, generation: int) -> None:
        super().__init__(path)
        self.generation = generation
        self.prefix = generation_prefix(generation)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # save() prepared the directory; DCP's would warn about replacing .metadata

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(
                plan,
                storage_data=dataclasses.replace(
                    plan.storage_data, prefix=f"{self.prefix}{plan.storage_data.prefix}"
                ),
            )
            for plan in super().prepare_global_plan(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # What DCP's finish records, written under this generation's name.
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        if hasattr(dcp_filesystem, "CURRENT_DCP_VERSION"):
            metadata.version = dcp_filesystem.CURRENT_DCP_VERSION
        file = Path(self.path) / f"{self.prefix}.metadata"
        write_atomically(file, pickle.dumps(metadata), self.generation, "metadata")


def generation_prefix(generation: int) -> str:
    return f"fsdp_lite-{generation:06d}"


def write_atomically(file: Path, data: bytes, generation: int, kind: str) -> None:
    """``file`` holds ``data`` whole or is as it was: written to a temporary name of this
    generation's (``kind`` tells them apart), synced, then renamed over ``file``."""
    tmp = file.with_name(f"{generation_prefix(generation)}.{kind}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def fsync_dir(directory: Path) -> None:
    """Make renames durable: they live in the directory's entries."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the manifest (Note [The manifest]) ----------------------------------------------------------


@dataclasses.dataclass
class Manifest:
    """One save's files as written: what ``load`` checks before and while it reads them."""

    generation: int
    metadata: dict[str, Any]  # {"name": ..., "size": bytes, "crc32": ...}
    files: dict[str, dict[str, Any]]  # name -> {"size": bytes, "items": [[offset, length, crc32]]}
    # {"name": ".metadata", "size", "crc32", "previous": {"size", "crc32"} or None}; None in a
    # manifest from before it was recorded (Note [The manifest])
    dcp_metadata: dict[str, Any] | None = None

    def item_crcs(self) -> dict[tuple[str, int, int], int]:
        """(file, offset, length) -> crc32 of every item."""
        return {
            (name, offset, length): crc
            for name, entry in self.files.items()
            for offset, length, crc in entry["items"]
        }

    def names(self) -> set[str]:
        return {self.metadata["name"], *self.files}

    def dcp_metadata_states(self) -> set[tuple[int, int]]:
        """The (size, crc32) contents of ``.metadata`` that this save wrote or left: the copy
        of its metadata, and what ``.metadata`` held at the commit (Note [The manifest])."""
        entry = self.dcp_metadata
        if entry is None:  # an older manifest: .metadata was the copy of its metadata
            return {(self.metadata["size"], self.metadata["crc32"])}
        states = {(entry["size"], entry["crc32"])}
        if entry.get("previous") is not None:
            states.add((entry["previous"]["size"], entry["previous"]["crc32"]))
        return states

    def dumps(self) -> bytes:
        body: dict[str, Any] = {
            "generation": self.generation,
            "metadata": self.metadata,
            "files": self.files,
        }
        if self.dcp_metadata is not None:
            body["dcp_metadata"] = self.dcp_metadata
        text = json.dumps(body, sort_keys=True)
        return json.dumps(
            {"fsdp_lite_checkpoint": 1, "crc32": zlib.crc32(text.encode()), **body}, indent=1
        ).encode()


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of the checkpoint at ``path``; None if it has none (not fsdp_lite's)."""
    file = path / MANIFEST
    try:
        raw = json.loads(file.read_bytes())
        body = {k: raw[k] for k in ("generation", "metadata", "files")}
        if "dcp_metadata" in raw:  # absent from manifests written before it was recorded
            body["dcp_metadata"] = raw["dcp_metadata"]
        crc = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable {MANIFEST}: {e}") from e
    if crc != raw.get("crc32"):
        raise CheckpointError(
            f"checkpoint {path} has a damaged {MANIFEST}: its checksum does not match its contents"
        )
    return Manifest(**body)


def crc32_of(file: Path) -> int:
    """crc32 of the whole of ``file``."""
    return size_and_crc32(file)[1]


def size_and_crc32(file: Path) -> tuple[int, int]:
    """(size, crc32) of the whole of ``file``, from one open descriptor."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return size, _crc32(f, size)


def _crc32(f: IO[bytes], length: int) -> int:
    """crc32 of the next ``length`` bytes of ``f``, read a chunk at a time."""
    crc = 0
    while length > 0:
        chunk = f.read(min(_CHUNK, length))
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        length -= len(chunk)
    return crc


def describe_files(path: Path, metadata: Metadata, names: list[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries of the data files ``names`` (one rank's share), read back from disk."""
    ranges: dict[str, set[tuple[int, int]]] = {name: set() for name in names}
    for info in metadata.storage_data.values():
        if info.relative_path in ranges:
            ranges[info.relative_path].add((info.offset, info.length))
    described = {}
    for name in names:
        with open(path / name, "rb") as f:
            items = []
            for offset, length in sorted(ranges[name]):  # in file order: reads go forward
                f.seek(offset)
                items.append([offset, length, _crc32(f, length)])
            described[name] = {"size": os.fstat(f.fileno()).st_size, "items": items}
    return described


# ---- locks ---------------------------------------------------------------------------------------


def try_lock(file: Path, exclusive: bool, create: bool) -> int | None:
    """An open descriptor of ``file`` holding its ``flock``, or None if another holds it (or, with
    ``create`` False, the file is missing). flock, not fcntl's record locks: those are per process
    and drop when any descriptor of the file closes."""
    try:
        fd = os.open(file, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def wait_for_shared_lock(file: Path) -> int | None:
    """``file``'s shared flock, waiting while a save holds it exclusively (it deletes the
    previous generation's files: a moment); None if the file is missing."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the flock


def lock_note(generation: int) -> str:
    """What a save writes into its lock file, for the message of a save that finds it held."""
    return f"generation {generation}, saved by {socket.gethostname()} pid {os.getpid()}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``weights_only=True``."""

    def __init__(self, path: Path, allow_code_execution: bool = False) -> None:
        super().__init__()
        self.path = path
        self.allow_code_execution = allow_code_execution

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=not self.allow_code_execution)
        except pickle.UnpicklingError as e:
            # torch names it "GLOBAL posix.system" (blocked, or not an allowed global)
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = found[1].rstrip(".") if found else str(e).splitlines()[0]
            file = self.path / self.metadata.storage_data[read_item.storage_index].relative_path
            item = read_item.dest_index.fqn
            raise CheckpointError(
                _refused(f"item {item} of checkpoint file {file}", what)
            ) from None
        # Where DefaultLoadPlanner.load_bytes puts the item: its place in the nested state dict.
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def inside(directory: Path, name: str) -> bool:
    """``name`` is a plain relative path that stays inside ``directory`` (no ``..``, not absolute)."""
    base = os.path.abspath(directory)
    target = os.path.abspath(os.path.join(base, name))
    return not os.path.isabs(name) and os.path.commonpath([base, target]) == base
