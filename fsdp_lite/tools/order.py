"""Collective-order checks: ranks that issue different collectives are named, not left to hang.

The check is an observer of the units (engine/observe.py): ``OrderCheck.issued`` logs each
collective and takes its wait over on CPU; the fronts attach it to every unit they build, and
``set_collective_order_check`` takes it off or puts it back.

Every rank of a group must issue fsdp_lite's collectives in the same order; a unit skipped on one
rank (data-dependent control flow) breaks that, and the ranks then pair the wrong collectives: a
hang at best (until the process group's timeout, with gloo's bare "Timed out waiting"), wrong
gradients at worst.

Note [Collective order]: each process logs the collectives its units issue on each group
(``OrderLog``: kind, unit, phase, numel, step, in issue order). A wait that has not finished
after ``STALL_SECONDS`` publishes this rank's recent log to the default store, reads what its
peers published, and compares: the first position where two ranks' logs differ, or ranks stalled
waiting on different positions, is a divergence, and the waiting rank raises
``CollectiveOrderError`` naming the units, the phase, the step and the ranks on each side. A
slow peer is no divergence: the logs agree, and the wait goes on.

Note [Watched and direct waits]: comparing while a wait blocks needs the wait in a helper thread
(gloo's point-to-point ``wait`` cannot time out without closing the connection), and that
hand-off costs 1% to 3% of a step on a busy CPU. So only collectives at positions this rank has
not been to are *watched*: each step's sequence is remembered as the hashes of its prefixes, and
a collective whose prefix (this step's collectives so far, this one included) was not in one of
the last ``SCHEDULES`` completed steps is waited on through the helper. Every other wait is
*direct*, in the calling thread, while a watchdog thread publishes the log of any direct wait
stalled for ``STALL_SECONDS`` (the helper thread does both jobs: it is idle during a direct
wait), so that watching peers can compare against it. Why that finds
divergences: if every rank repeats a sequence that it completed before, and the ranks' choices
agree (they did last time), the collectives pair as they did. A rank that does something new (a
unit skipped by data-dependent control flow, ``state_dict()`` on one rank only, the first
steps) watches: it finds the divergence against its peers' published logs, raises and exits,
and the direct waits of its peers then fail on the closed connection and name the divergence
from its log. Not caught within seconds, only when the process group's timeout fails the waits
(then named the same way): ranks that each repeat a sequence they completed before, but
different ones (two kinds of step, chosen differently across ranks). Accelerator waits are always
direct and not watched: an accelerator's ``wait`` queues on a stream and must not block the
host.
Where a gather or reduce-scatter goes by sends (gloo, CPU), each unit's messages carry a tag of
their own (``collectives.p2p_tag``), so two ranks on different units stall at once instead of
pairing: same-size units would exchange the wrong rows, different sizes abort the process in
gloo. Not caught: a divergence among the backend's own collectives that pairs up completely
(same count and sizes), and ranks that stall outside fsdp_lite's collectives.

The logs are process-wide, one per group: a group's collectives are ordered per process,
whichever root's runtime issues them (two pipeline stages on one rank share their dp group). So
there is one ``OrderCheck`` per process, ``CHECK``, which owns the logs and the helper thread and
ends the thread at interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch.distributed as dist
import torch.nn as nn

from fsdp_lite.engine.collectives import CollectiveError, wait_each
from fsdp_lite.engine.observe import Collective, Observer
from fsdp_lite.engine.unit import unit_owners

__all__ = [
    "CHECK",
    "STALL_SECONDS",
    "CollectiveOrderError",
    "OrderCheck",
    "OrderLog",
    "Stall",
    "log_for",
    "set_collective_order_check",
    "wait",
]

STALL_SECONDS = 1.0  # a wait this long compares the ranks' logs, and again each second after
LINGER_SECONDS = 3.0  # how long a rank that found a divergence waits for its peers to find it
KEEP = 512  # entries each log keeps and publishes: more than a few steps of a large model
SCHEDULES = 4  # completed steps' sequences remembered (Note [Watched and direct waits])
_VERBS = {
    "all_gather": "all-gathered",
    "reduce_scatter": "reduce-scattered",
    "all_reduce": "all-reduced",
}


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


class Stall:
    """What a wait on one logged collective calls while it stalls (``wait``); ``watch``: wait
    through the helper thread (Note [Watched and direct waits])."""

    __slots__ = ("log", "published", "seq", "watch")

    def __init__(self, log: OrderLog, seq: int, watch: bool) -> None:
        self.log, self.seq, self.watch = log, seq, watch
        self.published = False

    def __call__(self) -> None:
        """Compare with the peers' logs; raises ``CollectiveOrderError`` on a divergence."""
        self.published = True
        self.log.stalled(self.seq, watching=self.watch)

    def publish(self) -> None:
        """Publish this rank's log for the peers to compare (a direct wait's watchdog)."""
        self.published = True
        self.log.publish(self.seq, watching=False)

    def done(self) -> None:
        """The wait returned: a published log no longer says what this rank waits on."""
        if self.published:
            self.log.withdraw()


class OrderLog:
    """The collectives this process issued on one group, in issue order (the last ``KEEP``)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks  # the group's global ranks
        self.count = 0
        self.entries: collections.deque[Issued] = collections.deque(maxlen=KEEP)
        # Note [Watched and direct waits]: this step's prefix hashes, and completed steps'.
        self._step: int | None = None
        self._prefix = 0
        self._this_step: list[int] = []
        self._schedules: collections.OrderedDict[int, frozenset[int]] = collections.OrderedDict()

    def issued(self, step: int, kind: str, unit: str, phase: str, numel: int) -> Stall:
        """Log one collective; returns what a wait on it calls while it stalls."""
        if step != self._step:
            self._complete_step()
            self._step = step
        self._prefix = hash((self._prefix, kind, unit, phase, numel))
        self._this_step.append(self._prefix)
        watch = not any(self._prefix in seen for seen in self._schedules.values())
        self.entries.append(Issued(self.count, step, kind, unit, phase, numel))
        self.count += 1
        return Stall(self, self.count - 1, watch)

    def _complete_step(self) -> None:
        """The step before this one is over, every wait of it returned: remember its sequence."""
        if self._this_step:
            self._schedules[self._prefix] = frozenset(self._this_step)
            self._schedules.move_to_end(self._prefix)
            while len(self._schedules) > SCHEDULES:
                self._schedules.popitem(last=False)
        self._prefix, self._this_step = 0, []

    def publish(self, waiting_on: int, watching: bool) -> tuple[dist.Store, dict] | None:
        """Put this rank's log, and what it waits on, in the default store: (the store, what
        was put), or None where there is no store (or it went with a dead rank)."""
        store = _default_store()
        if store is None:
            return None
        mine = {
            "waiting_on": waiting_on,
            "watching": watching,
            "entries": [asdict(e) for e in self.entries],
        }
        try:
            store.set(self._key(dist.get_rank()), json.dumps(mine))
        except RuntimeError:
            return None
        return store, mine

    def withdraw(self) -> None:
        store = _default_store()
        try:
            if store is not None:
                store.delete_key(self._key(dist.get_rank()))
        except RuntimeError:
            pass

    def stalled(self, waiting_on: int, watching: bool = True) -> None:
        """A wait on position ``waiting_on`` is taking long, or failed: publish this rank's log
        and compare it with the peers' logs.

        Raises:
            CollectiveOrderError: the ranks' logs show they diverged.
        """
        published = self.publish(waiting_on, watching)
        if published is None:
            return
        store, mine = published
        me = dist.get_rank()
        logs = {me: mine}
        try:
            for rank in self.ranks:
                if rank != me and store.check([self._key(rank)]):
                    logs[rank] = json.loads(store.get(self._key(rank)))
        except RuntimeError:  # the store went with a dead rank: nothing to compare
            return
        message = diverged(self.ranks, logs)
        if message is not None:
            # Peers in a direct wait cannot look until this rank's exit fails their wait.
            watching = [r for r, log in logs.items() if r != me and log.get("watching", True)]
            self._linger(store, me, watching)
            raise CollectiveOrderError(message)

    def _linger(self, store: dist.Store, me: int, peers: list[int]) -> None:
        """Before raising (and likely exiting, which may take the store along), give watching
        ``peers`` up to ``LINGER_SECONDS`` to read this rank's log and find the divergence."""
        try:
            store.set(self._key(me, "found"), "1")
            deadline = time.monotonic() + LINGER_SECONDS
            others = [self._key(r, "found") for r in peers]
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


class OrderCheck(Observer):
    """The collective-order check, as an observer of units: it logs every collective on its
    group's ``OrderLog`` and, on CPU, waits on it through ``wait`` (accelerator waits queue on a
    stream and must not block the host). One per process: ``CHECK``."""

    def __init__(self) -> None:
        self._logs: dict[tuple[int, ...], OrderLog] = {}
        self._helper = _Helper()

    def log_for(self, group: dist.ProcessGroup) -> OrderLog:
        """This process's log of ``group`` (see the module docstring for why it is process-wide)."""
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._logs:
            self._logs[ranks] = OrderLog(ranks)
        return self._logs[ranks]

    def issued(self, op: Collective) -> None:
        stall = self.log_for(op.group).issued(op.step, op.kind, op.unit, op.phase, op.numel)
        if op.device.type == "cpu":
            op.waiter = functools.partial(self.wait, on_stall=stall)

    def wait(self, works: Sequence[dist.Work], on_stall: Callable[[], None]) -> None:
        """``work.wait()`` each of ``works``, calling ``on_stall()`` each ``STALL_SECONDS`` they
        are not done (a watched ``Stall``, or any other callable), or waiting directly while the
        helper publishes the log (a ``Stall`` not watched; Note [Watched and direct waits]). A
        failed work's error is raised here, after one more ``on_stall()``: a peer that found the
        ranks diverged publishes its log, raises and exits, and the connection it closes fails
        this wait; the check then names the divergence here too."""
        stall = on_stall if isinstance(on_stall, Stall) else None
        try:
            if all(work.is_completed() for work in works):
                wait_each(works)
            elif stall is not None and not stall.watch:
                self._helper.direct(works, stall)
            else:
                self._helper.watched(works, on_stall)
        except CollectiveOrderError:
            raise
        except RuntimeError:
            on_stall()  # raises CollectiveOrderError (chained to the failure) if the ranks diverged
            raise
        if stall is not None:
            stall.done()

    def close(self) -> None:
        """End the helper thread (at interpreter exit: no thread of ours is left in finalization)."""
        self._helper.stop()


class _Helper:
    """One daemon thread with two jobs (Note [Watched and direct waits]): it blocks in
    ``Work.wait()`` for a watched wait while the calling thread wakes each ``STALL_SECONDS`` to
    compare logs (gloo's point-to-point works report ``is_completed()`` only after a ``wait()``,
    so polling cannot tell a slow collective from a stuck one); and while the calling thread
    waits directly, it publishes that wait's log once it has stalled ``STALL_SECONDS``. The two
    never overlap: during a watched wait the calling thread waits for this one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._direct: tuple[Stall, float] | None = None  # a direct wait and when it began
        self._lock = threading.Lock()  # a direct wait does not end while its log is published

    def _running(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="fsdp_lite-order", daemon=True)
            self._thread.start()

    def watched(self, works: Sequence[dist.Work], on_stall: Callable[[], None]) -> None:
        self._running()
        done, failure = threading.Event(), []
        self._jobs.put((works, done, failure))
        while not done.wait(STALL_SECONDS):
            on_stall()
        if failure:
            raise failure[0]

    def direct(self, works: Sequence[dist.Work], stall: Stall) -> None:
        self._running()
        self._direct = (stall, time.monotonic())
        try:
            wait_each(works)
        finally:
            with self._lock:
                self._direct = None

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=STALL_SECONDS + 1.0)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=STALL_SECONDS / 2)
            except queue.Empty:
                self._publish_if_stalled()
                continue
            if job is None:
                return
            works, done, failure = job
            try:
                wait_each(works)
            except BaseException as e:  # handed to the waiting thread, which raises it
                failure.append(e)
            # Dropped before the waiter wakes: a work holds its tensors (a unit's whole buffer),
            # which would otherwise stay alive until the next job.
            del works, job
            done.set()
            del done, failure

    def _publish_if_stalled(self) -> None:
        with self._lock:
            current = self._direct
            if current is None or time.monotonic() - current[1] < STALL_SECONDS:
                return
            if not current[0].published:  # once per wait: a stalled rank's log is fixed
                current[0].publish()


CHECK = OrderCheck()
atexit.register(CHECK.close)


def log_for(group: dist.ProcessGroup) -> OrderLog:
    """This process's log of ``group`` (``CHECK.log_for``)."""
    return CHECK.log_for(group)


def wait(works: Sequence[dist.Work], on_stall: Callable[[], None]) -> None:
    """``CHECK.wait``: wait on ``works`` as the order check does."""
    CHECK.wait(works, on_stall)


def set_collective_order_check(module: nn.Module, enabled: bool) -> None:
    """Turn the collective-order check on or off for every unit in ``module``'s tree, of either
    front. On by default."""
    for owner in unit_owners(module):
        if enabled:
            owner._unit.watch(CHECK)
        else:
            owner._unit.unwatch(CHECK)
