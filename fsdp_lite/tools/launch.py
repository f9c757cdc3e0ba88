"""Start a ``python -m MODULE`` job on local ranks through torch's elastic launcher, as torchrun does,
and end a job's process group without torch's teardown abort (``leave_together``, ``distributed``).

The demo and the conformance suite both launch themselves this way when run without torchrun.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["distributed", "launch_module", "leave_together"]


def launch_module(module: str, argv: list[str], nproc: int) -> bool:
    """Run ``python -m module *argv`` on ``nproc`` local ranks; False if any rank failed.

    A failed rank's traceback has already been printed by the launcher when this returns.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{module.replace('.', '_')}_{uuid.uuid4().hex[:8]}",
        # Port 0: the c10d rendezvous binds a free port itself (what torchrun --standalone does).
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,  # a failed rank fails the job; a restart would only fail again
        monitor_interval=0.1,
    )
    # Ranks inherit the environment: one thread each, or N ranks fight over the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as e:
        print(f"{module}: a rank failed (its traceback is above)\n{e}", file=sys.stderr)
        return False
    return True


def leave_together(group: dist.ProcessGroup | None = None, patience_s: float = 10.0) -> None:
    """Wait for every rank, then for the backend's threads to let go of that last collective.

    Call it last, just before ``destroy_process_group()``. Two ways a finished job aborts at exit:
    a rank that tears gloo down while a peer still reads from it, and a backend thread that drops
    a finished collective's tensor while the interpreter shuts down. Dropping it takes the GIL to
    release the tensor's Python object; during ``Py_FinalizeEx`` CPython ends such a thread inside
    a noexcept destructor and the process dies with "terminate called without an active
    exception" (pytorch/pytorch#190489; a core: benchmarks/results/exit_abort_core_2026-12-02.txt).
    ``dist.barrier()`` alone is such a collective. So the last one is an all-reduce of a tensor
    held here, and this returns once torch's use count says the backend has dropped it.
    """
    backend = dist.get_backend(group)
    device = torch.device("cpu")
    if "gloo" not in backend and torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
    token = torch.zeros(1, device=device)
    dist.all_reduce(token, group=group)
    deadline = time.monotonic() + patience_s
    # Sleeping releases the GIL the backend thread needs to drop its reference.
    while token._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.01)  # a thread that has dropped its count may still be waiting for the GIL


@contextlib.contextmanager
def distributed(backend: str | None = None, **init_kwargs: Any) -> Iterator[dist.ProcessGroup]:
    """The default process group for the life of a ``with`` block, left so that the job exits
    cleanly: what a script under torchrun wraps its work in.

    On entry, ``init_process_group(backend, **init_kwargs)`` unless a group already exists (then
    it is used and left to its owner to destroy). On a normal exit every rank waits for the others
    and for the backend's threads (``leave_together``), then the group is destroyed: a script that
    only calls ``destroy_process_group()`` dies now and then with "terminate called without an
    active exception" after all its work (pytorch/pytorch#190489). When the block raises, the
    group is destroyed without that wait (the other ranks may never come) and the error goes on.

    Args:
        backend: as ``init_process_group``'s ("gloo", "nccl"...; None: torch's default).
        init_kwargs: the rest of ``init_process_group``'s arguments (``timeout``, ``device_id``...).

    Returns:
        The default process group (``dist.group.WORLD``).
    """
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, **init_kwargs)
    try:
        yield dist.group.WORLD
        leave_together()
    finally:
        if owned:
            dist.destroy_process_group()
