"""The one multi-process launcher for tests: run a function on N gloo ranks and collect results.

Each rank is a new process, forked from a clean forkserver that has imported torch and fsdp_lite
and nothing of the test, so `fn` is pickled by name as under "spawn". It joins a gloo process group
through a file rendezvous in the test's tmp_path (no TCP ports), runs `fn(rank, world_size, *args)`
and sends back the return value.
The parent turns a failure, hang or silent death into one AssertionError that names its cause (a
rank that died silently, else the rank that raised first, then the others in a line each), and
always kills and reaps every rank before returning.
"""

from __future__ import annotations

import datetime
import faulthandler
import math
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

# "forkserver", not "spawn": the server pays `import torch` and `import fsdp_lite` once per pytest
# session, not each rank at each launch. A 2-rank launch of a function that does nothing took
# ~3.5 s under spawn, 1.55 s with torch alone preloaded, 0.22 s with fsdp_lite too (2 cores,
# 2026-12-04, when fsdp_lite's import also paid for dynamo's: 1.3 s). Importing fsdp_lite starts
# no thread (test_ranks.py). Children still start from a process that never ran test code, so the
# rules are spawn's: fn is module-level, args and results pickle. Unlike spawn, os.environ changes
# made after the first launch don't reach the ranks, and ranks write to the stdout/stderr the
# server was started with: pytest's session-wide capture (shown per test), never a test's capfd.
_START_METHOD = "forkserver"
_PRELOAD = ["torch", "torch.distributed", "fsdp_lite"]

# A hung rank is sent this signal before it is killed, so its Python stack lands in captured stderr.
_DUMP_STACK_SIGNAL = signal.SIGUSR1

# After the first failure, seconds to wait for the other ranks' reports before naming the cause.
_FAILURE_GRACE = 5.0


class RankFailure(AssertionError):
    """A rank raised, or exited without reporting a result."""


class RankTimeout(AssertionError):
    """Some ranks were still running when run_ranks' timeout ran out."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | os.PathLike,
    *,
    timeout: float = 120.0,
    args: tuple = (),
    backend: str = "gloo",
    in_step: bool = True,
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks, each in its own process.

    Args:
        fn: a module-level function (each rank imports it by name); its return value must
            pickle.
        world_size: number of ranks.
        tmp_path: a directory for the file rendezvous, usually pytest's `tmp_path`.
        timeout: seconds for the whole run, process start-up included (the first call of a
            session starts the forkserver and imports torch: about 3 s). Default 120.
        args: extra positional arguments for `fn`; must pickle.
        backend: the process group's backend; "nccl" for the gpu-marked tests.
        in_step: True: the ranks' collectives match when fn returns, and they leave through
            one last collective (fsdp_lite.tools.launch.leave_together); False for a test whose
            ranks diverge on purpose, where that collective would wait for the timeout.

    Returns:
        fn's return values, indexed by rank.

    Raises:
        RankFailure: a rank that died silently, else the first rank to raise, with its
            traceback; the ranks that failed after it, a line each.
        RankTimeout: ranks still running after `timeout` seconds.
    """
    ctx = get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect only when the server starts
    # A fresh file per call: a rank killed mid-run leaves its rendezvous file behind, and a second
    # call in the same tmp_path must not join that stale store.
    init_method = f"file://{Path(tmp_path).resolve()}/rendezvous-{uuid.uuid4().hex}"
    # Short, so a rank whose peer died fails in gloo before our own timeout fires and gets a
    # traceback; the dead peer is still the one named.
    pg_timeout = datetime.timedelta(seconds=min(timeout, 60.0))
    deadline = time.monotonic() + timeout

    procs = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    init_method,
                    pg_timeout,
                    send_conn,
                    backend,
                    in_step,
                ),
                name=f"rank{rank}",
            )
            proc.start()
            # Drop our copy of the write end, so recv() sees EOF once the child is gone.
            send_conn.close()
            procs.append(proc)
            conns[recv_conn] = rank

        results: dict[int, Any] = {}
        # (silent death first, then the earliest raise; rank) -> message. One rank's failure makes
        # its peers fail in their next collective, and their reports can reach us first: we wait a
        # moment for the others and name the cause, not the first report.
        failures: dict[tuple[float, int], str] = {}
        grace_end = math.inf
        pending = dict(conns)
        while pending:
            limit = min(deadline, grace_end)
            ready = wait(list(pending), timeout=max(limit - time.monotonic(), 0.0))
            if not ready:
                if failures:
                    break
                _raise_timeout(procs, sorted(pending.values()), world_size, timeout)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload, raised_at = conn.recv()
                except EOFError:
                    # The pipe only closes without a message when the process is gone.
                    procs[rank].join(timeout=5)
                    failures[(-math.inf, rank)] = (
                        f"rank {rank} of {world_size} exited without reporting a result: "
                        f"{_describe_exit(procs[rank].exitcode)}; anything it wrote is in the "
                        f"captured stderr"
                    )
                else:
                    if status == "ok":
                        results[rank] = payload
                        continue
                    failures[(raised_at, rank)] = f"rank {rank} of {world_size} failed:\n{payload}"
                if len(failures) == 1:
                    grace_end = time.monotonic() + _FAILURE_GRACE
        if failures:
            cause, *after = (failures[key] for key in sorted(failures))
            if after:
                cause += "\nthen:\n" + "\n".join(
                    f"  {m.splitlines()[0]} {m.strip().splitlines()[-1]}" for m in after
                )
            raise RankFailure(cause)

        # Every rank has reported; give them a moment to exit cleanly before the finally kills them.
        for proc in procs:
            proc.join(timeout=10.0)
        return [results[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join()  # reaps it: no zombies
            proc.close()
        for conn in conns:
            conn.close()


def run_checks(checks: dict, names: list[str], *args) -> dict[str, str]:
    """Inside a rank: run ``checks[name](*args)`` for each name, one failing not hiding the
    others (a barrier after each keeps the ranks together); the tracebacks of those that failed,
    by name."""
    import torch.distributed as dist

    failures = {}
    for name in names:
        try:
            checks[name](*args)
        except Exception:  # noqa: BLE001 - every check reports
            failures[name] = traceback.format_exc()
        dist.barrier()
    return failures


def _raise_timeout(procs: list, running: list[int], world_size: int, timeout: float) -> None:
    for rank in running:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, _DUMP_STACK_SIGNAL)
    time.sleep(1.0)  # let faulthandler write the stacks before the kill
    names = ", ".join(f"rank {rank}" for rank in running)
    raise RankTimeout(
        f"{names} of {world_size} still running after {timeout:g} s; all ranks killed. "
        f"Their Python stacks are in the captured stderr."
    )


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
    return f"exit code {exitcode}"


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    init_method: str,
    pg_timeout: datetime.timedelta,
    conn: Connection,
    backend: str = "gloo",
    in_step: bool = True,
) -> None:
    """Body of one rank: set up, run fn, report exactly one message on conn."""
    faulthandler.register(_DUMP_STACK_SIGNAL, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        from fsdp_lite.tools.launch import leave_together

        # Several ranks share 2 cores: more intra-op threads per rank only oversubscribe them.
        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=pg_timeout,
        )
        result = fn(rank, world_size, *args)
        if in_step:
            leave_together()
        dist.destroy_process_group()
        # Pickle errors surface here, inside the try, and are reported like any other failure.
        conn.send(("ok", result, None))
    except BaseException:
        # BaseException too: pytest.fail / skip and SystemExit in a rank must not look like a crash.
        # CLOCK_MONOTONIC is one clock for every process on the machine: the parent orders by it.
        conn.send(("error", traceback.format_exc(), time.monotonic()))
    finally:
        conn.close()
