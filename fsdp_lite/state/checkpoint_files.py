"""Reading a checkpoint's files without running what they hold.

checkpoint.py saves and loads through torch.distributed.checkpoint (DCP); this file gives DCP the
reader and the load planner it uses, so that loading a checkpoint cannot run code from it (Note
[What a checkpoint may run]). It only reads; checkpoint.py decides what to read and when.

Note [What a checkpoint may run]: DCP's reader unpickles ``.metadata`` with ``pickle.load`` and
its default load planner reads every non-tensor item (an optimizer's ``param_groups`` entries)
with ``torch.load(weights_only=False)``: an object whose ``__reduce__`` names ``os.system`` runs
it during the load. Here the metadata goes through an unpickler that admits only the classes DCP
writes into it (``METADATA_GLOBALS``) and plain containers, and non-tensor items through
``torch.load(weights_only=True)``, as DCP's reader already reads tensors. A refused global raises
``CheckpointError`` naming the file and the global before anything is called. ``load(...,
allow_code_execution=True)`` reads with plain pickle instead, for trusted files that hold other
objects.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["CheckpointError", "SafeLoadPlanner", "SafeReader", "read_metadata"]


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, unsafe to read, or that does not match the model
    it is loaded into; or a save that could not finish."""


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Everything DCP pickles into .metadata (torch 2.4 to 2.13), by module. Each is a dataclass, an
# enum or a value: calling one with any arguments builds data and runs nothing else.
METADATA_GLOBALS: dict[str, set[str]] = {
    _DCP_METADATA: {
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


def read_metadata(file: Path, allow_code_execution: bool = False) -> Metadata:
    """The ``Metadata`` pickled in ``file``, unpickled safely (Note [What a checkpoint may run])."""
    with open(file, "rb") as f:
        if allow_code_execution:
            metadata = pickle.load(f)
        else:
            metadata = _SafeUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint file {file} holds a {type(metadata).__name__}, not DCP's Metadata"
        )
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, given the metadata already read and checked (so it is read once)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


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
