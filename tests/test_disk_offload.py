"""Disk offload (ZeRO-Infinity): shards, grads and optimizer state in memory-mapped files.

Parity is bitwise against in-memory CPU offload with the same strategy (the arithmetic is the
same; only where the bytes live differs). Residency is read from /proc/self/smaps: the pages of
the offload files must be unmapped between uses. Clean-up is checked in separate processes that
exit normally or die, or live on with a pid this namespace does not have (another container); a
full disk with RLIMIT_FSIZE on one rank, and with a small tmpfs where the test may mount one.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

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


def test_bad_offload_dir_is_rejected_before_the_model_is_compared(tmp_path):
    # One rank: check that nothing was created. The argument checks run in _make_config, which
    # runs no collective; the directory checks in the one all-gather that comes before the model
    # comparison, so that a directory missing on one rank fails every rank (the test below).
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
    stale, lock = sorted(base.iterdir())
    assert lock.name == f"{stale.name}.lock" and any(stale.iterdir()), "the crashed run's files"
    finished = _run_alone(base, tmp_path, crash=False)
    assert finished.returncode == 0, finished.stderr
    # The second run made its own directory (never opening the stale files), removed the
    # stale one because its lock was free (its process is gone), and removed its own at exit.
    assert list(base.iterdir()) == []


# ---- two jobs on one disk; a full disk (issue 24) ------------------------------------------------


def hold_a_store(base: str, rendezvous: str, pid: str) -> None:
    """A job in another PID namespace: its directory's name carries a pid this namespace lacks.
    It makes its store, says so, and keeps it until its stdin closes."""
    os.getpid = lambda: int(pid)  # what os.getpid() returns inside another PID namespace
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    model = FSDP(build_model("mlp"), cpu_offload=CPUOffload(offload_params=True, offload_dir=base))
    print(model._config.disk.directory, flush=True)
    sys.stdin.read()


def _unused_pid() -> int:
    """A pid no process of this namespace has: that of a child already reaped."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(child.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def test_a_second_run_on_a_live_runs_directory_is_refused_and_its_files_kept(tmp_path):
    """A live job in another PID namespace holds a store; a second run on the same directory is
    refused, naming it, and the first job's files stay; on a directory of its own on the same
    disk the second run trains (disk.py Note [One run per directory])."""
    base = tmp_path / "offload"
    base.mkdir()
    pid = _unused_pid()
    code = (
        "import sys; from tests.test_disk_offload import hold_a_store; "
        "hold_a_store(sys.argv[1], sys.argv[2], sys.argv[3])"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(base), str(tmp_path / "rendezvous-other"), str(pid)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        directory = Path(other.stdout.readline().strip())
        assert directory.is_dir() and f"pid{pid}-" in directory.name, other.stderr.read()
        files = sorted(p.name for p in directory.iterdir())
        assert files, "the other job's shards are in files"
        # The other's pid looks dead from here (os.kill(pid, 0) raises), which is what once made
        # the clean-up delete a live job's files; its lock says it lives.
        refused = _run_alone(base, tmp_path, crash=False)
        assert refused.returncode != 0
        last = refused.stderr.strip().splitlines()[-1].removeprefix("[rank0]: ")
        assert last == (
            f"ValueError: CPUOffload.offload_dir {str(base)!r} is in use by another run on this "
            f"host ({directory.name} is live): give each run a directory of its own"
        ), refused.stderr[-2000:]
        assert sorted(p.name for p in directory.iterdir()) == files, "a live job's files went"
        assert sorted(p.name for p in base.iterdir()) == [directory.name, f"{directory.name}.lock"]
        own = tmp_path / "offload-2"  # the same disk, a directory of its own
        own.mkdir()
        finished = _run_alone(own, tmp_path, crash=False)
        assert finished.returncode == 0, finished.stderr
    finally:
        other.communicate(timeout=60)  # closes its stdin: it ends normally
    assert other.returncode == 0, other.stderr
    assert list(base.iterdir()) == [] and list(own.iterdir()) == [], "each removed its own"


def _full_disk_rank(rank: int, world_size: int, bases: list[str], limits: list[int]) -> str:
    """Wrap with disk offload into ``bases[rank]``, writing files of at most ``limits[rank]``
    bytes (0: no limit)."""
    import resource
    import signal
    import time

    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limits[rank]:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits[rank], before[1]))
    start = time.monotonic()
    try:
        FSDP(
            build_model("lm"),
            auto_wrap_policy=POLICIES["lm"],
            cpu_offload=CPUOffload(offload_params=True, offload_dir=bases[rank]),
        )
    except Exception as e:  # noqa: BLE001 - the test reads it
        text = f"{type(e).__name__}: {e}"
    else:
        text = "no error"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
    assert time.monotonic() - start < 10, "a rank waited for the rank that failed"
    gc.collect()  # the half-built model's store removes its directory
    return text


def test_a_full_disk_while_wrapping_is_named_and_fails_every_rank(tmp_path):
    base = tmp_path / "offload"
    base.mkdir()
    # Only rank 1's disk is full: before, rank 0 went on into the first all-gather and waited
    # there until the process group's timeout (20 s here: run_ranks' timeout too).
    texts = run_ranks(_full_disk_rank, 2, tmp_path, args=([str(base)] * 2, [0, 1024]), timeout=20)
    assert texts[1].startswith("OSError: [Errno 27] disk offload could not make "), texts[1]
    for words in (f" bytes) in {base}/fsdp_lite-", "File too large", "at most 1024 bytes"):
        assert words in texts[1], texts[1]
    assert texts[0] == f"RuntimeError: wrapping failed on rank 1: {texts[1]}", texts[0]
    # An offload directory that rank 1 does not have (a per-node disk): the same.
    missing = tmp_path / "missing"
    texts = run_ranks(
        _full_disk_rank, 2, tmp_path, args=([str(base), str(missing)], [0, 0]), timeout=20
    )
    words = (
        f"ValueError: CPUOffload.offload_dir {str(missing)!r} does not exist or is not a directory"
    )
    assert texts == [f"RuntimeError: wrapping failed on rank 1: {words}", words], texts
    assert list(base.iterdir()) == [], "every directory made before the failure is gone"


def _resume_rank(
    rank: int, world_size: int, base: str, ckpt: str, start: int, kill_at: int
) -> tuple[list[str], dict[str, list]]:
    """AdamW steps ``start``..2 of the lm with disk offload, stepping unit by unit; from the
    checkpoint in ``ckpt`` when ``start`` > 0, saving one there after step 0. At step
    ``kill_at`` rank 1 is killed (SIGKILL) after its first unit's optimizer step."""
    import signal

    from fsdp_lite import checkpoint

    model = FSDP(
        build_model("lm"),
        auto_wrap_policy=POLICIES["lm"],
        cpu_offload=CPUOffload(offload_params=True, offload_dir=base),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    found = sorted(os.listdir(base))  # after wrapping: only live runs' directories
    if start > 0:
        checkpoint.load(model, optim, ckpt)
    for step in range(start, 3):
        x, y = rank_batch("lm", step, rank, world_size)
        loss_fn("lm", model(x), y).backward()
        if step == kill_at and rank == 1:
            optim.register_step_post_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
        disk_offload.step(model, optim)
        optim.zero_grad()
        if step == 0 and start == 0:
            checkpoint.save(model, optim, ckpt)
    state = {k: v.tolist() for k, v in model.state_dict().items()}  # exact: fp32 to float
    disk_offload.close(model)
    return found, state


def test_a_rank_killed_mid_step_leaves_files_the_next_start_removes_and_the_checkpoint_resumes(
    tmp_path,
):
    """Two ranks with disk offload save a checkpoint after step 0; rank 1 is killed inside step 1's
    optimizer step (run_ranks then kills rank 0, as torchrun does). The next start on the same
    directory removes both dead directories, loads the checkpoint and trains steps 1 and 2
    bitwise like a run that was never interrupted."""
    base, ckpt = tmp_path / "offload", tmp_path / "ckpt"
    base.mkdir()
    _, never_stopped = run_ranks(
        _resume_rank, 2, tmp_path, args=(str(base), str(tmp_path / "unused"), 0, -1)
    )[0]
    with pytest.raises(AssertionError, match="rank 1"):
        run_ranks(_resume_rank, 2, tmp_path, args=(str(base), str(ckpt), 0, 1), in_step=False)
    dead = sorted(p.name for p in base.iterdir())
    assert len(dead) == 4, dead  # two directories and their locks, files inside
    assert all(any((base / d).iterdir()) for d in dead if not d.endswith(".lock"))
    found, resumed = run_ranks(_resume_rank, 2, tmp_path, args=(str(base), str(ckpt), 1, -1))[0]
    assert not set(found) & set(dead), "the dead run's files are removed at the next start"
    assert list(base.iterdir()) == []
    assert resumed.keys() == never_stopped.keys()
    for name, value in never_stopped.items():
        assert resumed[name] == value, name


def _train_in_a_small_tmpfs(tmp_path: Path, size: int) -> str:
    """The last line ``train_alone`` prints when its offload directory is a tmpfs of ``size``
    bytes, in a mount namespace of its own (root only; skipped elsewhere)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    code = (
        "import sys; from tests.test_disk_offload import train_alone; "
        "train_alone(sys.argv[1], sys.argv[2], False)"
    )
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {mnt} && "
        f"exec {sys.executable} -c '{code}' {mnt} {tmp_path / 'rendezvous-enospc'}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "mount:" in done.stderr or "unshare:" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[-200:]}")
    assert done.returncode != 0, "the run fitted"
    # A rank that raised can still hit torch's teardown abort after its traceback
    # (pytorch/pytorch#190489, docs/engine.md): that line is torch's, the error is the one before.
    lines = [
        line
        for line in done.stderr.strip().splitlines()
        if line != "terminate called without an active exception"
    ]
    return lines[-1].removeprefix("[rank0]: ")


def _pages(params) -> int:
    """Bytes that one fp32 file per parameter takes on a tmpfs: whole 4 KiB pages each."""
    return sum(-(-p.numel() * 4 // 4096) * 4096 for p in params)


def test_a_disk_too_small_for_the_shards_is_named_before_the_first_file(tmp_path):
    """16 KiB: the lm's shards and grads (2 files a parameter, whole pages each) do not fit."""
    last = _train_in_a_small_tmpfs(tmp_path, 16 * 1024)
    needed = 2 * _pages(build_model("lm").parameters())  # 253952, as du counts the files
    assert last == (
        f"OSError: [Errno 28] disk offload needs {needed} bytes in {tmp_path / 'small'} for this "
        f"rank's shards and their gradients; {16 * 1024} bytes are free there"
    ), last


def test_a_disk_too_small_for_the_optimizer_state_is_named_before_the_first_state_file(tmp_path):
    """256 KiB: the shards and grads fit, AdamW's two states (as many pages again) do not; the
    check at the first step names the directory and the bytes."""
    last = _train_in_a_small_tmpfs(tmp_path, 256 * 1024)
    needed = 2 * _pages(build_model("lm").parameters())
    prefix = f"OSError: [Errno 28] disk offload needs {needed} bytes in {tmp_path / 'small'}/"
    assert last.startswith(prefix), last
    free = 256 * 1024 - needed
    assert last.endswith(f" for the optimizer's state; {free} bytes are free there"), last


def _dropped_store_rank(rank: int, world_size: int, base: str) -> list[str]:
    """A disk-offloaded model dropped without ``disk_offload.close``, collected inside the next
    model's ``optimizer.step()`` (a collection can run anywhere): the step goes on, and the dropped
    model's directory is removed."""
    offload = CPUOffload(offload_params=True, offload_dir=base)
    first = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"], cpu_offload=offload)
    first_directory = first._config.disk.directory
    gc.disable()  # the drop is collected inside the step below, not before

    def collect(*args) -> None:
        gc.collect()

    # Registered before the next model's hooks, so that torch's loop over the hooks goes on after
    # this one: the collection frees the dropped model and its store (whose finalizer removed
    # the store's hooks from that dict, before).
    collecting = register_optimizer_step_pre_hook(collect)
    try:
        cycle = [first]  # only the collector frees it, as any model in a reference cycle
        cycle.append(cycle)
        del first, cycle
        model = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"], cpu_offload=offload)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = rank_batch("lm", 0, rank, world_size)
        loss_fn("lm", model(x), y).backward()
        optim.step()
    finally:
        collecting.remove()
        gc.enable()
    assert not os.path.exists(first_directory), first_directory
    disk_offload.close(model)
    return sorted(os.listdir(base))


def test_a_dropped_store_collected_inside_an_optimizer_step_leaves_the_step_alone(tmp_path):
    base = tmp_path / "offload"
    base.mkdir()
    run_ranks(_dropped_store_rank, 2, tmp_path, args=(str(base),), timeout=60)
