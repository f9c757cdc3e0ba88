"""Disk offload (ZeRO-Infinity): shards, grads and optimizer state in memory-mapped files.

Parity is bitwise against in-memory CPU offload with the same strategy (the arithmetic is the
same; only where the bytes live differs). Residency is read from /proc/self/smaps: the pages of
the offload files must be unmapped between uses. Clean-up is checked in separate processes that
exit normally or die.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_lite import CPUOffload, ShardingStrategy, disk_offload
from fsdp_lite import FullyShardedDataParallel as FSDP
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def _resident_kib(directory: str) -> int:
    """Resident pages of every mapping of a file under ``directory``, from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = directory in line
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def _disk_files(model: FSDP) -> dict:
    """Each sharded parameter's files, by the parameter's id."""
    return {
        id(p.sharded_param): p.disk_files for w in FSDP.fsdp_modules(model) for p in w._unit.params
    }


def _parity_rank(
    rank: int, world_size: int, strategy_name: str, opt_name: str, by_unit: bool, base: str
) -> None:
    strategy = ShardingStrategy[strategy_name]
    offloads = {
        "memory": CPUOffload(offload_params=True),
        "disk": CPUOffload(offload_params=True, offload_dir=base),
    }
    models = {
        k: FSDP(
            build_model("lm"),
            sharding_strategy=strategy,
            auto_wrap_policy=POLICIES["lm"],
            cpu_offload=offload,
        )
        for k, offload in offloads.items()
    }
    optims = {k: OPTIMIZERS[opt_name](m.parameters()) for k, m in models.items()}
    num_steps = []
    optims["disk"].register_step_post_hook(lambda *args: num_steps.append(1))
    directory = models["disk"]._config.disk.directory
    assert os.path.dirname(directory) == base and f"rank{rank}" in directory, directory
    files = _disk_files(models["disk"])
    for step in range(
        2
    ):  # the first step moves new optimizer state to files, the second reuses them
        x, y = rank_batch("lm", step, rank, world_size)
        losses = {k: loss_fn("lm", m(x), y) for k, m in models.items()}
        for loss in losses.values():
            loss.backward()
        what = f"rank {rank} step {step} ({strategy_name}, {opt_name})"
        # Read before any comparison below touches (and so maps) the files again.
        assert _resident_kib(directory) == 0, f"{what}: file pages resident after backward"
        assert_close(losses["disk"], losses["memory"], what=f"{what} loss", rtol=0.0, atol=0.0)
        grads = {k: dict(m.named_parameters()) for k, m in models.items()}
        for name, p in grads["disk"].items():
            assert files[id(p)].holds("grad", local(p.grad)), f"{what} {name} grad"
            assert_close(
                local(p.grad), local(grads["memory"][name].grad), what=f"{what} grad {name}",
                rtol=0.0, atol=0.0,
            )  # fmt: skip
        optims["memory"].step()
        num_steps.clear()
        if by_unit:
            disk_offload.step(models["disk"], optims["disk"])
        else:
            optims["disk"].step()
        num_units = len(FSDP.fsdp_modules(models["disk"])) if by_unit else 1
        assert len(num_steps) == num_units, f"{what}: {len(num_steps)} optimizer steps"
        for optim in optims.values():
            optim.zero_grad()
        assert _resident_kib(directory) == 0, f"{what}: file pages resident after the step"
        params = {k: dict(m.named_parameters()) for k, m in models.items()}
        for name, p in params["disk"].items():
            assert files[id(p)].holds("param", local(p)), f"{what} {name} param"
            assert_close(
                local(p).detach(), local(params["memory"][name]).detach(),
                what=f"{what} param {name}", rtol=0.0, atol=0.0,
            )  # fmt: skip
            state = optims["disk"].state[p]
            for key, value in state.items():
                if value.numel() == p.numel() and local(value).numel() > 0:
                    assert files[id(p)].holds(f"state.{key}", local(value)), key
                    want = optims["memory"].state[params["memory"][name]][key]
                    assert_close(
                        local(value), local(want), what=f"{what} {name} {key}", rtol=0.0, atol=0.0
                    )
        models["disk"]._config.disk.release()  # the reads above mapped the pages again
    disk_offload.close(models["disk"])
    assert not os.path.exists(directory), "close() removes the directory"


@pytest.mark.parametrize(
    ("strategy_name", "opt_name", "by_unit"),
    [("FULL_SHARD", "adamw", True), ("SHARD_GRAD_OP", "sgd_momentum", False)],
    ids=["FULL_SHARD-adamw-step_by_unit", "SHARD_GRAD_OP-sgd_momentum-optim_step"],
)
def test_disk_offload_trains_bitwise_like_cpu_offload_with_pages_released(
    tmp_path, strategy_name, opt_name, by_unit
):
    base = tmp_path / "offload"
    base.mkdir()
    args = (strategy_name, opt_name, by_unit, str(base))
    run_ranks(_parity_rank, 2, tmp_path, args=args, timeout=120)
    assert list(base.iterdir()) == []


def _bad_input_rank(rank: int, world_size: int, base: str) -> None:
    not_a_dir = os.path.join(base, "file")
    open(not_a_dir, "w").close()
    cases = [
        (dict(offload_dir=os.path.join(base, "missing")), ValueError, "does not exist"),
        (dict(offload_dir=not_a_dir), ValueError, "is not a directory"),
        (dict(offload_dir="/sys"), ValueError, "cannot create"),
        (dict(offload_dir=3), TypeError, "must be a path"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            FSDP(build_model("mlp"), cpu_offload=CPUOffload(offload_params=True, **kwargs))
    with pytest.raises(ValueError, match="needs offload_params=True"):
        FSDP(build_model("mlp"), cpu_offload=CPUOffload(offload_dir=base))
    with pytest.raises(NotImplementedError, match="NO_SHARD"):
        FSDP(
            build_model("mlp"),
            sharding_strategy=ShardingStrategy.NO_SHARD,
            cpu_offload=CPUOffload(offload_params=True, offload_dir=base),
        )
    assert os.listdir(base) == ["file"], "a rejected config leaves no directory"


def test_bad_offload_dir_is_rejected_before_any_collective(tmp_path):
    # One rank: an error that came after a collective would still be raised, so also check that
    # nothing was created; the checks run in _make_config, which runs no collective.
    base = tmp_path / "offload"
    base.mkdir()
    run_ranks(_bad_input_rank, 1, tmp_path, timeout=60, args=(str(base),))


def train_alone(base: str, rendezvous: str, crash: bool) -> None:
    """One rank trains a step with disk offload, then exits normally or dies without clean-up."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    model = FSDP(
        build_model("lm"),
        auto_wrap_policy=POLICIES["lm"],
        cpu_offload=CPUOffload(offload_params=True, offload_dir=base),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = rank_batch("lm", 0, 0, 1)
    loss_fn("lm", model(x), y).backward()
    optim.step()
    if crash:
        os._exit(1)  # no atexit, no finalizers: what a kill leaves


def _run_alone(base: Path, tmp_path: Path, crash: bool) -> subprocess.CompletedProcess:
    code = (
        "import sys; from tests.test_disk_offload import train_alone; "
        "train_alone(sys.argv[1], sys.argv[2], sys.argv[3] == 'crash')"
    )
    rendezvous = tmp_path / f"rendezvous-{'crash' if crash else 'exit'}"
    return subprocess.run(
        [sys.executable, "-c", code, str(base), str(rendezvous), "crash" if crash else "exit"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_files_are_removed_at_exit_and_a_crashed_runs_files_are_never_read(tmp_path):
    base = tmp_path / "offload"
    base.mkdir()
    crashed = _run_alone(base, tmp_path, crash=True)
    assert crashed.returncode == 1, crashed.stderr
    (stale,) = base.iterdir()
    assert any(stale.iterdir()), "the crashed run left its files"
    finished = _run_alone(base, tmp_path, crash=False)
    assert finished.returncode == 0, finished.stderr
    # The second run made its own directory (never opening the stale files), removed the
    # stale one because its pid is dead, and removed its own at exit.
    assert list(base.iterdir()) == []
