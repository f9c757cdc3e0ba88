"""Collective-order checks: ranks that issue different collectives, or that wait in one of
fsdp_lite's while a peer waits in a collective fsdp_lite does not own, are named, not left to hang.

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
peer that published nothing may be blocked in a collective fsdp_lite does not own: Note [Foreign
collectives]. A slow peer is no divergence: the logs agree, and the wait goes on.

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
(same count and sizes), and ranks that stall outside any collective (in user code: a slow rank
and a stuck one look the same from outside; a waiting rank warns once after ``WARN_SECONDS``).

Note [Foreign collectives]: a rank may wait in one of fsdp_lite's collectives while a peer waits
in a collective fsdp_lite does not own (its own ``dist.all_gather``, ``dist.barrier``,
``all_gather_object``, another library's; HF Trainer's ``state_dict()`` on rank 0 only, then
Trainer's all_gather on every rank). Neither log shows it, and gloo waits until the process
group's timeout. Each process's helper thread (started by the first CPU collective a unit issues
here) looks at the stack of the thread that issues fsdp_lite's collectives twice a second
(``sys._current_frames``: no store traffic, no cost on the calling thread). A stack whose
innermost frame is a torch.distributed collective (``distributed_c10d``'s, or a functional
collective's ``wait_tensor``) for ``STALL_SECONDS`` is a *foreign wait*: the helper publishes
where (``Foreign``: the call, the caller's file, line and function, the collective's group
where its frame says, and how many of fsdp_lite's collectives this rank issued on each group),
once, and withdraws it when the thread moves on. A rank stalled in one of fsdp_lite's
collectives reads its peers' records where it compares logs. A peer that has not issued the
collective this rank waits on, blocked in a foreign collective whose group includes this rank,
can never come: it waits for this rank, which waits for it. That is a divergence once the same
record is seen at two looks ``STALL_SECONDS`` apart (a record a moment stale is withdrawn within
half a second). A foreign collective whose group leaves this rank out (tensor parallel, another
pipeline stage) may complete and is no divergence; nor is one whose group is unknown (a
functional collective's wait, a ``recv`` from any source): these, and a peer in no collective at
all, earn one warning after ``WARN_SECONDS`` and the wait goes on. Not seen: a peer blocked in
``Work.wait()`` called from its own code (the frame is the caller's, not torch's), a peer that
has issued no CPU collective of a unit yet (no helper thread), and a foreign collective this
rank issued asynchronously and has not waited for (it would complete the peer's; it would have to
run longer than the two looks to be mistaken for a deadlock).
The rank that finds it tells the peer through the store (``_Whereabouts``: the peer's helper
looks for a verdict while its record is published, logs it at ERROR level and acknowledges). The
peer's own thread cannot be interrupted (a pending gloo collective returns only when a peer's
connection closes or at the timeout; ``ProcessGroup.abort()`` does not end it): it fails when the
finding rank exits, and raises the same diagnosis as a ``CollectiveOrderError`` (armed by its
helper with CPython's ``PyThreadState_SetAsyncExc``; the backend's error is its ``__context__``).
Armed only when the finder raises, which it does once the same record was seen twice: a rank
whose collective could still complete is never armed. A watched wait raises ``CollectiveOrderError`` at once. A direct wait cannot
raise while it blocks: its watchdog logs the same diagnosis at ERROR level on this rank too, and
the wait raises it when it fails (the peer exits, or the process group's timeout).

The logs are process-wide, one per group: a group's collectives are ordered per process,
whichever root's runtime issues them (two pipeline stages on one rank share their dp group). So
there is one ``OrderCheck`` per process, ``CHECK``, which owns the logs and the helper thread and
ends the thread at interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import json
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import FrameType

import torch.distributed as dist
import torch.nn as nn

from fsdp_lite.engine.collectives import CollectiveError, wait_each
from fsdp_lite.engine.observe import Collective, Observer
from fsdp_lite.engine.unit import unit_owners

__all__ = [
    "CHECK",
    "STALL_SECONDS",
    "WARN_SECONDS",
    "CollectiveOrderError",
    "Foreign",
    "OrderCheck",
    "OrderLog",
    "Stall",
    "foreign_collective",
    "log_for",
    "set_collective_order_check",
    "wait",
]

STALL_SECONDS = 1.0  # a wait this long compares the ranks' logs, and again each second after
LINGER_SECONDS = 3.0  # how long a rank that found a divergence waits for its peers to find it
KEEP = 512  # entries each log keeps and publishes: more than a few steps of a large model
SCHEDULES = 4  # completed steps' sequences remembered (Note [Watched and direct waits])
WARN_SECONDS = 10.0  # a peer missing this long from a stalled wait: one warning, the wait goes on
SAMPLE_SECONDS = STALL_SECONDS / 2  # how often the helper looks at the calling thread's stack
_VERBS = {
    "all_gather": "all-gathered",
    "reduce_scatter": "reduce-scattered",
    "all_reduce": "all-reduced",
}


_log = logging.getLogger("fsdp_lite")


class CollectiveOrderError(CollectiveError):
    """Ranks issued different collectives, or one waits in a collective fsdp_lite does not own
    while its peer waits in one of fsdp_lite's; the message names what each did."""


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
    through the helper thread (Note [Watched and direct waits]). Also what this wait has learnt:
    the foreign records seen at the last look and the divergence found (Note [Foreign
    collectives])."""

    __slots__ = (
        "began",
        "failed",
        "found",
        "log",
        "looked",
        "published",
        "seen",
        "seq",
        "warned",
        "watch",
    )

    def __init__(self, log: OrderLog, seq: int, watch: bool) -> None:
        self.log, self.seq, self.watch = log, seq, watch
        self.published = False
        self.began = self.looked = 0.0  # set when the wait stalls (time.monotonic)
        self.failed = False  # the wait raised: compare without confirming a foreign record
        self.found: str | None = None  # the divergence, once found
        self.seen: dict[int, str] | None = None  # peer -> its foreign record's id at the last look
        self.warned = False

    def __call__(self) -> None:
        """Compare with the peers' logs; raises ``CollectiveOrderError`` on a divergence."""
        if self.found is not None:  # a direct wait's watchdog found it; the wait failed since
            raise CollectiveOrderError(self.found)
        self.published = True
        self.log.stalled(self.seq, watching=self.watch, stall=self)

    def publish(self) -> None:
        """Publish this rank's log for the peers to compare (a direct wait's watchdog)."""
        self.published = True
        self.log.publish(self.seq, watching=False)

    def look(self, now: float) -> None:
        """A direct wait's watchdog, each ``STALL_SECONDS`` after publishing: look for a peer
        blocked in a foreign collective (Note [Foreign collectives]). This thread cannot raise
        in the waiting one: it logs the divergence at ERROR level and keeps it for ``__call__``,
        which raises it once the wait fails."""
        self.looked = now
        store = _default_store()
        if store is None or self.found is not None:
            return
        if self.seen is None:
            self.seen = {}
        try:
            found = self.log.foreign(store, dist.get_rank(), self.seq, self.seen)
        except RuntimeError:  # the store went with a dead rank
            return
        if found is None:
            self.log.warn_if_long(store, self, now, {})
            return
        message, stuck = found
        self.found = message
        _log.error(
            "%s. Rank %d waits on it in its calling thread (a direct wait: Note [Watched and "
            "direct waits] in fsdp_lite/tools/order.py), which nothing can interrupt: it raises "
            "CollectiveOrderError when the wait fails, when rank %s exits or at the process "
            "group's timeout",
            message,
            dist.get_rank(),
            ", ".join(map(str, stuck)),
        )
        _tell(store, stuck, message, raises=False)

    def done(self) -> None:
        """The wait returned: a published log no longer says what this rank waits on."""
        if self.published:
            self.log.withdraw()
        if self.found is not None:  # something completed the peer's collective after all
            _log.warning(
                "fsdp_lite: collective %d of group %s completed after all: the divergence "
                "logged for it above did not hold",
                self.seq,
                list(self.log.ranks),
            )


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

    def stalled(self, waiting_on: int, watching: bool = True, stall: Stall | None = None) -> None:
        """A wait on position ``waiting_on`` is taking long, or failed: publish this rank's log
        and compare it with the peers' logs; where they agree, look for a peer blocked in a
        collective fsdp_lite does not own (Note [Foreign collectives]; ``stall``: what this wait
        saw at its last look, and whether it failed).

        Raises:
            CollectiveOrderError: the ranks' logs show they diverged, or a peer that has not
                issued this collective is blocked in a foreign one that waits for this rank.
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
            try:
                store.set(self._key(me, "found"), "1")
            except RuntimeError:
                pass
            self._linger(store, [self._key(r, "found") for r in watching])
            raise CollectiveOrderError(message)
        if stall is None:
            return
        if not stall.began:
            stall.began = time.monotonic() - STALL_SECONDS  # the first look is a second in
        if stall.seen is None:
            stall.seen = {}
        try:
            # A failed wait confirms nothing: the peer may have exited, its record stays.
            found = self.foreign(store, me, waiting_on, None if stall.failed else stall.seen, logs)
            if found is None:
                self.warn_if_long(store, stall, time.monotonic(), logs)
                return
            message, stuck = found
            stall.found = message
            _tell(store, stuck, message, raises=True)
            self._linger(store, [_where_key(r, "told", rec["id"]) for r, rec in stuck.items()])
        except RuntimeError:  # the store went with a dead rank
            if stall.found is None:
                return
        raise CollectiveOrderError(stall.found)

    def foreign(
        self,
        store: dist.Store,
        me: int,
        waiting_on: int,
        seen: dict[int, str] | None,
        logs: dict[int, dict] | None = None,
    ) -> tuple[str, dict[int, dict]] | None:
        """The peers of this group blocked in a collective fsdp_lite does not own that waits
        for rank ``me`` (this one), while it waits on collective ``waiting_on`` they have not
        issued (Note [Foreign collectives]): the error message and their records, or None.

        ``seen`` (peer -> record id) is what the last look saw: a record counts when it is the
        one seen then, and is remembered here otherwise; None counts it at once. ``logs``: the
        peers' published logs, where read (a peer waiting in fsdp_lite publishes no record).
        """
        group = self._name()
        stuck: dict[int, dict] = {}
        for rank in self.ranks:
            if rank == me or (logs is not None and rank in logs):
                continue
            where = _where_key(rank)
            if not store.check([where]):
                if seen is not None:
                    seen.pop(rank, None)
                continue
            record = json.loads(store.get(where))
            if record["issued"].get(group, 0) > waiting_on:
                continue  # it issued this collective: its side is in flight
            group_ranks = record["where"]["group"]
            if group_ranks is None or me not in group_ranks:
                continue  # it may complete without this rank
            if seen is not None and seen.get(rank) != record["id"]:
                seen[rank] = record["id"]  # counted if it is still there at the next look
                continue
            stuck[rank] = record
        if not stuck:
            return None
        return self._foreign_message(me, waiting_on, stuck), stuck

    def _foreign_message(self, me: int, seq: int, stuck: dict[int, dict]) -> str:
        group = self._name()
        mine = next((e for e in self.entries if e.seq == seq), None)
        who = ", ".join(map(str, stuck))
        parts = []
        for rank, record in stuck.items():
            last = record["last"].get(group)
            parts.append(
                f"rank {rank} is in {Foreign(**record['where']).describe()}, a collective "
                f"fsdp_lite does not own that waits for rank {me} in turn; "
                + (
                    f"rank {rank}'s last fsdp_lite collective of this group was {last}"
                    if last
                    else "it issued no fsdp_lite collective of this group"
                )
            )
        hint = _FOREIGN_HINTS.get(mine.phase) if mine is not None else None
        if hint is not None:
            only = "only" if len(self.ranks) == 2 else f"but not on rank {who}"
            hint = f"{hint[0]} called on rank {me} {only}{hint[1]}. "
        return (
            f"fsdp_lite: rank {me} waits on collective {seq} of group {list(self.ranks)}"
            + (f" ({mine.describe()})" if mine is not None else "")
            + f", which rank {who} did not issue: "
            + "; ".join(parts)
            + ". "
            + (hint or "")
            + "No rank may enter another collective (its own torch.distributed calls, another "
            "library's) while a peer waits in one of fsdp_lite's: both wait for each other until "
            "the process group's timeout"
        )

    def warn_if_long(
        self, store: dist.Store, stall: Stall, now: float, logs: dict[int, dict]
    ) -> None:
        """Once per wait, after ``WARN_SECONDS``: name the peers that have not come and what is
        known of where they are. A slow peer is no error: the wait goes on."""
        if stall.warned or now - stall.began < WARN_SECONDS:
            return
        stall.warned = True
        me, group = dist.get_rank(), self._name()
        lines = []
        for rank in self.ranks:
            if rank == me or rank in logs:
                continue
            where = _where_key(rank)
            record = json.loads(store.get(where)) if store.check([where]) else None
            if record is None:
                lines.append(
                    f"rank {rank} is in no torch.distributed collective fsdp_lite can see (it "
                    "computes, or waits in user code)"
                )
            elif record["issued"].get(group, 0) <= stall.seq:
                lines.append(f"rank {rank} is in {Foreign(**record['where']).describe()}")
        if lines:
            mine = next((e for e in self.entries if e.seq == stall.seq), None)
            _log.warning(
                "fsdp_lite: rank %d has waited %.0f s on collective %d of group %s%s: %s. The "
                "wait goes on (a slow rank is no error)",
                me,
                now - stall.began,
                stall.seq,
                list(self.ranks),
                f" ({mine.describe()})" if mine is not None else "",
                "; ".join(lines),
            )

    def _linger(self, store: dist.Store, keys: list[str]) -> None:
        """Before raising (and likely exiting, which may take the store along), give the peers
        up to ``LINGER_SECONDS`` to set ``keys``: that they read this rank's log and found the
        divergence, or read and logged the verdict this rank left them (Note [Foreign
        collectives])."""
        try:
            deadline = time.monotonic() + LINGER_SECONDS
            while time.monotonic() < deadline and not all(store.check([k]) for k in keys):
                time.sleep(0.05)
        except RuntimeError:
            pass

    def _name(self) -> str:
        return "-".join(map(str, self.ranks))

    def _key(self, rank: int, what: str = "log") -> str:
        return f"fsdp_lite/order/{self._name()}/{rank}/{what}"


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


# Phases that are a call of the user's, as a hint: "{phase_call} called on rank 0 only".
_FOREIGN_HINTS = {
    "state_dict": (
        "state_dict",
        ": a full state dict all-gathers every unit, so every rank must ask for it (rank0_only "
        "or cpu_offload keep the result on rank 0 only)",
    ),
    "summon": ("summon_full_params", ": it all-gathers every unit, so every rank must enter it"),
}


def _where_key(rank: int, what: str = "record", record_id: str = "") -> str:
    """Store keys of Note [Foreign collectives]: a rank's record, and the verdict a waiting peer
    leaves for that record and its acknowledgement."""
    return f"fsdp_lite/where/{rank}/{what}" + (f"/{record_id}" if record_id else "")


def _tell(store: dist.Store, stuck: dict[int, dict], message: str, raises: bool) -> None:
    """Leave each peer in ``stuck`` (rank -> its foreign record) the verdict, for its helper to
    log (``_Whereabouts``)."""
    verdict = json.dumps({"by": dist.get_rank(), "message": message, "raises": raises})
    for rank, record in stuck.items():
        store.set(_where_key(rank, "verdict", record["id"]), verdict)


@dataclass(frozen=True)
class Foreign:
    """Where a thread blocks in a torch.distributed collective fsdp_lite does not own."""

    call: str  # what the code outside torch called: "torch.distributed.all_gather"
    site: str  # "train.py:12 in evaluate": where it called it
    group: tuple[int, ...] | None  # the collective's global ranks; None where its frame won't say

    def describe(self) -> str:
        group = f" (group {list(self.group)})" if self.group is not None else ""
        return f"{self.call}{group} called from {self.site}"


# The frames that show a thread waiting in a collective (Note [Foreign collectives]).
_C10D = "torch.distributed.distributed_c10d"
_C10D_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "gather",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "send",
    }
)
_FUNCOL = "torch.distributed._functional_collectives"
_DISPATCH = "torch._ops"  # OpOverloadPacket.__call__, between a functional wait and C++
_DECORATORS = "torch.distributed.c10d_logger"  # the wrappers around distributed_c10d's functions


def _module(frame: FrameType) -> str:
    return frame.f_globals.get("__name__") or ""


def foreign_collective(frame: FrameType | None) -> tuple[tuple[int, int], Foreign] | None:
    """Whether ``frame`` (a thread's innermost) waits in a torch.distributed collective: where
    it is (a key that stays the same while it waits there) and what it waits in; else None."""
    while frame is not None and _module(frame) == _DISPATCH:
        frame = frame.f_back
    if frame is None:
        return None
    module, name = _module(frame), frame.f_code.co_name
    if module == _C10D and name in _C10D_COLLECTIVES:
        group = _group_ranks(frame, name)
    elif module == _FUNCOL and name == "wait_tensor":
        group = None  # the work knows its group; no frame does
    else:
        return None
    at = (id(frame), frame.f_lasti)
    # What the code outside torch called (the outermost torch.distributed function, decorators
    # aside), and where: the first frame outside torch.
    api, caller = frame, frame.f_back
    while caller is not None and (_module(caller) + ".").startswith("torch."):
        if _module(caller).startswith("torch.distributed") and _module(caller) != _DECORATORS:
            api = caller
        caller = caller.f_back
    module, name = _module(api), api.f_code.co_name
    call = f"torch.distributed.{name}" if module == _C10D else f"{module}.{name}"
    site = (
        f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}"
        if caller is not None
        else "<no Python caller>"
    )
    return at, Foreign(call, site, group)


def _group_ranks(frame: FrameType, name: str) -> tuple[int, ...] | None:
    """The global ranks a distributed_c10d collective's frame waits with, from its arguments
    (read through ``f_locals``, which only copies the frame's variables); None where unknown."""
    try:
        args = frame.f_locals
        group = args.get("group")
        if group is None or group is dist.GroupMember.WORLD:
            group = dist.distributed_c10d._get_default_group()
        if name in ("send", "recv"):  # waits for one peer only; recv(src=None) for any
            peer = args.get("dst" if name == "send" else "src")
            group_peer = args.get("group_dst" if name == "send" else "group_src")
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group, group_peer)
            return None if peer is None else (dist.get_rank(), int(peer))
        if isinstance(group, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError, TypeError):
        pass
    return None


def _looking_at(thread: int | None) -> tuple[tuple[int, int], Foreign] | None:
    """``foreign_collective`` of ``thread``'s innermost frame (None: no such thread)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    try:
        return foreign_collective(frame)
    finally:
        del frame  # a frame holds its locals (tensors): keep none


def _raise_when_it_returns(thread: int, message: str) -> None:
    """Arm ``CollectiveOrderError(message)`` in ``thread``, blocked in a foreign collective
    (Note [Foreign collectives]): CPython raises it as soon as the thread runs Python code again,
    when its collective fails, with the backend's error as its ``__context__``. The C API takes
    an exception class, not an instance (Python 3.11), so a subclass carries the message."""

    def init(self: BaseException) -> None:
        CollectiveOrderError.__init__(self, message)

    armed = type(
        "CollectiveOrderError",
        (CollectiveOrderError,),
        {"__init__": init, "__module__": __name__, "__qualname__": "CollectiveOrderError"},
    )
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(armed))


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
        # group -> its log: asking c10d for a group's ranks costs more than the rest of logging
        # a collective (scripts/bench_host_overhead.py), and every unit asks at each collective.
        self._by_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._helper = _Helper(self)

    def log_for(self, group: dist.ProcessGroup) -> OrderLog:
        """This process's log of ``group`` (see the module docstring for why it is process-wide)."""
        log = self._by_group.get(group)
        if log is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            if ranks not in self._logs:
                self._logs[ranks] = OrderLog(ranks)
            log = self._by_group[group] = self._logs[ranks]
        return log

    def issued(self, op: Collective) -> None:
        stall = self.log_for(op.group).issued(op.step, op.kind, op.unit, op.phase, op.numel)
        if op.device.type == "cpu":
            op.waiter = functools.partial(self.wait, on_stall=stall)
            # The thread whose stack the helper looks at (Note [Foreign collectives]); the helper
            # runs from the first collective on, not only from the first wait that stalls.
            self._helper.caller = threading.get_ident()
            if self._helper.thread is None:
                self._helper.running()

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
            if stall is not None:
                stall.failed = True
            on_stall()  # raises CollectiveOrderError (chained to the failure) if the ranks diverged
            raise
        if stall is not None:
            stall.done()

    def issued_counts(self) -> tuple[dict[str, int], dict[str, str]]:
        """How many collectives this process issued on each group, and the last of each
        described, by group name (for ``_Whereabouts``'s record)."""
        counts, last = {}, {}
        for log in list(self._logs.values()):
            counts[log._name()] = log.count
            if log.entries:
                entry = log.entries[-1]
                last[log._name()] = f"{entry.seq} ({entry.describe()})"
        return counts, last

    def close(self) -> None:
        """End the helper thread (at interpreter exit: no thread of ours is left in finalization)."""
        self._helper.stop()


class _Helper:
    """One daemon thread with three jobs (Note [Watched and direct waits]): it blocks in
    ``Work.wait()`` for a watched wait while the calling thread wakes each ``STALL_SECONDS`` to
    compare logs (gloo's point-to-point works report ``is_completed()`` only after a ``wait()``,
    so polling cannot tell a slow collective from a stuck one); while the calling thread
    waits directly, it publishes that wait's log once it has stalled ``STALL_SECONDS`` and then
    looks for foreign waits of peers; and when idle it looks at the calling thread's stack
    (``_Whereabouts``, Note [Foreign collectives]). A watched wait and a direct one never
    overlap: during a watched wait the calling thread waits for this one."""

    def __init__(self, check: OrderCheck) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.caller: int | None = None  # the thread that issues the units' collectives
        self._whereabouts = _Whereabouts(check)
        self._direct: tuple[Stall, float] | None = None  # a direct wait and when it began
        self._lock = threading.Lock()  # a direct wait does not end while its log is published

    def running(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="fsdp_lite-order", daemon=True)
            self.thread.start()

    def watched(self, works: Sequence[dist.Work], on_stall: Callable[[], None]) -> None:
        self.running()
        done, failure = threading.Event(), []
        self._jobs.put((works, done, failure))
        while not done.wait(STALL_SECONDS):
            on_stall()
        if failure:
            raise failure[0]

    def direct(self, works: Sequence[dist.Work], stall: Stall) -> None:
        self.running()
        self._direct = (stall, time.monotonic())
        try:
            wait_each(works)
        finally:
            with self._lock:
                self._direct = None

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join(timeout=STALL_SECONDS + 1.0)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=SAMPLE_SECONDS)
            except queue.Empty:
                self._idle()
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

    def _idle(self) -> None:
        # Nothing here may end this thread: every watched wait of the process depends on it.
        try:
            self._watch_direct()
            self._whereabouts.sample(self.caller)
        except Exception:  # noqa: BLE001 - logged, and the next turn tries again
            _log.debug("fsdp_lite: the order check's helper failed a turn", exc_info=True)

    def _watch_direct(self) -> None:
        with self._lock:
            current = self._direct
            if current is None:
                return
            stall, began = current
            now = time.monotonic()
            if now - began < STALL_SECONDS:
                return
            if not stall.published:  # once per wait: a stalled rank's log is fixed
                stall.began = began
                stall.publish()
                stall.looked = now
            elif now - stall.looked >= STALL_SECONDS:
                stall.look(now)


class _Whereabouts:
    """This process's side of Note [Foreign collectives], run by the helper thread when idle:
    it looks at the calling thread's stack; blocked in a foreign collective for
    ``STALL_SECONDS``, it publishes where (one store write), looks for a verdict a waiting peer
    left while the record stands (a store check each look), logs it at ERROR level once, and
    withdraws the record when the thread moves on."""

    def __init__(self, check: OrderCheck) -> None:
        self._check = check
        self._at: tuple[int, int] | None = None  # where the calling thread waits, as last seen
        self._since = 0.0
        self._foreign: Foreign | None = None
        self._record: dict | None = None  # published, while the thread waits there
        self._count = 0
        self._told = False

    def sample(self, thread: int | None) -> None:
        found = _looking_at(thread)
        now = time.monotonic()
        at = found[0] if found is not None else None
        if at != self._at:
            self._withdraw()
            self._at, self._since = at, now
            self._foreign = found[1] if found is not None else None
        elif self._foreign is not None:
            if self._record is None:
                if now - self._since >= STALL_SECONDS:
                    self._publish()
            elif not self._told:
                self._read_verdict(thread)

    def _publish(self) -> None:
        store = _default_store()
        if store is None:
            return
        self._count += 1
        issued, last = self._check.issued_counts()
        where = asdict(self._foreign)
        record = {
            "id": f"{os.getpid()}.{self._count}",
            "where": where,
            "issued": issued,
            "last": last,
        }
        try:
            store.set(_where_key(dist.get_rank()), json.dumps(record))
        except RuntimeError:
            return
        self._record, self._told = record, False

    def _withdraw(self) -> None:
        if self._record is None:
            return
        self._record = None
        store = _default_store()
        try:
            if store is not None:
                store.delete_key(_where_key(dist.get_rank()))
        except RuntimeError:
            pass

    def _read_verdict(self, thread: int) -> None:
        store = _default_store()
        if store is None:
            return
        me, record_id = dist.get_rank(), self._record["id"]
        key = _where_key(me, "verdict", record_id)
        try:
            if not store.check([key]):
                return
            verdict = json.loads(store.get(key))
        except RuntimeError:
            return
        self._told = True
        by = verdict["by"]
        message = (
            f"fsdp_lite: rank {me} cannot leave {self._foreign.describe()}: rank {by} waits for "
            "it in one of fsdp_lite's collectives, and "
            + (
                "raises CollectiveOrderError"
                if verdict["raises"]
                else "cannot raise either (its wait is direct)"
            )
            + ". torch.distributed's collective cannot be interrupted: it fails when rank "
            f"{by} exits, or at the process group's timeout. Rank {by}'s finding: "
            + verdict["message"]
        )
        _log.error("%s", message)
        # The finding rank raises and exits, which fails this thread's collective: it then
        # raises the same diagnosis instead of the backend's bare "connection closed".
        if verdict["raises"] and _looking_at(thread) is not None:
            _raise_when_it_returns(thread, message)
        try:
            store.set(_where_key(me, "told", record_id), "1")
        except RuntimeError:
            pass


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
