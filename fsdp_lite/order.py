"""Collective-order checks: ranks that issue different collectives are named, not left to hang.

Every rank of a group must issue fsdp_lite's collectives in the same order; a unit skipped on one
rank (data-dependent control flow) breaks that, and the ranks then pair the wrong collectives: a
hang at best (until the process group's timeout, with gloo's bare "Timed out waiting"), wrong
gradients at worst.

Note [Collective order]: each process logs the collectives its units issue on each group
(``OrderLog``: kind, unit, phase, numel, step, in issue order). A wait that has not finished
after ``STALL_SECONDS`` publishes this rank's recent log to the default store, reads what its
peers published, and compares: the first position where two ranks' logs differ, or ranks stalled
waiting on different positions, is a divergence, and the waiting rank raises
``CollectiveOrderError`` naming the units, the phase, the step and the ranks on each side. Every
stalled rank does the same, so all raise, seconds after the divergence instead of at the
timeout. A slow peer is no divergence: the logs agree, and the wait goes on. Cost: a wait that is
not done at once hands the blocking ``Work.wait()`` to a helper thread and sleeps on an event
(CPU tensors only: an accelerator's ``wait`` queues on a stream and must not block the host); a
store round trip per stalled second.
Where a gather or reduce-scatter goes by sends (gloo, CPU), each unit's messages carry a tag of
their own (``collectives.p2p_tag``), so two ranks on different units stall at once instead of
pairing: same-size units would exchange the wrong rows, different sizes abort the process in
gloo. Not caught: a divergence among the backend's own collectives that pairs up completely
(same count and sizes), and ranks that stall outside fsdp_lite's collectives.

The logs are process-wide, one per group: a group's collectives are ordered per process,
whichever root's runtime issues them (two pipeline stages on one rank share their dp group).
"""

from __future__ import annotations

import atexit
import collections
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch.distributed as dist

__all__ = [
    "STALL_SECONDS",
    "CollectiveError",
    "CollectiveOrderError",
    "OrderLog",
    "log_for",
    "wait",
]

STALL_SECONDS = 1.0  # a wait this long compares the ranks' logs, and again each second after
LINGER_SECONDS = 3.0  # how long a rank that found a divergence waits for its peers to find it
KEEP = 512  # entries each log keeps and publishes: more than a few steps of a large model
_VERBS = {
    "all_gather": "all-gathered",
    "reduce_scatter": "reduce-scattered",
    "all_reduce": "all-reduced",
}


class CollectiveError(RuntimeError):
    """A unit's collective failed; the message says which, where in the step, and with whom."""


class CollectiveOrderError(CollectiveError):
    """Ranks issued different collectives; the message names what each did."""


@dataclass(frozen=True)
class Issued:
    """One collective this rank issued on a group: its position and what it was."""

    seq: int  # position in this process's log of the group, from 0
    step: int
    kind: str
    unit: str
    phase: str
    numel: int

    def what(self) -> tuple:
        return (self.kind, self.unit, self.phase, self.numel)

    def describe(self) -> str:
        return (
            f"{_VERBS.get(self.kind, self.kind)} unit {self.unit or '<root>'!r} in {self.phase} "
            f"of step {self.step} ({self.numel} elements)"
        )


class OrderLog:
    """The collectives this process issued on one group, in issue order (the last ``KEEP``)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks  # the group's global ranks
        self.count = 0
        self.entries: collections.deque[Issued] = collections.deque(maxlen=KEEP)

    def issued(self, step: int, kind: str, unit: str, phase: str, numel: int) -> int:
        """Log one collective; returns its position (what a wait on it passes to ``stalled``)."""
        self.entries.append(Issued(self.count, step, kind, unit, phase, numel))
        self.count += 1
        return self.count - 1

    def stalled(self, waiting_on: int) -> None:
        """A wait on position ``waiting_on`` is taking long: compare with the peers' logs.

        Raises:
            CollectiveOrderError: the ranks' logs show they diverged.
        """
        store = _default_store()
        if store is None:
            return
        me = dist.get_rank()
        mine = {"waiting_on": waiting_on, "entries": [asdict(e) for e in self.entries]}
        logs = {me: mine}
        try:
            store.set(self._key(me), json.dumps(mine))
            for rank in self.ranks:
                if rank != me and store.check([self._key(rank)]):
                    logs[rank] = json.loads(store.get(self._key(rank)))
        except RuntimeError:  # the store went with a dead rank: nothing to compare
            return
        message = diverged(self.ranks, logs)
        if message is not None:
            self._linger(store, me)
            raise CollectiveOrderError(message)

    def _linger(self, store: dist.Store, me: int) -> None:
        """Before raising (and likely exiting, which may take the store along), give the peers
        up to ``LINGER_SECONDS`` to read this rank's log and find the divergence themselves."""
        try:
            store.set(self._key(me, "found"), "1")
            deadline = time.monotonic() + LINGER_SECONDS
            others = [self._key(r, "found") for r in self.ranks if r != me]
            while time.monotonic() < deadline and not all(store.check([k]) for k in others):
                time.sleep(0.05)
        except RuntimeError:
            pass

    def _key(self, rank: int, what: str = "log") -> str:
        return f"fsdp_lite/order/{'-'.join(map(str, self.ranks))}/{rank}/{what}"


def diverged(ranks: Sequence[int], logs: dict[int, dict]) -> str | None:
    """The divergence the published ``logs`` (rank -> {"waiting_on", "entries"}) show, as an
    error message; None where they agree as far as they go."""
    by_rank = {r: {e["seq"]: Issued(**e) for e in log["entries"]} for r, log in logs.items()}
    shared = sorted(set.union(*(set(entries) for entries in by_rank.values())))
    for seq in shared:
        at = {r: entries[seq] for r, entries in by_rank.items() if seq in entries}
        if len({e.what() for e in at.values()}) > 1:
            return _message(ranks, seq, at)
    # The same history, but every group rank waits, and not all on the same collective.
    waiting = {r: log["waiting_on"] for r, log in logs.items()}
    if set(waiting) == set(ranks) and len(set(waiting.values())) > 1:
        at = {r: by_rank[r][seq] for r, seq in waiting.items() if seq in by_rank[r]}
        lines = [f"rank {r} waits on collective {seq}" for r, seq in sorted(waiting.items())]
        return (
            f"fsdp_lite: ranks {list(ranks)} wait on different collectives: "
            + "; ".join(
                f"{line} ({at[r].describe()})" if r in at else line
                for line, r in zip(lines, sorted(waiting))
            )
            + _ADVICE
        )
    return None


_ADVICE = (
    ". Every rank must run the same units in the same order: a unit skipped or added on some "
    "ranks only (data-dependent control flow) desynchronizes the collectives"
)


def _message(ranks: Sequence[int], seq: int, at: dict[int, Issued]) -> str:
    sides: dict[tuple, list[int]] = {}
    for rank, entry in sorted(at.items()):
        sides.setdefault(entry.what(), []).append(rank)
    parts = []
    for group_ranks in sides.values():
        entry = at[group_ranks[0]]
        who = "rank" if len(group_ranks) == 1 else "ranks"
        parts.append(f"{who} {', '.join(map(str, group_ranks))} {entry.describe()}")
    return (
        f"fsdp_lite: ranks diverged at collective {seq} of group {list(ranks)}: "
        + "; ".join(parts)
        + _ADVICE
    )


def _default_store() -> dist.Store | None:
    # The rendezvous store every rank already shares; no collective, so it works while the
    # group's collectives are stuck.
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


_LOGS: dict[tuple[int, ...], OrderLog] = {}


def log_for(group: dist.ProcessGroup) -> OrderLog:
    """This process's log of ``group`` (see the module docstring for why it is process-wide)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _LOGS:
        _LOGS[ranks] = OrderLog(ranks)
    return _LOGS[ranks]


def wait(works: Sequence[dist.Work], on_stall: Callable[[], None]) -> None:
    """``work.wait()`` each of ``works``, calling ``on_stall()`` each ``STALL_SECONDS`` they are
    not done. A failed work's error is raised here, after one more ``on_stall()``: a peer that
    found the ranks diverged publishes its log, raises and exits, and the connection it closes
    fails this wait; the check then names the divergence here too."""
    try:
        if all(work.is_completed() for work in works):
            for work in works:
                work.wait()
            return
        _WAITER.wait(works, on_stall)
    except CollectiveOrderError:
        raise
    except RuntimeError:
        on_stall()  # raises CollectiveOrderError (chained to the failure) if the ranks diverged
        raise


class _Waiter:
    """A daemon thread that blocks in ``Work.wait()`` for the calling thread, which wakes each
    ``STALL_SECONDS`` meanwhile: gloo's point-to-point works report ``is_completed()`` only
    after a ``wait()``, so polling cannot tell a slow collective from a stuck one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait(self, works: Sequence[dist.Work], on_stall: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="fsdp_lite-waiter", daemon=True)
            self._thread.start()
        done, failure = threading.Event(), []
        self._jobs.put((works, done, failure))
        while not done.wait(STALL_SECONDS):
            on_stall()
        if failure:
            raise failure[0]

    def stop(self) -> None:
        """End the thread (at interpreter exit: no thread of ours is left in finalization)."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            works, done, failure = job
            try:
                _wait_each(works)
            except BaseException as e:  # handed to the waiting thread, which raises it
                failure.append(e)
            # Dropped before the waiter wakes: a work holds its tensors (a unit's whole buffer),
            # which would otherwise stay alive until the next job.
            del works
            done.set()
            del done, failure


def _wait_each(works: Sequence[dist.Work]) -> None:
    for work in works:  # in a function of its own: no loop variable outlives the wait
        work.wait()


_WAITER = _Waiter()
atexit.register(_WAITER.stop)
