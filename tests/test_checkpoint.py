"""Checkpoints that reshard, cross to native FSDP2, survive a killed save, and fail clearly.

One run trains at world size 4 and saves with ``fsdp_lite.checkpoint.save`` (model + AdamW state,
sharded, no gather), then keeps training: its losses are the uninterrupted reference. Runs at 2 and
3 ranks, and one plain process without a process group, load that checkpoint and must continue
with the same losses. Every run sees the same global batch of 12 sequences, split evenly over its
ranks, so the arithmetic is the same up to the order of sums.

Launches: save at 4; a save killed at 2; then one launch each at 2 and 3 with every check.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import checkpoint
from fsdp_lite.checkpoint import CheckpointError
from fsdp_lite.state.checkpoint_files import MANIFEST
from tests.parity import POLICIES, assert_close, batch, build_model, loss_fn
from tests.ranks import RankFailure, run_ranks

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4
SAVE_AFTER = 2  # steps before the save
RESUME_STEPS = 2  # steps after it
EXACT = dict(rtol=0.0, atol=0.0)  # a checkpoint copies bytes
# Losses after a reshard: the same global batch in 4, 3, 2 or 1 pieces. Each rank's mean and the
# gradient sums run in another order (and gloo adds 3 or 4 contributions in its own order), so
# losses differ in the last bits: up to 8e-8 relative measured, bound 1e-6.
RESHARD_LOSS = dict(rtol=1e-6, atol=0.0)


def _lm() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _step(model, optim, step: int, rank: int, world_size: int) -> float:
    """One step on this rank's share of the global batch; returns the global mean loss."""
    x, y = batch("lm", seed=step, size=GLOBAL_BATCH)
    rows = GLOBAL_BATCH // world_size
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    optim.zero_grad()
    loss = loss_fn("lm", model(x), y)
    loss.backward()
    optim.step()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item() / world_size


def _resume_losses(model, optim, rank, world_size) -> list[float]:
    steps = range(SAVE_AFTER, SAVE_AFTER + RESUME_STEPS)
    return [_step(model, optim, step, rank, world_size) for step in steps]


def _full_state(model, optim) -> dict:
    """Full model and optimizer state on every rank, for exact comparisons."""
    return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    for key, value in want["model"].items():
        assert_close(got["model"][key], value, what=f"{what}: model {key}", **EXACT)
    assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"]), what
    for name, entry in want["optim"]["state"].items():
        for key, value in entry.items():
            mine = got["optim"]["state"][name][key]
            assert_close(mine, value, what=f"{what}: optim {name}.{key}", **EXACT)
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"], what


# ---- the save at world size 4 ---------------------------------------------------------------------


def _save_at_4_rank(rank: int, world_size: int, tmp: str) -> tuple[list[float], str]:
    try:
        _check_params_smaller_than_the_world(rank, world_size, tmp)
        small = "ok"
    except Exception:  # noqa: BLE001 - reported by its own test
        small = traceback.format_exc()
    dist.barrier()
    model, optim = _lm()
    for step in range(SAVE_AFTER):
        _step(model, optim, step, rank, world_size)
    checkpoint.save(model, optim, f"{tmp}/ckpt")
    full = _full_state(model, optim)
    if rank == 0:
        torch.save(full, f"{tmp}/expected.pt")
    return _resume_losses(model, optim, rank, world_size), small


def _check_params_smaller_than_the_world(rank, world_size, tmp):
    """The MLP's last bias has 3 rows: at 4 ranks the last one holds none of it."""
    from fsdp_lite import StateDictType

    plain = build_model("mlp")
    model = FSDP(build_model("mlp"), auto_wrap_policy=POLICIES["mlp"])
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        rows = model.state_dict()["fc3.bias"].shape[0]
    assert rows == (0 if rank == 3 else 1), f"rank {rank} holds {rows} rows of fc3.bias"
    full = model.state_dict()
    for key, value in plain.state_dict().items():
        assert_close(full[key], value, what=f"FULL {key}", **EXACT)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=f"{tmp}/mlp")
    fresh = FSDP(build_model("mlp"), auto_wrap_policy=POLICIES["mlp"])
    fresh.load_state_dict({k: v + 1.0 for k, v in full.items()})
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        target = fresh.state_dict()
        dcp.load(target, checkpoint_id=f"{tmp}/mlp")
        fresh.load_state_dict(target)
    for key, value in fresh.state_dict().items():
        assert_close(value, full[key], what=f"SHARDED via dcp {key}", **EXACT)


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved_at_4")
    results = run_ranks(_save_at_4_rank, 4, tmp, args=(str(tmp),), timeout=150)
    losses = [r[0] for r in results]
    assert all(r == losses[0] for r in losses), losses
    return tmp, losses[0], [r[1] for r in results]


def test_state_dicts_of_params_smaller_than_the_world_size(saved_at_4):
    for rank, outcome in enumerate(saved_at_4[2]):
        assert outcome == "ok", f"rank {rank} of 4:\n{outcome}"


# ---- a save killed midway (world size 2) ----------------------------------------------------------


def _killed_save_rank(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    model, optim = _lm()
    _step(model, optim, 0, rank, world_size)
    checkpoint.save(model, optim, f"{tmp}/ckpt")
    full = _full_state(model, optim)
    if rank == 0:
        torch.save(full, f"{tmp}/expected.pt")
    _step(model, optim, 1, rank, world_size)

    write_item = dcp_filesystem._write_item
    written = []

    def write_then_die(transforms, stream, data, *args):
        if written:  # the second item: half of it, then the process is gone
            stream.write(b"\0" * 64)
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        written.append(True)
        return write_item(transforms, stream, data, *args)

    if rank == 1:
        dcp_filesystem._write_item = write_then_die
    checkpoint.save(model, optim, f"{tmp}/ckpt")
    raise AssertionError("the save was meant to be killed")


@pytest.fixture(scope="module")
def killed_save(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed_save")
    with pytest.raises(RankFailure) as failure:
        run_ranks(_killed_save_rank, 2, tmp, args=(str(tmp),), timeout=60)
    return tmp, str(failure.value)


def test_a_killed_save_leaves_the_previous_checkpoint_in_place(killed_save):
    tmp, failure = killed_save
    assert "rank 1 of 2 exited without reporting a result: killed by signal SIGKILL" in failure
    manifest = json.loads((tmp / "ckpt" / MANIFEST).read_text())
    assert manifest["generation"] == 1, "the manifest must still name the previous checkpoint"
    assert all(name.startswith("fsdp_lite-000001") for name in manifest["files"]), manifest
    beside = [p.name for p in tmp.iterdir() if p.name.startswith(".ckpt")]
    assert not beside, f"a save writes only inside its directory: {beside}"


# ---- rank 0's rename fails (world size 2) -------------------------------------------------------


def _failed_rename_rank(rank: int, world_size: int, tmp: str) -> tuple[str, float, bool]:
    """Save, then save again with rank 0's final rename failing: every rank raises at once."""
    import time
    from unittest import mock

    model, optim = _lm()
    _step(model, optim, 0, rank, world_size)
    checkpoint.save(model, optim, f"{tmp}/ckpt")
    expected = copy.deepcopy(_full_state(model, optim))  # "step" is the optimizer's own tensor
    _step(model, optim, 1, rank, world_size)
    replace = os.replace

    def manifest_fails_into_place(source, target):
        if Path(target).name == MANIFEST:  # the commit of a save
            raise OSError(28, "No space left on device")
        return replace(source, target)

    patch = mock.patch.object(os, "replace", manifest_fails_into_place) if rank == 0 else None
    start = time.monotonic()
    with patch or contextlib.nullcontext(), pytest.raises(CheckpointError) as error:
        checkpoint.save(model, optim, f"{tmp}/ckpt")
    seconds = time.monotonic() - start
    dist.barrier()
    # The manifest still names the previous checkpoint, and the failed save's files are gone.
    assert not [p for p in Path(tmp, "ckpt").iterdir() if p.name.startswith("fsdp_lite-000002")]
    fresh, fresh_optim = _lm()
    checkpoint.load(fresh, fresh_optim, f"{tmp}/ckpt")
    _assert_same_state(_full_state(fresh, fresh_optim), expected, "after the failed rename")
    return str(error.value), seconds, isinstance(error.value.__cause__, OSError)


def test_a_failed_commit_on_rank0_raises_the_same_error_on_every_rank(tmp_path):
    # A 20 s process-group timeout: a rank left waiting in a barrier would fail with gloo's
    # timeout (or run_ranks' RankTimeout) instead of returning the CheckpointError.
    results = run_ranks(_failed_rename_rank, 2, tmp_path, args=(str(tmp_path),), timeout=20)
    (message0, seconds0, chained0), (message1, seconds1, chained1) = results
    assert message0 == message1, results
    assert "rank 0 could not write the manifest of" in message0, message0
    assert "No space left on device" in message0, message0
    assert chained0 and not chained1, "rank 0 chains the OSError itself"
    print(f"save raised after {seconds0:.2f} s on rank 0, {seconds1:.2f} s on rank 1")


# ---- loading: every check at world size 2 and 3 ---------------------------------------------------


def _check_resume_from_4(rank, world_size, tmp, saved_at_4, killed):
    """The world-size-4 checkpoint loads exactly and training goes on as if never stopped."""
    model, optim = _lm()
    checkpoint.load(model, optim, f"{saved_at_4}/ckpt")
    want = torch.load(f"{saved_at_4}/expected.pt", weights_only=True)
    _assert_same_state(_full_state(model, optim), want, f"loaded at {world_size} ranks")
    return _resume_losses(model, optim, rank, world_size)


def _check_load_after_killed_save(rank, world_size, tmp, saved_at_4, killed):
    model, optim = _lm()
    checkpoint.load(model, optim, f"{killed}/ckpt")
    want = torch.load(f"{killed}/expected.pt", weights_only=True)
    _assert_same_state(_full_state(model, optim), want, "the checkpoint before the killed save")
    # Saving again into the same path clears what the dead save left (its generation's files).
    work = Path(tmp) / "again" / "ckpt"
    if rank == 0:
        shutil.copytree(f"{killed}/ckpt", work)
        (work / "fsdp_lite-000002__1_0.distcp").write_bytes(b"\0" * 64)  # whatever it left
    dist.barrier()
    _step(model, optim, 5, rank, world_size)
    checkpoint.save(model, optim, work)
    assert sorted(p.name for p in work.iterdir()) == sorted(
        [".fsdp_lite.lock", ".fsdp_lite.readers", ".metadata", MANIFEST]
        + [
            "fsdp_lite-000003.metadata",
            "fsdp_lite-000003__0_0.distcp",
            "fsdp_lite-000003__1_0.distcp",
        ]
    ), sorted(work.iterdir())
    fresh, fresh_optim = _lm()
    checkpoint.load(fresh, fresh_optim, work)
    _assert_same_state(_full_state(fresh, fresh_optim), _full_state(model, optim), "saved again")


def _expect_error(path, match: list[str], model=None) -> None:
    model, optim = model or _lm()
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(model, optim, path)
    for text in match:
        assert text in str(error.value), f"{text!r} not in: {error.value}"


def _check_truncated_or_mismatched_checkpoint_names_the_keys(
    rank, world_size, tmp, saved_at_4, killed
):
    source = Path(saved_at_4) / "ckpt"
    names = ("no_file", "no_metadata", "no_manifest_no_metadata", "short_file")
    broken = {name: Path(tmp) / name for name in names}
    if rank == 0:
        for path in broken.values():
            shutil.copytree(source, path)
        (broken["no_file"] / "fsdp_lite-000001__3_0.distcp").unlink()
        (broken["no_metadata"] / "fsdp_lite-000001.metadata").unlink()
        (broken["no_manifest_no_metadata"] / MANIFEST).unlink()
        (broken["no_manifest_no_metadata"] / ".metadata").unlink()
        short = broken["short_file"] / "fsdp_lite-000001__1_0.distcp"
        os.truncate(short, short.stat().st_size // 2)
    dist.barrier()
    # rank 3's file holds its rows of every sharded tensor; name some of them
    _expect_error(
        broken["no_file"],
        [
            "is incomplete: data file fsdp_lite-000001__3_0.distcp is missing",
            "model.blocks.0.fc.weight",
        ],
    )
    _expect_error(
        broken["no_metadata"],
        ["is incomplete: its metadata file fsdp_lite-000001.metadata is missing"],
    )
    _expect_error(
        broken["no_manifest_no_metadata"],
        ["is incomplete: it has neither fsdp_lite_manifest.json nor .metadata"],
    )
    _expect_error(broken["short_file"], ["data file fsdp_lite-000001__1_0.distcp is truncated"])
    _expect_error(Path(tmp) / "nowhere", ["no checkpoint at"])
    # another model: a third block, and a wider embedding
    from conformance.models import GPTConfig, TinyLM

    torch.manual_seed(0)
    deeper = FSDP(TinyLM(GPTConfig(n_layers=3)), auto_wrap_policy=POLICIES["lm"])
    deeper_optim = torch.optim.AdamW(deeper.parameters())
    _expect_error(
        source,
        ["does not match the model", "missing from the checkpoint: model.blocks.2.fc.bias"],
        model=(deeper, deeper_optim),
    )
    shallower = FSDP(TinyLM(GPTConfig(n_layers=1)), auto_wrap_policy=POLICIES["lm"])
    _expect_error(
        source,
        ["12 key(s) the model lacks: model.blocks.1.fc.bias"],
        model=(shallower, torch.optim.AdamW(shallower.parameters())),
    )
    wider = FSDP(TinyLM(GPTConfig(vocab_size=64)), auto_wrap_policy=POLICIES["lm"])
    _expect_error(
        source,
        ["with another shape", "model.tok.weight (checkpoint (61, 24), model (64, 24))"],
        model=(wider, torch.optim.AdamW(wider.parameters())),
    )


def _native_fsdp2():
    from torch.distributed.fsdp import fully_shard

    model = build_model("lm")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _check_native_fsdp2_checkpoints_both_ways(rank, world_size, tmp, saved_at_4, killed):
    """A DCP checkpoint of native FSDP2 (torch's get_state_dict recipe) loads here; the reverse."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def native_save(model, optim, path):
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def native_load(model, optim, path):
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    native, native_optim = _native_fsdp2()
    ours, our_optim = _lm()
    for step in range(SAVE_AFTER):
        _step(native, native_optim, step, rank, world_size)
        _step(ours, our_optim, step, rank, world_size)
    native_save(native, native_optim, f"{tmp}/native")
    checkpoint.save(ours, our_optim, f"{tmp}/ours")
    into_ours, into_our_optim = _lm()
    checkpoint.load(into_ours, into_our_optim, f"{tmp}/native")
    into_native, into_native_optim = _native_fsdp2()
    native_load(into_native, into_native_optim, f"{tmp}/ours")
    # fsdp_lite and FSDP2 agree bitwise at 2 ranks (tests/test_fsdp2_front.py), so all four go on identically.
    losses = {
        "native": _resume_losses(native, native_optim, rank, world_size),
        "ours": _resume_losses(ours, our_optim, rank, world_size),
        "native -> ours": _resume_losses(into_ours, into_our_optim, rank, world_size),
        "ours -> native": _resume_losses(into_native, into_native_optim, rank, world_size),
    }
    assert len({tuple(v) for v in losses.values()}) == 1, losses


CHECKS = {
    2: [
        "resume_from_4",
        "load_after_killed_save",
        "truncated_or_mismatched_checkpoint_names_the_keys",
        "native_fsdp2_checkpoints_both_ways",
    ],
    3: ["resume_from_4"],
}


def _all_checks_rank(rank, world_size, tmp, saved_at_4, killed) -> dict:
    outcomes = {}
    for name in CHECKS[world_size]:
        try:
            result = globals()[f"_check_{name}"](rank, world_size, tmp, saved_at_4, killed)
            outcomes[name] = ("ok", result)
        except Exception:  # noqa: BLE001 - reported by the test named after the check
            outcomes[name] = ("failed", traceback.format_exc())
        dist.barrier()
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, saved_at_4, killed_save):
    by_world_size = {}
    for world_size in CHECKS:
        tmp = tmp_path_factory.mktemp(f"load_at_{world_size}")
        args = (str(tmp), str(saved_at_4[0]), str(killed_save[0]))
        by_world_size[world_size] = run_ranks(
            _all_checks_rank, world_size, tmp, args=args, timeout=150
        )
    return by_world_size


def _outcome(outcomes, world_size, check):
    results = []
    for rank, by_check in enumerate(outcomes[world_size]):
        status, detail = by_check[check]
        assert status == "ok", f"rank {rank} of {world_size}, check {check}:\n{detail}"
        results.append(detail)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpoint_saved_at_4_ranks_resumes_at_fewer(outcomes, saved_at_4, world_size):
    _, reference, _ = saved_at_4
    for losses in _outcome(outcomes, world_size, "resume_from_4"):
        for step, (got, want) in enumerate(zip(losses, reference)):
            assert_close(
                torch.tensor(got),
                torch.tensor(want),
                what=f"world size {world_size}, step {SAVE_AFTER + step}",
                **RESHARD_LOSS,
            )


def test_checkpoint_saved_at_4_ranks_loads_into_a_plain_module(saved_at_4):
    """One process, no process group, no wrapper: the same call loads the sharded checkpoint."""
    tmp, reference, _ = saved_at_4
    assert not dist.is_initialized()
    model = build_model("lm")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    checkpoint.load(model, optim, tmp / "ckpt")
    want = torch.load(tmp / "expected.pt", weights_only=True)
    got = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    _assert_same_state(got, want, "plain module")
    losses = _resume_losses(model, optim, rank=0, world_size=1)
    for step, (loss, ref) in enumerate(zip(losses, reference)):
        assert_close(torch.tensor(loss), torch.tensor(ref), what=f"step {step}", **RESHARD_LOSS)


def test_checkpoint_converts_offline_to_one_torch_save_file(saved_at_4):
    """torch's own converter reads it too: full tensors, keys as saved, no model needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp, _, _ = saved_at_4
    dcp_to_torch_save(tmp / "ckpt", tmp / "converted.pt")
    converted = torch.load(tmp / "converted.pt", weights_only=True)
    want = torch.load(tmp / "expected.pt", weights_only=True)
    for key, value in want["model"].items():
        assert_close(converted["model"][key], value, what=f"converted {key}", **EXACT)
    exp_avg = converted["optim"]["state"]["tok.weight"]["exp_avg"]
    assert_close(exp_avg, want["optim"]["state"]["tok.weight"]["exp_avg"], what="exp_avg", **EXACT)


@pytest.mark.parametrize("check", CHECKS[2][1:])
def test_checkpoint(outcomes, check):
    _outcome(outcomes, 2, check)
