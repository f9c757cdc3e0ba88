"""Disk offload (ZeRO-Infinity, arXiv 2104.07857): shards, grads and optimizer state in files.

With ``CPUOffload(offload_params=True, offload_dir=PATH)`` every sharded param, its gradient and
the optimizer's per-parameter state live in memory-mapped files in a directory of this rank's own
under ``PATH``. The engine reads a shard only to copy it into ``all_gather_input`` and the
optimizer step reads and writes all three; after each use the pages are handed back to the kernel
(see Note [Residency, not copies]). This file owns the files, the directory and the optimizer
hooks; unit.py and param.py call it at four points (see offload.py).

Note [Residency, not copies]: each tensor is a ``MAP_SHARED`` mapping of its own file, so it keeps
one address for its whole life and every reader (state dicts, summon_full_params, clip_grad_norm_,
the optimizer) works on it unchanged. Touched pages count in this process's RSS (``RssFile``) until
``madvise(MADV_DONTNEED)`` unmaps them; on a shared file mapping that keeps the data (dirty pages go
to the page cache and the kernel writes them back), and the next touch faults them in again.
``MADV_WILLNEED`` starts the kernel's read-ahead without mapping anything, which is how the next
unit's shards are prefetched. Correctness never depends on either call: both are residency hints.

Note [Stepping unit by unit]: an optimizer's ``step()`` touches every parameter, grad and state
tensor before the post-step hook can drop any page, so the peak RSS of a plain step holds all of
them. ``step(optimizer)`` calls ``optimizer.step()`` once per unit with each param group cut down
to that unit's parameters, so at most one unit's pages are mapped at a time. Each parameter's
update is the same arithmetic on the same state (Adam's ``step`` count is per parameter), so the
result is bitwise the same; optimizers that combine parameters (LBFGS) must use a plain step.

Note [Files a crash leaves behind]: each rank writes into a new directory named after the host, the
pid and a random suffix, and only ever opens files it created there, so stale files are never read.
Beside it, ``<directory>.lock`` is created first and held with ``flock`` for the store's life; the
kernel drops that lock when the process ends, however it ends. The directory is removed by
``close(model)`` or at normal interpreter exit; on start a store also removes the directories of
this host name whose lock it can take at once, so their owner is gone. PID liveness is not used:
``os.kill(pid, 0)`` cannot see a process in another PID namespace (a container sharing the disk
and the host name), whose live files it would have deleted.

Note [One run per directory]: a second run pointed at a directory a live run of this host name
uses is refused (ValueError naming both): two runs there would share its free space, which
each checked alone, and one's clean-up would race the other's start. The ranks of one run are
told apart from another run's by a job token in the directory's name, the same on every rank:
the first rank to ask sets it in the default process group's store (``construct.job_token``).
Stores of this process are never "another run" (a process may make a new process group).
Clean-up, the new directory and the check run with ``base`` itself locked, one store at a time,
so that of two runs starting together the later sees the earlier, and a rank removing a dead
run's directory (holding its lock) is never taken for a live run. Runs sharing a disk give each
its own directory.

Note [Space first]: every file is reserved with ``posix_fallocate`` when it is made, so a disk
that fills later never fails a write. Two moments make many files: wrapping (the shards, and
their grads, reserved with them) and the first optimizer step (its state). Before each, the
bytes all of them need are compared with the free space, and a shortfall raises ENOSPC naming the
directory, the bytes needed and the bytes free, before the first of them is written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import resource
import shutil
import socket
import uuid
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fsdp_lite.engine.offload import with_local

__all__ = ["DiskStore", "ParamFiles", "check_offload_dir", "close", "step"]

# Host names have "-" replaced by "_". Directories made before runs carried a job token lack it.
_DIR_RE = re.compile(
    r"^fsdp_lite-(?P<host>[^-]+)-(?:job(?P<job>[0-9a-f]{8})-)?pid(?P<pid>\d+)-rank\d+-[0-9a-f]{8}$"
)
_LIVE: weakref.WeakSet[DiskStore] = weakref.WeakSet()  # this process's stores


def check_offload_dir(path: str | os.PathLike) -> str:
    """``path`` as an absolute directory this process can create files in, or a ValueError."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"CPUOffload.offload_dir must be a path, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"CPUOffload.offload_dir {path!r} does not exist or is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"CPUOffload.offload_dir {path!r} is not writable")
    return path


class _MappedFile:
    """One file of ``numel`` elements and the tensor that maps it; lives until its owner does."""

    def __init__(self, path: str, numel: int, dtype: torch.dtype) -> None:
        nbytes = numel * dtype.itemsize
        self.path = path
        self.mmap = None
        if nbytes == 0:  # mmap cannot map nothing; an empty shard has no pages to move anyway
            self.tensor = torch.empty(0, dtype=dtype)
            return
        fd = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # Reserve the blocks now: a full disk then fails here, not as SIGBUS on a page write.
            os.posix_fallocate(fd, 0, nbytes)
            self.mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        except OSError as e:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # the empty file this made
            directory, name = os.path.split(path)
            raise OSError(  # the same errno (ENOSPC ...), naming the file and the bytes
                e.errno,
                f"disk offload could not make {name} ({nbytes} bytes) in {directory}: "
                f"{_why(e, directory)}",
            ) from e
        finally:
            if fd is not None:
                os.close(fd)  # the mapping keeps the file open
        self.tensor = torch.frombuffer(self.mmap, dtype=dtype, count=numel)  # 1D, numel

    def release(self) -> None:
        if self.mmap is not None:
            self.mmap.madvise(mmap.MADV_DONTNEED)  # see Note [Residency, not copies]

    def prefetch(self) -> None:
        if self.mmap is not None:
            self.mmap.madvise(mmap.MADV_WILLNEED)


def _why(e: OSError, directory: str) -> str:
    """The OS's words, and what tells a full disk from a file size limit."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            why += f"; {shutil.disk_usage(directory).free} bytes are free there"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if e.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
        why += f"; this process may write files of at most {limit} bytes (ulimit -f)"
    return why


class ParamFiles:
    """The files of one sharded parameter: its shard, its grad and each optimizer state tensor."""

    def __init__(self, store: DiskStore, fqn: str, grads: bool) -> None:
        self.store = store
        self.grads = grads  # its grad file is reserved with its shard (Note [Space first])
        self.stem = f"{len(store.params):05d}-{re.sub(r'[^A-Za-z0-9_.]', '_', fqn) or 'param'}"
        self.files: dict[str, _MappedFile] = {}  # "param", "grad", "state.<key>" -> file
        self.unit_key: int | None = None  # which unit copies it in; set when the unit is built

    def new(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed file-backed 1D tensor for ``kind``, replacing any earlier one."""
        old = self.files.pop(kind, None)
        path = os.path.join(self.store.directory, f"{self.stem}.{kind}.{uuid.uuid4().hex[:6]}")
        if old is not None:  # e.g. a grad of another dtype; tensors still mapping it stay valid
            old.release()
            if old.mmap is not None:
                os.unlink(old.path)
        self.files[kind] = _MappedFile(path, numel, dtype)
        return self.files[kind].tensor

    def holds(self, kind: str, tensor: torch.Tensor) -> bool:
        f = self.files.get(kind)
        return f is not None and f.mmap is not None and f.tensor.data_ptr() == tensor.data_ptr()

    def move(self, kind: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a tensor or DTensor) copied into ``kind``'s file, same type and layout."""
        local = value.to_local() if isinstance(value, DTensor) else value
        f = self.files.get(kind)
        if f is None or f.tensor.numel() < local.numel() or f.tensor.dtype != local.dtype:
            flat = self.new(kind, local.numel(), local.dtype)
        else:  # e.g. the grad file reserved at the padded shard's size
            flat = f.tensor[: local.numel()]
        flat.copy_(local.reshape(-1))
        moved = flat.view(local.shape)
        return with_local(value, moved) if isinstance(value, DTensor) else moved

    def release(self) -> None:
        for f in self.files.values():
            f.release()

    def prefetch(self) -> None:
        for f in self.files.values():
            f.prefetch()


class DiskStore:
    """One rank's offload directory and the files of every parameter sharded into it.

    Made once per root wrapper (nested wrappers share it) and removed with it, or at exit.
    """

    directory: str

    def __init__(self, base: str, rank: int, job: str, needs: Iterable[int] = ()) -> None:
        with _one_at_a_time(base):
            self.directory, self._lock = _make_directory(base, rank, job, needs)
        _LIVE.add(self)
        self.params: list[ParamFiles] = []
        self.by_ptr: dict[int, ParamFiles] = {}  # data_ptr of a shard -> its files
        self._next: dict[tuple[int, str], list[ParamFiles]] = {}  # see after_copy_in
        self._last: tuple[int, str] | None = None
        self._state_space_checked = False
        me = weakref.ref(self)
        # The hooks hold the store weakly and do nothing once it is gone. Only close() removes
        # them: the finalizer may run in a collection inside optimizer.step(), while torch
        # iterates its dict of hooks, where removing one raises ("OrderedDict mutated during
        # iteration"). So a store dropped without close() leaves two empty hooks behind.
        self._hooks = [
            register_optimizer_step_pre_hook(
                lambda optim, args, kwargs: _call(me, "before_step", optim)
            ),
            register_optimizer_step_post_hook(
                lambda optim, args, kwargs: _call(me, "after_step", optim)
            ),
        ]
        self._finalizer = weakref.finalize(self, _remove, self.directory, self._lock)

    def new_param(self, fqn: str, grads: bool) -> ParamFiles:
        files = ParamFiles(self, fqn, grads)
        self.params.append(files)
        return files

    def new_shard(self, files: ParamFiles, numel: int, dtype: torch.dtype) -> torch.Tensor:
        shard = files.new("param", numel, dtype)
        if files.grads:
            files.new("grad", numel, dtype)
        if numel > 0:  # empty tensors share no address worth keying on
            self.by_ptr[shard.data_ptr()] = files
        return shard

    def release(self) -> None:
        """Drop every page of every file, e.g. after reading a state dict out of the shards."""
        for files in self.params:
            files.release()

    def close(self) -> None:
        """Remove the directory now (the mapped tensors stay valid until they are freed)."""
        for handle in self._hooks:
            handle.remove()
        self._finalizer()

    # ---- the step: forward and backward --------------------------------------------------------

    def after_copy_in(self, unit_key: int, files: list[ParamFiles], phase: str) -> None:
        """A unit's shards are in ``all_gather_input``: drop their pages, read ahead the next unit's.

        "Next" is the unit whose shards were copied in after this one (in this phase) the last
        time: the order of the previous step, which is this step's order.
        """
        key = (unit_key, phase)
        if self._last is not None:
            self._next[self._last] = files
        self._last = key
        for f in files:
            f.files["param"].release()
        for f in self._next.get(key, ()):
            f.files["param"].prefetch()

    def after_grads(self, params: Iterable[tuple[ParamFiles, torch.nn.Parameter]]) -> None:
        """Move freshly reduced grads into their files and drop their pages until the step."""
        for files, sharded_param in params:
            grad = sharded_param.grad
            if grad is None or grad.to_local().numel() == 0:
                continue
            if not files.holds("grad", grad.to_local()):
                sharded_param.grad = files.move("grad", grad)
            files.files["grad"].release()

    # ---- the step: optimizer -------------------------------------------------------------------

    def files_of(self, p: torch.Tensor) -> ParamFiles | None:
        """The files of an optimizer's parameter, if it is a shard of this store."""
        local = p.to_local() if isinstance(p, DTensor) else p
        files = self.by_ptr.get(local.data_ptr())
        return files if files is not None and files.holds("param", local) else None

    def _managed(self, optim: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, ParamFiles]]:
        found = []
        for group in optim.param_groups:
            for p in group["params"]:
                files = self.files_of(p)
                if files is not None:
                    found.append((p, files))
        return found

    def before_step(self, optim: torch.optim.Optimizer) -> None:
        for _, files in self._managed(optim):
            files.prefetch()

    def after_step(self, optim: torch.optim.Optimizer) -> None:
        """Move new optimizer state into files, then drop every page the step touched."""
        managed = self._managed(optim)
        moves = []
        for p, files in managed:
            state = optim.state.get(p, {})
            for key, value in list(state.items()):
                # Per-element state (exp_avg, momentum_buffer ...) goes to disk; scalars such as
                # Adam's step stay in memory.
                if not isinstance(value, torch.Tensor) or value.numel() != p.numel():
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                kind = f"state.{re.sub(r'[^A-Za-z0-9_]', '_', str(key))}"
                if local.numel() > 0 and not files.holds(kind, local):
                    moves.append((state, key, value, files, kind, local))
        if moves and not self._state_space_checked:
            self._check_state_space(moves)
        for state, key, value, files, kind, _ in moves:
            state[key] = files.move(kind, value)
        for _, files in managed:
            files.release()

    def _check_state_space(self, moves: list) -> None:
        """Before the first state file: room for every parameter's state, at the bytes per
        parameter element this step's new state takes (Note [Space first])."""
        kinds = {kind: local.element_size() for *_, kind, local in moves}  # e.g. exp_avg: 4
        stateless = [f for f in self.params if not any(k.startswith("state.") for k in f.files)]
        sizes = [f.files["param"].tensor.numel() for f in stateless if "param" in f.files]
        needed = _on_disk(self.directory, [n * b for n in sizes for b in kinds.values()])
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"disk offload needs {needed} bytes in {self.directory} for the optimizer's "
                f"state; {free} bytes are free there",
            )
        self._state_space_checked = True


def close(model: torch.nn.Module) -> None:
    """End disk offload for ``model`` (a wrapped root): remove this rank's directory now.

    Call it when training is over. The tensors already mapped stay readable (the files are
    unlinked, not unmapped), but no new file can be made, so do not train on afterwards. Without
    it the directory goes at normal interpreter exit.
    """
    _store_of(model, "close").close()


def _store_of(model: torch.nn.Module, caller: str) -> DiskStore:
    config = getattr(model, "_config", None)
    if config is None or config.disk is None:
        raise ValueError(f"{caller}() needs a FullyShardedDataParallel root made with offload_dir")
    return config.disk


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` one unit of ``model`` (a wrapped root) at a time.

    Only one unit's params, grads and optimizer state are then resident at once; see Note
    [Stepping unit by unit]. Parameters not under disk offload step together, last.
    """
    store = _store_of(model, "step")
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    chunks: dict[object, set[int]] = {}  # unit key (None: not on disk) -> param ids
    for params in saved:
        for p in params:
            files = store.files_of(p)
            unit = files.unit_key if files is not None else None
            chunks.setdefault(unit, set()).add(id(p))
    rest = chunks.pop(None, None)
    try:
        for chunk in [*chunks.values(), *([rest] if rest else [])]:
            for group, params in zip(groups, saved):
                group["params"] = [p for p in params if id(p) in chunk]
            optimizer.step()
    finally:
        for group, params in zip(groups, saved):
            group["params"] = params


def _call(store_ref: weakref.ref, method: str, optim: torch.optim.Optimizer) -> None:
    store = store_ref()
    if store is not None:
        getattr(store, method)(optim)


def _remove(directory: str, lock: int | None) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    if lock is not None:  # removed while held: no other process can take it and find the files
        with contextlib.suppress(OSError):
            os.unlink(f"{directory}.lock")
        os.close(lock)


def _take_lock(path: str, create: bool) -> int | None:
    """A descriptor of ``path`` holding its exclusive ``flock``, or None if another process holds
    it (or, without ``create``, the file is gone). ``create`` makes a new file, locked before it
    appears under its name, so that no clean-up can take the lock of a store being born."""
    if create:
        born = os.path.join(os.path.dirname(path), f".{uuid.uuid4().hex}.new")
        fd = os.open(born, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(born, path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(born)
            raise
        return fd
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


@contextlib.contextmanager
def _one_at_a_time(base: str) -> Iterator[None]:
    """``base`` locked (``flock`` on the directory itself) while a store cleans up, makes its
    directory and looks for another run: otherwise a rank that holds a dead run's lock to remove
    it looks live to a rank of its own job looking at the same moment."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def _make_directory(base: str, rank: int, job: str, needs: Iterable[int]) -> tuple[str, int]:
    """This store's directory in ``base`` and the descriptor holding its lock, after removing
    dead runs' directories and checking the space and that no other run uses ``base``."""
    host = socket.gethostname().replace("-", "_")
    _remove_stale_dirs(base, host)
    name = f"fsdp_lite-{host}-job{job}-pid{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
    directory = os.path.join(base, name)
    lock = None
    try:
        # The lock first: a directory is never seen without a held lock beside it.
        lock = _take_lock(f"{directory}.lock", create=True)
        os.mkdir(directory, 0o700)
    except OSError as e:
        if lock is not None:
            _remove(directory, lock)
        raise ValueError(f"CPUOffload.offload_dir {base!r}: cannot create {name}: {e}") from e
    needed, free = _on_disk(base, needs), shutil.disk_usage(base).free
    if needed > free:  # Note [Space first]
        _remove(directory, lock)
        raise OSError(
            errno.ENOSPC,
            f"disk offload needs {needed} bytes in {base} for this rank's shards and their "
            f"gradients; {free} bytes are free there",
        )
    other = _another_run(base, host, job, {store.directory for store in _LIVE} | {directory})
    if other is not None:
        _remove(directory, lock)
        raise ValueError(
            f"CPUOffload.offload_dir {base!r} is in use by another run on this host "
            f"({other} is live): give each run a directory of its own"
        )
    return directory, lock


def _on_disk(directory: str, sizes: Iterable[int]) -> int:
    """Bytes that files of ``sizes`` take in ``directory``: whole blocks each."""
    block = os.statvfs(directory).f_frsize
    return sum(-(-size // block) * block for size in sizes)


def _another_run(base: str, host: str, job: str, mine: set[str]) -> str | None:
    """The name of a live directory of this host name in ``base`` that another job made (its
    lock is held, its job token differs), or None. See Note [One run per directory]."""
    for name in sorted(os.listdir(base)):
        directory = name.removesuffix(".lock")
        match = _DIR_RE.match(directory)
        if directory == name or match is None or match["host"] != host or match["job"] == job:
            continue
        if os.path.join(base, directory) in mine:
            continue
        lock = _take_lock(os.path.join(base, name), create=False)
        if lock is None:
            if os.path.exists(os.path.join(base, name)):
                return directory  # held: its process lives
            continue
        os.close(lock)  # free: a crashed run's, which the next start removes
    return None


def _remove_stale_dirs(base: str, host: str) -> None:
    """Directories of this host name whose lock is free: their process is gone (a crash, a
    kill). See Note [Files a crash leaves behind]."""
    for name in os.listdir(base):
        directory = name.removesuffix(".lock")
        match = _DIR_RE.match(directory)
        if directory == name or match is None or match["host"] != host:
            continue  # each lock file names its directory; directories are reached through them
        lock = _take_lock(os.path.join(base, name), create=False)
        if lock is not None:
            _remove(os.path.join(base, directory), lock)
