"""Checkpoints you can trust, tried as an attacker would (issue 24).

A crafted checkpoint whose pickles call ``os.system`` must never run it through any fsdp_lite load
path, while torch's own ``dcp.load`` of the same files runs it in the same test (measured, so the
attack is real).
"""

from __future__ import annotations

import fractions
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import checkpoint
from fsdp_lite.checkpoint import CheckpointError
from fsdp_lite.state.checkpoint import checkpoint_state
from fsdp_lite.state.checkpoint_files import MANIFEST, crc32_of, read_manifest, read_metadata
from fsdp_lite.wrap import ModuleWrapPolicy
from tests.parity import build_model
from tests.ranks import run_checks, run_ranks


class Pwned:
    """What an attacker pickles: unpickling it runs a shell command that writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = FSDP(build_model("mlp"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 7)).sum().backward()
    optim.step()
    return model, optim


def _forge(path: Path, metadata: bytes) -> None:
    """What an attacker does to an fsdp_lite checkpoint: new metadata, and a manifest to match
    (its checksums find damage, not forgery)."""
    manifest = read_manifest(path)
    file = path / manifest.metadata["name"]
    file.write_bytes(metadata)
    manifest.metadata.update(size=len(metadata), crc32=crc32_of(file))
    (path / MANIFEST).write_bytes(manifest.dumps())


def _craft(tmp: Path, rank: int) -> dict[str, Path]:
    """Crafted copies of a good checkpoint, each with a pickle that writes a marker file."""
    model, optim = _model()
    good = tmp / "good"
    checkpoint.save(model, optim, good)
    crafted = {
        name: tmp / name
        for name in (
            "whole_metadata",  # the metadata is the attacker's object (manifest forged to match)
            "inside_metadata",  # valid Metadata, one field poisoned (manifest forged to match)
            "no_manifest",  # the manifest removed, torch's .metadata poisoned
            "param_group",  # an optimizer param_groups value, in a checkpoint torch wrote
            "harmless_object",  # a legacy file: not code, only an object fsdp_lite does not read
        )
    }
    # Poisoned param_groups value, written by DCP itself on every rank.
    state = checkpoint_state(model, optim)
    state["optim"]["param_groups"][0]["lr"] = Pwned(tmp / "marker.param_group")
    dcp.save(state, checkpoint_id=crafted["param_group"])
    if rank == 0:
        for name in ("whole_metadata", "inside_metadata", "no_manifest", "harmless_object"):
            shutil.copytree(good, crafted[name])
        _forge(crafted["whole_metadata"], pickle.dumps(Pwned(tmp / "marker.whole_metadata")))
        metadata = read_metadata(good / ".metadata")
        metadata.planner_data["x"] = Pwned(tmp / "marker.inside_metadata")
        _forge(crafted["inside_metadata"], pickle.dumps(metadata))
        (crafted["no_manifest"] / MANIFEST).unlink()
        poisoned = pickle.dumps(Pwned(tmp / "marker.no_manifest"))
        (crafted["no_manifest"] / ".metadata").write_bytes(poisoned)
        metadata.planner_data["x"] = fractions.Fraction(1, 3)
        _forge(crafted["harmless_object"], pickle.dumps(metadata))
    dist.barrier()
    return crafted


def _attack_rank(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    tmp = Path(tmp)
    crafted = _craft(tmp, rank)
    seen = {}
    for name, path in crafted.items():
        model, optim = _model()
        try:
            checkpoint.load(model, optim, path)
        except CheckpointError as e:
            seen[name] = str(e).replace(str(tmp), "TMP")
        else:
            seen[name] = "loaded"
        dist.barrier()
    # The opt-out, for a trusted file holding an object that is not code.
    model, optim = _model()
    checkpoint.load(model, optim, crafted["harmless_object"], allow_code_execution=True)
    seen["harmless_object_allowed"] = "loaded"
    # The model alone reads no optimizer item: nothing to refuse, nothing runs.
    model, _ = _model()
    checkpoint.load(model, None, crafted["param_group"])
    seen["param_group_model_only"] = "loaded"
    # torch's dcp.load of the same files runs the attacker's code (the marker appears).
    model, optim = _model()
    state = checkpoint_state(model, optim)
    dcp.load(state, checkpoint_id=crafted["param_group"])
    dist.barrier()
    seen["torch_param_group"] = (tmp / "marker.param_group").read_text().strip()
    return seen


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attack")
    seen = run_ranks(_attack_rank, 2, tmp, args=(str(tmp),), timeout=120)
    return tmp, seen


def test_a_crafted_checkpoint_never_runs_code_through_fsdp_lite(attacked):
    tmp, seen = attacked
    for name in ("whole_metadata", "inside_metadata", "no_manifest"):
        assert not (tmp / f"marker.{name}").exists(), f"{name}: the attacker's command ran"
    for rank, by_case in enumerate(seen):
        assert by_case["whole_metadata"].startswith(
            "checkpoint file TMP/whole_metadata/fsdp_lite-000001.metadata refers to "
            "posix.system, which fsdp_lite does not load"
        ), (rank, by_case["whole_metadata"])
        assert by_case["inside_metadata"].startswith(
            "checkpoint file TMP/inside_metadata/fsdp_lite-000001.metadata refers to posix.system"
        ), (rank, by_case["inside_metadata"])
        assert by_case["no_manifest"].startswith(
            "checkpoint file TMP/no_manifest/.metadata refers to posix.system"
        ), (rank, by_case["no_manifest"])
        assert (
            "allow_code_execution=True only for a checkpoint you trust"
            in by_case["inside_metadata"]
        )
        assert (
            "item optim.param_groups.0.lr of checkpoint file TMP/param_group/__"
            in by_case["param_group"]
        ), (rank, by_case["param_group"])
        assert "refers to posix.system" in by_case["param_group"]
        assert by_case["param_group_model_only"] == "loaded"


def test_torchs_own_dcp_load_of_the_same_files_runs_the_code(attacked):
    _, seen = attacked
    assert seen[0]["torch_param_group"] == "pwned", "the attack is real: torch ran it"


def test_a_trusted_file_with_other_objects_loads_with_allow_code_execution(attacked):
    _, seen = attacked
    for by_case in seen:
        assert by_case["harmless_object"].startswith(
            "checkpoint file TMP/harmless_object/fsdp_lite-000001.metadata refers to "
            "fractions.Fraction"
        ), by_case["harmless_object"]
        assert by_case["harmless_object_allowed"] == "loaded"


def test_a_crafted_metadata_is_refused_in_a_plain_process_too(tmp_path):
    """No process group, no wrapper: the one-process load path reads the metadata the same way."""
    assert not dist.is_initialized()
    model = build_model("mlp")
    (tmp_path / "ckpt").mkdir()
    marker = tmp_path / "marker"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Pwned(marker)))
    with pytest.raises(CheckpointError, match="refers to posix.system"):
        checkpoint.load(model, None, tmp_path / "ckpt")
    assert not marker.exists()


# ---- saves own only what they write; corruption; one path on one rank only; a full disk --------


def _values(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and optimizer state tensor, by name."""
    names = {p: n for n, p in model.named_parameters()}
    values = {n: _local(p).detach().clone() for p, n in names.items()}
    for p, state in optim.state.items():
        for key, value in state.items():
            values[f"{names[p]} {key}"] = _local(value).clone()
    return values


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _same(model: nn.Module, optim: torch.optim.Optimizer, want: dict[str, torch.Tensor]) -> bool:
    got = _values(model, optim)
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _listing(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _check_foreign_files(rank: int, tmp: Path) -> None:
    results = tmp / "results"
    foreign = {"notes.txt": b"x\n", "sub/inner.txt": b"y\n", "__0_0.distcp": b"not ours"}
    if rank == 0:
        for name, data in foreign.items():
            (results / name).parent.mkdir(parents=True, exist_ok=True)
            (results / name).write_bytes(data)
    dist.barrier()
    model, optim = _model()
    checkpoint.save(model, optim, results)
    saved = _values(model, optim)
    model(torch.randn(2, 7)).sum().backward()
    optim.step()
    checkpoint.save(model, optim, results)  # replaces the first: its files go, the others stay
    again = _values(model, optim)
    dist.barrier()
    listing = _listing(results)
    for name, data in foreign.items():
        assert listing[name] == data, f"{name} changed"
    ours = sorted(n for n in listing if n not in foreign)
    assert ours == [
        ".fsdp_lite.lock",
        ".fsdp_lite.readers",
        ".metadata",
        "fsdp_lite-000002.metadata",
        "fsdp_lite-000002__0_0.distcp",
        "fsdp_lite-000002__1_0.distcp",
        "fsdp_lite_manifest.json",
    ], ours
    fresh, fresh_optim = _model()
    checkpoint.load(fresh, fresh_optim, results)
    assert _same(fresh, fresh_optim, again) and not _same(fresh, fresh_optim, saved)
    # torch's own reader finds the same generation through .metadata
    native, native_optim = _model()
    state = checkpoint_state(native, native_optim)
    dcp.load(state, checkpoint_id=results)
    native.load_state_dict(state["model"])
    assert _same(native, native_optim, again)
    # A regular file at the path, and a checkpoint torch wrote: refused, left as they were.
    if rank == 0:
        (tmp / "a_file").write_text("keep me")
    dcp.save(checkpoint_state(model, optim), checkpoint_id=tmp / "torchs")
    before = _listing(tmp / "torchs")
    for target, words in ((tmp / "a_file", "is a file"), (tmp / "torchs", "did not write")):
        with pytest.raises(CheckpointError, match=words):
            checkpoint.save(model, optim, target)
    dist.barrier()
    assert (tmp / "a_file").read_text() == "keep me" and not (tmp / ".a_file.old").exists()
    assert _listing(tmp / "torchs") == before


def _check_flipped_bytes(rank: int, tmp: Path) -> None:
    import json

    model, optim = _model()
    checkpoint.save(model, optim, tmp / "ckpt")
    manifest = json.loads((tmp / "ckpt" / "fsdp_lite_manifest.json").read_text())
    name = "fsdp_lite-000001__1_0.distcp"  # rank 1's rows
    offset, length, _ = max(manifest["files"][name]["items"], key=lambda item: item[1])
    if rank == 0:
        data = bytearray((tmp / "ckpt" / name).read_bytes())
        for i in range(offset + length // 2, offset + length // 2 + 16):
            data[i] ^= 0xFF
        (tmp / "ckpt" / name).write_bytes(bytes(data))  # the same size
    dist.barrier()
    fresh, fresh_optim = _model()
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(fresh, fresh_optim, tmp / "ckpt")
    words = f"is corrupt: data file {name} bytes [{offset}, {offset + length})"
    assert words in str(error.value), str(error.value)
    # torch's dcp.load of the same files: no error, other weights.
    native, native_optim = _model()
    state = checkpoint_state(native, native_optim)
    dcp.load(state, checkpoint_id=tmp / "ckpt")
    native.load_state_dict(state["model"])
    differs = torch.tensor(float(not _same(native, native_optim, _values(model, optim))))
    dist.all_reduce(differs)
    assert differs.item() > 0, "torch loaded the flipped bytes as weights somewhere"


def _check_one_rank_only(rank: int, tmp: Path) -> None:
    import time

    model, optim = _model()
    checkpoint.save(model, optim, tmp / "ckpt")
    # The same path on two machines whose disks differ: here, another path on rank 1.
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*view1 \(on rank 1 only\)"):
        checkpoint.load(model, optim, tmp / "ckpt" if rank == 0 else tmp / "view1")
    with pytest.raises(CheckpointError, match=r"every rank shares \(on rank 1 only\)"):
        checkpoint.save(model, optim, tmp / f"view{rank}")
    seconds = time.monotonic() - start
    assert seconds < 10, f"{seconds:.1f} s: a rank waited for another"  # the timeout is 20 s
    assert not [p for p in (tmp / "view0").iterdir() if p.name.startswith("fsdp_lite-")]


def _check_full_disk(rank: int, tmp: Path) -> None:
    import resource
    import signal

    model, optim = _model()
    checkpoint.save(model, optim, tmp / "ckpt")
    saved = _values(model, optim)
    model(torch.randn(2, 7)).sum().backward()
    optim.step()
    # RLIMIT_FSIZE: writes past 2048 bytes fail with EFBIG (SIGXFSZ ignored, as shells do not).
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))
    try:
        with pytest.raises(CheckpointError) as error:
            checkpoint.save(model, optim, tmp / "ckpt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    text = str(error.value)
    for words in (
        f"saving checkpoint {tmp / 'ckpt'} failed: rank ",
        "bytes free and this rank writes about",
        "may write files of at most 2048 bytes (ulimit -f)",
        "the previous checkpoint there is unchanged",
    ):
        assert words in text, text
    dist.barrier()
    assert not [p for p in (tmp / "ckpt").iterdir() if p.name.startswith("fsdp_lite-000002")]
    fresh, fresh_optim = _model()
    checkpoint.load(fresh, fresh_optim, tmp / "ckpt")
    assert _same(fresh, fresh_optim, saved)


SAVE_CHECKS = {
    "foreign_files": _check_foreign_files,
    "flipped_bytes": _check_flipped_bytes,
    "one_rank_only": _check_one_rank_only,
    "full_disk": _check_full_disk,
}


def _save_checks_rank(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    failures = {}
    for name, check in SAVE_CHECKS.items():
        directory = Path(tmp) / name
        if rank == 0:
            directory.mkdir()
        dist.barrier()
        failures.update(run_checks({name: check}, [name], rank, directory))
    return failures


@pytest.fixture(scope="module")
def save_checks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saves")
    # 20 s process-group timeout: a rank left waiting in a collective fails the test.
    return run_ranks(_save_checks_rank, 2, tmp, args=(str(tmp),), timeout=20 * len(SAVE_CHECKS))


def _passed(save_checks, name):
    for rank, failures in enumerate(save_checks):
        assert name not in failures, f"rank {rank}:\n{failures[name]}"


def test_a_save_writes_beside_foreign_files_and_replaces_only_its_own_checkpoint(save_checks):
    _passed(save_checks, "foreign_files")


def test_a_flipped_byte_is_named_on_every_rank_while_torch_loads_it_as_weights(save_checks):
    _passed(save_checks, "flipped_bytes")


def test_a_checkpoint_one_rank_does_not_see_fails_on_every_rank_within_seconds(save_checks):
    _passed(save_checks, "one_rank_only")


def test_a_full_disk_during_a_save_is_named_and_keeps_the_previous_checkpoint(save_checks):
    _passed(save_checks, "full_disk")


# ---- two jobs, one path ----------------------------------------------------------------------------

SAVES_PER_JOB = 8


def _fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            _local(p).fill_(value)


def _two_jobs_rank(rank: int, world_size: int, tmp: str) -> dict:
    """Ranks 0-1 are one job, 2-3 another: each saves to the same path with its own values and
    loads back whatever is there."""
    from fsdp_lite.engine.collectives import all_gather_objects

    job = rank // 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[job]
    path = Path(tmp) / "shared"

    def build() -> nn.Module:
        return FSDP(
            build_model("mlp"),
            process_group=group,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        )

    model = build()
    saved, refused, loaded = [], [], []
    dist.barrier()  # both jobs start together
    for i in range(SAVES_PER_JOB):
        value = 1000.0 * (job + 1) + i
        _fill(model, value)
        try:
            checkpoint.save(model, None, path)
            saved.append(value)
        except CheckpointError as e:
            assert "is being saved by another job" in str(e), str(e)
            refused.append(value)
        fresh = build()
        try:
            checkpoint.load(fresh, None, path)
        except CheckpointError as e:  # the other job's save finished meanwhile, or none yet
            assert "changed while" in str(e) or "first save has not finished" in str(e), str(e)
            continue
        # one value in every parameter of every rank of the job: one save's, not a mix
        mine = {float(v) for p in fresh.parameters() for v in _local(p).detach().unique()}
        loaded.append(sorted(set().union(*all_gather_objects(mine, group=group))))
    dist.barrier()
    return {"saved": saved, "refused": refused, "loaded": loaded}


def test_two_jobs_saving_to_one_path_never_mix_their_files(tmp_path):
    import json

    results = run_ranks(_two_jobs_rank, 4, tmp_path, args=(str(tmp_path),), timeout=240)
    saved = {v for r in results for v in r["saved"]}
    for rank, result in enumerate(results):
        job = results[rank - rank % 2]
        assert result["saved"] == job["saved"], "the ranks of a job agree on every outcome"
        assert len(result["saved"]) + len(result["refused"]) == SAVES_PER_JOB
        for values in result["loaded"]:
            assert len(values) == 1 and values[0] in saved, f"rank {rank} loaded {values}"
    manifest = json.loads((tmp_path / "shared" / MANIFEST).read_text())
    # every save that returned made one generation of its own: none interleaved
    assert manifest["generation"] == len(saved), (manifest["generation"], sorted(saved))
    print(f"{len(saved)} saves, {sum(len(r['refused']) for r in results[::2])} refused")
