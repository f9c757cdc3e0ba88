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
from fsdp_lite.state.checkpoint_files import read_metadata
from fsdp_lite.wrap import ModuleWrapPolicy
from tests.parity import build_model
from tests.ranks import run_ranks


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


def _craft(tmp: Path, rank: int) -> dict[str, Path]:
    """Crafted copies of a good checkpoint, each with a pickle that writes a marker file."""
    model, optim = _model()
    good = tmp / "good"
    checkpoint.save(model, optim, good)
    crafted = {
        "whole_metadata": tmp / "whole_metadata",  # .metadata is the attacker's object
        "inside_metadata": tmp / "inside_metadata",  # valid Metadata, one field poisoned
        "param_group": tmp / "param_group",  # an optimizer param_groups item
        "harmless_object": tmp / "harmless_object",  # a legacy file: not code, just unknown
    }
    # Poisoned param_groups value, written by DCP itself on every rank.
    state = checkpoint_state(model, optim)
    state["optim"]["param_groups"][0]["lr"] = Pwned(tmp / "marker.param_group")
    dcp.save(state, checkpoint_id=crafted["param_group"])
    if rank == 0:
        for name in ("whole_metadata", "inside_metadata", "harmless_object"):
            shutil.copytree(good, crafted[name])
        metadata_file = crafted["whole_metadata"] / ".metadata"
        metadata_file.write_bytes(pickle.dumps(Pwned(tmp / "marker.whole_metadata")))
        metadata = read_metadata(good / ".metadata")
        metadata.planner_data["x"] = Pwned(tmp / "marker.inside_metadata")
        (crafted["inside_metadata"] / ".metadata").write_bytes(pickle.dumps(metadata))
        metadata.planner_data["x"] = fractions.Fraction(1, 3)
        (crafted["harmless_object"] / ".metadata").write_bytes(pickle.dumps(metadata))
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
    for name in ("whole_metadata", "inside_metadata"):
        assert not (tmp / f"marker.{name}").exists(), f"{name}: the attacker's command ran"
    for rank, by_case in enumerate(seen):
        assert by_case["whole_metadata"].startswith(
            "checkpoint file TMP/whole_metadata/.metadata refers to posix.system, which "
            "fsdp_lite does not load"
        ), (rank, by_case["whole_metadata"])
        assert by_case["inside_metadata"].startswith(
            "checkpoint file TMP/inside_metadata/.metadata refers to posix.system"
        ), (rank, by_case["inside_metadata"])
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
            "checkpoint file TMP/harmless_object/.metadata refers to fractions.Fraction"
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
