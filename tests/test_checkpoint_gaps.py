"""Two checkpoint gaps (issue 37 part 5): ``.metadata`` is in the manifest; a full disk says so.

``.metadata`` is a copy of the save's metadata that only torch's readers use; fsdp_lite's load
never read it, so a crafted one loaded without a word through fsdp_lite while torch's ``dcp.load``
of the same directory unpickles it. Now the manifest records it and the load names it.

A full disk during a save: torch's zip writer reports ``[enforce fail at inline_container.cc:672]
. unexpected pos 704 vs 598``, naming no file and no disk; fsdp_lite's error now begins with "no
space left", the path and the bytes. Tested on a real full disk, a 1 MiB tmpfs (needs root to
mount it; skipped otherwise, saying so), and everywhere with DCP's file streams made to fail
their writes with ENOSPC past a few kilobytes, which is what write(2) returns on a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import subprocess
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import checkpoint
from fsdp_lite.checkpoint import CheckpointError
from fsdp_lite.state.checkpoint import checkpoint_state
from fsdp_lite.state.checkpoint_files import MANIFEST, read_manifest
from fsdp_lite.wrap import ModuleWrapPolicy
from tests.parity import build_model
from tests.ranks import run_ranks
from tests.test_checkpoint_safety import Pwned, _same, _values


def _trained(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optim)
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 7)).sum().backward()
    optim.step()


def _changed_metadata_error(path: Path, generation: int) -> str:
    name = f"fsdp_lite-{generation:06d}.metadata"
    return (
        f"checkpoint {path} is corrupt: its .metadata, which torch's dcp.load unpickles "
        f"(fsdp_lite reads {name}), does not match the checksum its manifest recorded: it "
        f"changed after the save; replace it with a copy of {name}, or save again"
    )


# ---- .metadata is in the manifest --------------------------------------------------------------


def test_a_crafted_dot_metadata_fails_fsdp_lite_load_and_torch_would_run_it(tmp_path):
    assert not dist.is_initialized()  # one process: the plain-module load path
    model, optim = _trained(build_model("mlp"))
    path = tmp_path / "ckpt"
    checkpoint.save(model, optim, path)
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(Pwned(marker)))
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(model, optim, path)
    assert str(error.value) == _changed_metadata_error(path, 1)
    assert not marker.exists()
    # Before, the load above returned without an error; torch's reader of the same directory
    # runs the pickle, which is why the manifest covers the file fsdp_lite does not read.
    with contextlib.suppress(BaseException):  # what it unpickled is no Metadata: DCP fails next
        dcp.load(checkpoint_state(model, optim), checkpoint_id=path, no_dist=True)
    assert marker.exists()


def test_every_dot_metadata_a_save_leaves_loads_and_one_changed_before_it_is_not_blessed(tmp_path):
    model, optim = _trained(build_model("mlp"))
    path = tmp_path / "ckpt"
    checkpoint.save(model, optim, path)
    first = (path / ".metadata").read_bytes()
    _step(model, optim)  # other values in generation 2
    saved = _values(model, optim)
    checkpoint.save(model, optim, path)
    entry = read_manifest(path).dcp_metadata
    assert entry["name"] == ".metadata"
    assert entry["previous"] == {"size": len(first), "crc32": zlib.crc32(first)}
    fresh, fresh_optim = _trained(build_model("mlp"))
    # A save stopped between its manifest's rename and the copy leaves the previous .metadata ...
    (path / ".metadata").write_bytes(first)
    checkpoint.load(fresh, fresh_optim, path)
    assert _same(fresh, fresh_optim, saved)
    # ... and a first save stopped there leaves none.
    (path / ".metadata").unlink()
    checkpoint.load(fresh, fresh_optim, path)
    assert _same(fresh, fresh_optim, saved)

    # A .metadata changed before a save is not recorded as its previous one.
    crafted = pickle.dumps(Pwned(tmp_path / "marker"))
    (path / ".metadata").write_bytes(crafted)
    checkpoint.save(model, optim, path)
    assert read_manifest(path).dcp_metadata["previous"] is None
    checkpoint.load(fresh, fresh_optim, path)  # the save replaced it with its copy
    (path / ".metadata").write_bytes(crafted)
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(fresh, fresh_optim, path)
    assert str(error.value) == _changed_metadata_error(path, 3)
    assert not (tmp_path / "marker").exists()


def test_a_manifest_from_before_dcp_metadata_checks_dot_metadata_against_its_metadata(tmp_path):
    model, optim = _trained(build_model("mlp"))
    path = tmp_path / "ckpt"
    checkpoint.save(model, optim, path)
    manifest = read_manifest(path)
    manifest.dcp_metadata = None  # as written before this entry existed
    (path / MANIFEST).write_bytes(manifest.dumps())
    assert "dcp_metadata" not in (path / MANIFEST).read_text()
    checkpoint.load(model, optim, path)
    (path / ".metadata").write_bytes((path / ".metadata").read_bytes() + b"\0")
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(model, optim, path)
    assert str(error.value) == _changed_metadata_error(path, 1)


def _changed_metadata_rank(rank: int, world_size: int, tmp: str) -> str:
    model, optim = _trained(
        FSDP(build_model("mlp"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    )
    path = Path(tmp) / "ckpt"
    checkpoint.save(model, optim, path)
    if rank == 0:
        (path / ".metadata").write_bytes(pickle.dumps(Pwned(Path(tmp) / "marker")))
    dist.barrier()
    try:
        checkpoint.load(model, optim, path)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_crafted_dot_metadata_is_named_on_every_rank(tmp_path):
    errors = run_ranks(_changed_metadata_rank, 2, tmp_path, args=(str(tmp_path),), timeout=120)
    assert errors == [_changed_metadata_error(tmp_path / "ckpt", 1)] * 2
    assert not (tmp_path / "marker").exists()


# ---- a full disk --------------------------------------------------------------------------------

_NO_SPACE = re.compile(
    r"no space left on the device of checkpoint (?P<path>\S+): this rank writes about "
    r"(?P<needed>\d+) bytes there and (?P<free>\d+) bytes are free; saving checkpoint (?P=path) "
    r"failed: rank \d+: .*; the previous checkpoint there is unchanged"
)


class _FullDisk:
    """A file stream whose writes fail with ENOSPC once ``room`` bytes are written, as write(2)
    does on a full disk."""

    def __init__(self, stream, room: list[int]) -> None:
        self.stream, self.room = stream, room

    def write(self, data) -> int:
        if len(data) > self.room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def test_a_write_failing_with_enospc_leads_the_error_with_no_space_left(tmp_path):
    model, optim = _trained(build_model("mlp"))
    path = tmp_path / "ckpt"
    checkpoint.save(model, optim, path)
    saved = _values(model, optim)
    _step(model, optim)
    real = dcp_filesystem.FileSystem.create_stream
    room = [4096]

    @contextlib.contextmanager
    def create_stream(self, file, mode):
        with real(self, file, mode) as stream:
            yield _FullDisk(stream, room) if "w" in mode else stream

    with mock.patch.object(dcp_filesystem.FileSystem, "create_stream", create_stream):
        with pytest.raises(CheckpointError) as error:
            checkpoint.save(model, optim, path)
    text = str(error.value)
    found = _NO_SPACE.fullmatch(text)
    assert found and found["path"] == str(path), text
    needed = sum(t.nbytes for t in saved.values())
    assert int(found["needed"]) == needed, text
    # torch's own words follow fsdp_lite's (here the OSError; the zip writer's on the tmpfs below)
    assert "failed: rank 0: OSError: [Errno 28] No space left on device;" in text, text
    assert not [p for p in path.iterdir() if p.name.startswith("fsdp_lite-000002")]
    fresh, fresh_optim = _trained(build_model("mlp"))
    checkpoint.load(fresh, fresh_optim, path)
    assert _same(fresh, fresh_optim, saved)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a disk that fills without touching the real one (mounting needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a 1 MiB tmpfs needs root; the ENOSPC test above runs anyway")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _wide() -> nn.Module:
    """132 KiB of parameters and as much momentum: a save fits in 1 MiB, twice."""
    return FSDP(
        nn.Sequential(nn.Linear(7, 128), nn.Linear(128, 128), nn.Linear(128, 2)),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )


def _full_disk_rank(rank: int, world_size: int, disk: str) -> dict:
    path = Path(disk) / "ckpt"
    model, optim = _trained(_wide())
    checkpoint.save(model, optim, path)
    saved = _values(model, optim)
    _step(model, optim)
    dist.barrier()
    if rank == 0:  # the disk fills: a few kilobytes left, less than a save writes
        free = shutil.disk_usage(disk).free
        with open(Path(disk) / "filler", "wb") as f:
            f.write(b"\0" * (free - 8192))
    dist.barrier()
    try:
        checkpoint.save(model, optim, path)
        error = "saved"
    except CheckpointError as e:
        error = str(e)
    dist.barrier()
    left = sorted(p.name for p in path.iterdir() if p.name.startswith("fsdp_lite-000002"))
    fresh, fresh_optim = _trained(_wide())
    checkpoint.load(fresh, fresh_optim, path)
    return {
        "error": error,
        "needed": sum(t.nbytes for t in saved.values()),
        "left": left,
        "previous_loads": _same(fresh, fresh_optim, saved),
    }


def test_a_full_disk_says_no_space_left_first_on_every_rank(small_disk):
    results = run_ranks(_full_disk_rank, 2, small_disk, args=(str(small_disk),), timeout=120)
    for rank, result in enumerate(results):
        text = result["error"]
        found = _NO_SPACE.fullmatch(text)
        assert found and found["path"] == str(small_disk / "ckpt"), (rank, text)
        assert int(found["needed"]) == result["needed"], (rank, text)
        assert int(found["free"]) < result["needed"], (rank, text)
        # torch's own words follow: its zip writer's "[enforce fail at inline_container.cc:672]
        # . unexpected pos ..." (which began the message before), or the OSError, depending on
        # which write met the full disk
        assert "unexpected pos" in text or "OSError: [Errno 28] No space left on device" in text
        assert result["left"] == [], result  # the partial generation is gone
        assert result["previous_loads"], rank
