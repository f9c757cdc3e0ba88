"""Records what a step does on this rank: every collective, each unit's compute, memory by category.

``record_collectives(model, optimizer)`` attaches one ``CollectiveTrace`` to every unit of a wrapped
model for the duration of a ``with`` block. Units append a ``CollectiveRecord`` when they start a
collective and stamp its end when their wait returns; the runtime opens and closes a ``ComputeSpan``
around each unit's forward and backward; at each of these events the trace samples every unit's
bytes by category (``MemorySample``). ``explain(model)`` returns the sharding plan as text,
``plot_timeline`` / ``plot_memory`` draw traces with matplotlib (the ``plot`` extra), and
``write_chrome_trace`` writes every rank's trace into one Trace Event Format JSON file (what
Perfetto and chrome://tracing open), optionally beside torch.profiler's events of the same steps.
"""

# Note [Trace times and memory]
#
# Times are time.perf_counter() seconds since this rank's trace began; ranks' clocks are not aligned
# (write_chrome_trace aligns them when it writes, Note [Chrome trace clocks]).
# A collective's `start` is when the unit issued it, its `end` when this rank's wait on it returned
# (`wait_for_unshard` for all-gathers, `advance_reduce` for reductions; right after the call for the
# synchronous ones), and its `wait_start` when this rank began that wait, where the unit waits
# through `Collective.waiter` (a unit's collectives, not an optimizer's exchanges). On CPU/gloo
# `end` is when the waiting rank observed completion: an all-gather prefetched early may have
# finished long before its `end`, and a wait that returns at once still shows the time until
# somebody asked. Compute spans are inclusive: the root's forward contains its
# children's.
#
# Memory is storage accounting, not an allocator reading: at each event, for each unit, the bytes of
# the distinct storages behind its tensors, each storage counted once, in the first category that
# holds it (the order of MEMORY_CATEGORIES). Exact for what the units own, cheap, device-agnostic;
# activations and the allocator's cache are not in it. The categories are the planner's
# (estimate.py): params + grads + optim are its model states, and the unsharded_* and comm_buffers
# categories are its working set.

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_lite.api import STRATEGY_RULES, Rules
from fsdp_lite.engine.collectives import _object_device, all_gather_objects, wait_each
from fsdp_lite.engine.observe import Collective, Observer
from fsdp_lite.engine.runtime import lazy_init
from fsdp_lite.engine.unit import unit_owners

__all__ = [
    "MEMORY_CATEGORIES",
    "CollectiveRecord",
    "CollectiveTrace",
    "ComputeSpan",
    "MemorySample",
    "chrome_trace",
    "explain",
    "plot_memory",
    "plot_timeline",
    "record_collectives",
    "write_chrome_trace",
]

# Storage categories per unit, in the order a shared storage is claimed (Note [Trace times and memory]).
MEMORY_CATEGORIES = (
    "params",  # sharded_param storage (sharded_flat, padding included); the whole param if not sharded
    "optim",  # the optimizer's state tensors for this unit's sharded_params (local shards)
    "grads",  # sharded_param.grad: what the optimizer reads
    "unsharded_params",  # unsharded_param storage while allocated
    "unsharded_grads",  # the gradients autograd left on unsharded_param, not yet reduced
    "comm_buffers",  # all_gather_output and reduction buffers of collectives in flight
)


@dataclass
class CollectiveRecord:
    """One collective one unit issued on this rank; times per Note [Trace times and memory]."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all" (an optimizer's)
    unit: str  # the unit's module path from the root, "" for the root, "<optimizer>"
    phase: str  # "forward" | "backward" | "summon" | ...
    dtype: torch.dtype
    numel: int  # of this rank's input
    step: int = 0
    start: float = 0.0  # seconds since the trace began, when the unit issued it
    end: float | None = None  # when this rank's wait returned; None until then
    group: list[int] | None = None  # the global ranks of its process group
    wait_start: float | None = None  # when this rank began waiting; None: not seen (Note above)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class ComputeSpan:
    """A unit's forward or backward (pre-hook to post-hook), or a span the user marked."""

    unit: str  # unit name, or the label of a user span such as "optimizer"
    phase: str  # "forward" | "backward" | "step" | ...
    step: int
    start: float
    end: float | None = None  # None: never closed (a unit reduced only by finalize_backward)


@dataclass
class MemorySample:
    """Every unit's bytes by category right after one event."""

    time: float
    step: int
    event: str  # e.g. "all_gather start blocks.0", "forward end <root>"
    units: dict[str, dict[str, int]]  # unit name -> category -> bytes (zeros left out)

    def total(self, category: str | None = None) -> int:
        return sum(
            nbytes
            for per_unit in self.units.values()
            for cat, nbytes in per_unit.items()
            if category in (None, cat)
        )


@dataclass(eq=False)
class CollectiveTrace(Observer):
    """What one rank did inside one ``record_collectives`` block; an observer of its units
    (engine/observe.py).

    ``step`` counts training steps from 0, the first step the trace saw: it is the runtime's
    step (which moves on when a step's last backward ends) less the first one seen, and moves
    on at the first event of the next step (the root's all-gather in forward), so that an
    optimizer step marked with ``span`` belongs to the step whose gradients it applies.
    """

    records: list[CollectiveRecord] = field(default_factory=list)
    spans: list[ComputeSpan] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    step: int = 0
    units: list = field(default_factory=list, repr=False)  # ShardedUnits sampled for memory
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)
    t0: float = field(default_factory=time.perf_counter, repr=False)
    _first_step: int | None = field(default=None, repr=False)  # the runtime's, at step 0
    # The record of each collective issued and not yet waited on, by its Collective: several of
    # one unit and kind may be in flight (an optimizer's bucketed exchanges).
    _open: dict = field(default_factory=dict, repr=False)
    _groups: dict = field(default_factory=dict, repr=False)  # ProcessGroup -> its global ranks

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---- the observer's hooks (called by the units) ----------------------------------------------

    def issued(self, op: Collective) -> None:
        """A unit (or an optimizer: step -1, the trace's step) is about to start a collective;
        ``op.numel`` is this rank's input."""
        if op.step >= 0:
            self._at_step(op.step)
        record = CollectiveRecord(
            op.kind,
            op.unit,
            op.phase,
            op.dtype,
            op.numel,
            self.step,
            start=self.now(),
            group=self._ranks_of(op.group),
        )
        self.records.append(record)
        self._open[op] = record
        # Wrap the wait (an earlier observer's, or the plain one) to stamp when it begins.
        op.waiter = functools.partial(self._timed_wait, record, op.waiter or wait_each)
        self.sample(f"{op.kind} start {op.unit or '<root>'}")

    def _timed_wait(self, record: CollectiveRecord, wait, works) -> None:
        record.wait_start = self.now()
        wait(works)

    def _ranks_of(self, group) -> list[int] | None:
        if not dist.is_initialized():
            return None
        if group not in self._groups:
            self._groups[group] = dist.get_process_group_ranks(group)
        return self._groups[group]

    def waited(self, op: Collective) -> None:
        """This rank's wait on ``op`` returned (else on the unit's latest open collective of
        ``op``'s kind)."""
        record = self._open.pop(op, None)
        if record is not None and record.end is None:
            record.end = self.now()
            self.sample(f"{op.kind} end {op.unit or '<root>'}")
            return
        for r in reversed(self.records):
            if r.unit == op.unit and r.kind == op.kind and r.end is None:
                r.end = self.now()
                self.sample(f"{op.kind} end {op.unit or '<root>'}")
                return

    def compute(self, unit: str, phase: str, edge: str, step: int) -> None:
        """A unit's ``phase`` ("forward" or "backward") computation begins or ends (``edge``)."""
        self._at_step(step)
        if edge == "begin":
            self.begin(unit, phase)
        else:
            self.end(unit, phase)

    def _at_step(self, runtime_step: int) -> None:
        if self._first_step is None:
            self._first_step = runtime_step
        self.step = runtime_step - self._first_step

    def begin(self, label: str, phase: str) -> None:
        self.spans.append(ComputeSpan(label, phase, self.step, self.now()))
        self.sample(f"{phase} begin {label or '<root>'}")

    def end(self, label: str, phase: str) -> None:
        for s in reversed(self.spans):
            if s.unit == label and s.phase == phase and s.end is None:
                s.end = self.now()
                break
        self.sample(f"{phase} end {label or '<root>'}")

    @contextlib.contextmanager
    def span(self, label: str, phase: str = "step") -> Iterator[None]:
        """Mark user code, e.g. ``with trace.span("optimizer"): optim.step()``."""
        self.begin(label, phase)
        try:
            yield
        finally:
            self.end(label, phase)

    def sample(self, event: str) -> None:
        if self.units:
            state = self.optimizer.state if self.optimizer is not None else {}
            per_unit = {u.name: unit_nbytes(u, state) for u in self.units}
            self.memory.append(MemorySample(self.now(), self.step, event, per_unit))

    # ---- reading -------------------------------------------------------------------------------

    def count(self, kind: str, phase: str | None = None, unit: str | None = None) -> int:
        return sum(
            r.kind == kind and phase in (None, r.phase) and unit in (None, r.unit)
            for r in self.records
        )

    def clear(self) -> None:
        self._open.clear()
        self.records.clear()
        self.spans.clear()
        self.memory.clear()

    def to_json(self) -> dict:
        """A JSON-ready dict (dtypes as names); ``from_json`` reads it back."""
        records = []
        for r in self.records:
            d = asdict(r)
            d["dtype"] = _dtype_name(r.dtype)
            d["nbytes"] = r.nbytes
            records.append(d)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "memory_categories": list(MEMORY_CATEGORIES),
            "collectives": records,
            "spans": [asdict(s) for s in self.spans],
            "memory": [asdict(m) for m in self.memory],
        }

    @classmethod
    def from_json(cls, data: dict) -> CollectiveTrace:
        records = []
        for d in data["collectives"]:
            d = {k: v for k, v in d.items() if k != "nbytes"}
            records.append(CollectiveRecord(**{**d, "dtype": getattr(torch, d["dtype"])}))
        return cls(
            records=records,
            spans=[ComputeSpan(**s) for s in data["spans"]],
            memory=[MemorySample(**m) for m in data["memory"]],
            rank=data["rank"],
            world_size=data["world_size"],
        )


def unit_nbytes(unit, optim_state) -> dict[str, int]:
    """One unit's bytes per MEMORY_CATEGORIES right now; see Note [Trace times and memory]."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, DTensor):
                t = t.to_local()
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:  # 0: freed (resharded)
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = unit.params
    pending = unit.buffers_in_flight()
    if unit.runtime is not None:
        pending += unit.runtime.buffers_in_flight(unit)
    unsharded_grads = [p.unsharded_param.grad for p in params if p.unsharded_param is not None]
    counts = {
        "params": nbytes(p.sharded_flat for p in params),
        "optim": nbytes(
            t
            for p in params
            for t in optim_state.get(p.sharded_param, {}).values()
            if isinstance(t, torch.Tensor)
        ),
        "grads": nbytes(p.sharded_param.grad for p in params),
        "unsharded_params": nbytes(p.unsharded_flat for p in params),
        "unsharded_grads": nbytes(unsharded_grads),
        "comm_buffers": nbytes(pending),
    }
    return {k: v for k, v in counts.items() if v}


@contextlib.contextmanager
def record_collectives(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[CollectiveTrace]:
    """Record every collective, each unit's forward and backward, and memory, inside the block.

    Args:
        model: a wrapped model; every unit in it is traced.
        optimizer: if given, its state counts as each unit's ``optim`` memory, and an optimizer
            that can be watched (``fsdp_lite.Muon``) records its exchanges too (unit
            ``<optimizer>``, kind ``all_to_all``). Default None.

    Returns:
        The ``CollectiveTrace`` that fills up while the block runs (read it after).
    """
    wrappers = _one_owner_per_unit(model)
    for w in wrappers:
        lazy_init(w)
    trace = CollectiveTrace(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        units=[w._unit for w in wrappers],
        optimizer=optimizer,
    )
    watched = [w._unit for w in wrappers]
    if hasattr(optimizer, "watch"):  # fsdp_lite.Muon: its exchanges, phase "gather"/"scatter"
        watched.append(optimizer)
    for w in watched:
        w.watch(trace)
    trace.sample("trace begin")
    try:
        yield trace
    finally:
        trace.sample("trace end")
        for w in watched:
            w.unwatch(trace)


def _one_owner_per_unit(model: nn.Module) -> list[nn.Module]:
    """The wrappers in ``model``, one per unit (an FSDP2 list group is several modules, one unit)."""
    seen, owners = set(), []
    for owner in unit_owners(model):
        if owner._unit not in seen:
            seen.add(owner._unit)
            owners.append(owner)
    return owners


def explain(model: nn.Module) -> str:
    """The sharding plan of a wrapped model, one block per unit, as a table.

    For each unit: its strategy, dtypes, and for each parameter its full shape, this rank's rows,
    the padded shard numel every rank sends, and the padding. Run it on any rank; the numbers
    are this rank's.
    """
    wrappers = _one_owner_per_unit(model)
    lines = []
    for w in wrappers:
        lazy_init(w)
        unit = w._unit
        precision = unit.precision
        dtype = next((p.sharded_flat.dtype for p in unit.params), None)
        compute = precision.param_dtype or dtype
        reduce = precision.reduce_dtype or compute
        padding = sum(p.padded_numel - p.numel for p in unit.params)
        lines.append(
            f"unit {unit.name or '<root>'}: {_strategy_name(unit.rules)}, "
            f"rank {unit.rank} of {unit.world_size}, {len(unit.params)} params, "
            f"unit_shard_numel {unit.unit_shard_numel}, padding {padding}, "
            f"shard {_dtype_name(dtype)} / compute {_dtype_name(compute)} / reduce {_dtype_name(reduce)}"
        )
        for p in unit.params:
            shape = "x".join(map(str, p.orig_size)) or "scalar"
            line = (
                f"  {p.fqn:<28} {shape:>12}  rows {p.local_rows:>4}/{p.shard_rows:<4} "
                f"shard_numel {p.shard_numel:>7}  padding {p.padded_numel - p.numel}"
            )
            if p.shard_dim:  # param.py Note [Shard dim]: the rows above are of this dim
                line += f"  on dim {p.shard_dim}"
            if p.tp is not None:  # the shape above is the TP-local one
                box = ", ".join(f"{a}:{b}" for a, b in p.global_box())
                layout = ", ".join(map(repr, p.tp.sharded_placements))
                line += (
                    f"  of {'x'.join(map(str, p.tp.shape))} on {p.tp.sharded_mesh.mesh_dim_names}"
                    f" ({layout}): holds [{box}]"
                )
            lines.append(line)
    return "\n".join(lines)


def _strategy_name(rules: Rules) -> str:
    """The strategy whose rules a unit follows now (FSDP2's setters may have changed them)."""
    for strategy, known in STRATEGY_RULES.items():
        if known == rules:
            return strategy.name
    fields = ", ".join(f"{f.name}={getattr(rules, f.name)}" for f in dataclasses.fields(rules))
    return f"Rules({fields})"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


# ---- figures (matplotlib, the "plot" extra) ----------------------------------------------------

COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "step": "#8C8C8C",
    "all_gather": "#55A868",
    "reduce_scatter": "#C44E52",
    "all_reduce": "#8172B3",
    "all_to_all": "#937860",
    "params": "#4C72B0",
    "optim": "#8C8C8C",
    "grads": "#DD8452",
    "unsharded_params": "#55A868",
    "unsharded_grads": "#C44E52",
    "comm_buffers": "#CCB974",
}


@dataclass
class _Step:
    """One step of one rank's trace, times in ms from the step's first event."""

    records: list[CollectiveRecord]
    spans: list[ComputeSpan]
    memory: list[MemorySample]
    t0: float

    def ms(self, t: float) -> float:
        return (t - self.t0) * 1e3


def _one_step(trace: CollectiveTrace, step: int | None) -> _Step:
    if step is None:
        step = max((s.step for s in trace.spans), default=0)
    records = [r for r in trace.records if r.step == step]
    spans = [s for s in trace.spans if s.step == step]
    memory = [m for m in trace.memory if m.step == step]
    times = [r.start for r in records] + [s.start for s in spans] + [m.time for m in memory]
    return _Step(records, spans, memory, min(times, default=0.0))


def _figure(num_rows: int, height_per_rank: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=(10, 0.9 + height_per_rank * num_rows), dpi=90, layout="constrained")
    return fig, fig.subplots(num_rows, 1, sharex=True, squeeze=False)[:, 0]


def plot_timeline(
    traces: Sequence[CollectiveTrace], path: str | Path, step: int | None = None, title: str = ""
) -> None:
    """Draw each rank's compute and collectives over one step (default: the last) into a PNG.

    Two rows per unit: its forward and backward spans, and the collectives it issued (from issue
    to the end of this rank's wait, Note [Trace times and memory]); one row per user span.
    """
    from matplotlib.patches import Patch

    steps = [_one_step(t, step) for t in traces]
    rows: list[tuple[str, str]] = []  # (label, "compute" | "comm" | "user")
    for s in steps:
        for span in s.spans:
            is_unit = span.phase in ("forward", "backward")
            for row in (
                [(span.unit, "compute"), (span.unit, "comm")] if is_unit else [(span.unit, "user")]
            ):
                if row not in rows:
                    rows.append(row)
        for r in s.records:  # a unit that only communicated (a state dict, summon_full_params)
            if (r.unit, "comm") not in rows:
                rows.append((r.unit, "comm"))
    fig, axes = _figure(len(traces), 0.28 * len(rows) + 0.5)
    for ax, trace, s in zip(axes, traces, steps):
        for span in s.spans:
            if span.end is None:
                continue
            kind = "user" if span.phase not in ("forward", "backward") else "compute"
            y = rows.index((span.unit, kind))
            ax.broken_barh(
                [(s.ms(span.start), s.ms(span.end) - s.ms(span.start))],
                (y - 0.4, 0.8),
                color=COLORS.get(span.phase, COLORS["step"]),
            )
        for r in s.records:
            y = rows.index((r.unit, "comm"))
            end = r.end if r.end is not None else r.start
            ax.broken_barh(
                [(s.ms(r.start), max(s.ms(end) - s.ms(r.start), 0.05))],
                (y - 0.35, 0.7),
                color=COLORS[r.kind],
            )
        ax.set_yticks(
            range(len(rows)),
            [(label or "<root>") + ("" if kind != "comm" else " comm") for label, kind in rows],
            fontsize=7,
        )
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
        ax.set_ylabel(f"rank {trace.rank}")
    axes[-1].set_xlabel("ms since the step's first event (each rank's own clock)")
    kinds = [
        "forward",
        "backward",
        "step",
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "all_to_all",
    ]
    used = {sp.phase for s in steps for sp in s.spans} | {r.kind for s in steps for r in s.records}
    handles = [
        Patch(color=COLORS[k], label="optimizer / user span" if k == "step" else k)
        for k in kinds
        if k in used
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path)


def plot_memory(
    traces: Sequence[CollectiveTrace], path: str | Path, step: int | None = None, title: str = ""
) -> None:
    """Draw each rank's bytes by category (summed over units) over one step into a PNG, stacked."""
    steps = [_one_step(t, step) for t in traces]
    peak = max((m.total() for s in steps for m in s.memory), default=0)
    scale, unit = (1024**2, "MiB") if peak >= 4 * 1024**2 else (1024, "KiB")
    fig, axes = _figure(len(traces), 1.8)
    for ax, trace, s in zip(axes, traces, steps):
        if not s.memory:
            continue
        # Step shape: each sample holds until the next event.
        times = [s.ms(m.time) for m in s.memory]
        xs = [x for pair in zip(times, times[1:] + times[-1:]) for x in pair]
        stacks = []
        for cat in MEMORY_CATEGORIES:
            values = [m.total(cat) / scale for m in s.memory]
            stacks.append([v for v in values for _ in (0, 1)])
        ax.stackplot(
            xs, stacks, labels=MEMORY_CATEGORIES, colors=[COLORS[c] for c in MEMORY_CATEGORIES]
        )
        top = max(s.memory, key=lambda m: m.total())
        ax.axhline(top.total() / scale, color="black", lw=0.6, ls="--")
        ax.annotate(
            f"peak {top.total() / scale:.1f} {unit} at {top.event}",
            (s.ms(top.time), top.total() / scale),
            xytext=(4, -12),
            textcoords="offset points",
            fontsize=7,
        )
        ax.set_ylabel(f"rank {trace.rank}\n{unit}")
        ax.set_ylim(0, peak / scale * 1.15)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("ms since the step's first event (each rank's own clock)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path)


# ---- Chrome trace (Trace Event Format: Perfetto, chrome://tracing) -----------------------------

# Note [Chrome trace clocks]
#
# Each rank's times count from the start of its own trace (Note [Trace times and memory]).
# write_chrome_trace puts them on the first rank's clock, as NTP does: the first rank sends each
# other rank a message and reads its clock at the send (t1) and when the reply comes (t4); the
# other rank replies with its own clock's reading (p), taken between the two. So p less the
# midpoint (t1 + t4) / 2 is that rank's offset, wrong by at most half the round trip t4 - t1;
# of CLOCK_ROUNDS round trips the shortest is kept, and its half is the bound written beside the
# offsets (otherData.clock_error_bound_us). No shared clock is assumed, so it holds across hosts;
# the clocks are taken to run at one rate over the trace (perf_counter on one host does).
#
# torch.profiler's exported `ts` is microseconds since the file's `baseTimeNanoseconds` on the
# wall clock (time.time_ns(); a file without the field is read as counting from the epoch). Each rank
# reads its wall clock and perf_counter together to map them onto its trace clock, so a wall clock
# stepped between the profile and the write shifts that rank's torch events by the step.

CLOCK_ROUNDS = 8  # round trips per rank; a busy host delays some, the shortest is kept


def write_chrome_trace(
    trace: CollectiveTrace,
    path: str | Path,
    *,
    profile: str | Path | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict | None:
    """Write every rank's trace into one Trace Event Format JSON file (``chrome_trace``).

    Collective: every rank of ``group`` calls it after its ``record_collectives`` block. The ranks
    align their clocks (Note [Chrome trace clocks]) and send each other their traces; the group's
    first rank writes the file, the clocks' offsets and error bounds in its ``otherData``.

    Args:
        trace: this rank's trace.
        path: the file the first rank writes; the other ranks ignore it.
        profile: this rank's torch.profiler trace, as ``prof.export_chrome_trace(...)`` wrote it,
            to merge: its events sit in this rank's process beside fsdp_lite's. Default None.
        group: the ranks that take part. Default: the world.

    Returns:
        The document on the first rank, None on the others.
    """
    offsets, bounds = _clock_offsets(trace, group)
    events = None if profile is None else _profile_events(profile, trace)
    everyone = all_gather_objects((trace.to_json(), events), group)
    if dist.get_rank(group) != 0:
        return None
    doc = chrome_trace(
        [CollectiveTrace.from_json(data) for data, _ in everyone],
        offsets,
        None if profile is None else [e for _, e in everyone],
    )
    doc["otherData"]["clock_error_bound_us"] = [round(b * 1e6, 3) for b in bounds]
    Path(path).write_text(json.dumps(doc))
    return doc


def _clock_offsets(
    trace: CollectiveTrace, group: dist.ProcessGroup | None
) -> tuple[list[float], list[float]]:
    """On the group's first rank: how far each rank's trace clock reads ahead of its own, and the
    bound on each one's error, in seconds (Note [Chrome trace clocks]); empty on the others."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    clock = torch.zeros(1, dtype=torch.float64, device=_object_device(group))
    offsets, bounds = [0.0], [0.0]
    for peer in range(1, world_size):
        if rank == 0:
            best = (float("inf"), 0.0)  # (round trip, offset)
            for _ in range(CLOCK_ROUNDS):
                t1 = trace.now()
                dist.send(clock, group=group, group_dst=peer)
                dist.recv(clock, group=group, group_src=peer)
                t4 = trace.now()
                best = min(best, (t4 - t1, clock.item() - (t1 + t4) / 2))
            offsets.append(best[1])
            bounds.append(best[0] / 2)
        elif rank == peer:
            for _ in range(CLOCK_ROUNDS):
                dist.recv(clock, group=group, group_src=0)
                clock.fill_(trace.now())
                dist.send(clock, group=group, group_dst=0)
    return (offsets, bounds) if rank == 0 else ([], [])


def chrome_trace(
    traces: Sequence[CollectiveTrace],
    offsets: Sequence[float] | None = None,
    profiles: Sequence[list[dict]] | None = None,
) -> dict:
    """The Trace Event Format document of ``traces`` (one per rank), as Perfetto reads it.

    One process per rank (pid = rank, named ``rank N``), with threads: ``compute`` (each unit's
    forward and backward, user spans), ``collectives`` (each one from issue to the end of this
    rank's wait; args kind, unit, phase, step, dtype, numel, bytes, group and tag, the same tag
    on every rank for the same collective), ``waits`` (from this rank's wait's begin to its end)
    and a ``memory`` counter (bytes by category, summed over units). Spans that overlap without
    nesting go to a second thread of the same name. ``ts`` is microseconds from the first event.

    Args:
        traces: one trace per rank.
        offsets: seconds each trace's clock reads ahead of the first's at one moment (Note
            [Chrome trace clocks]). Default: all 0.
        profiles: for each trace, events from its rank's torch.profiler trace with ``ts`` in
            microseconds on that trace's clock (``_profile_events``), appended as they are.
            Default: none.
    """
    offsets = list(offsets) if offsets is not None else [0.0] * len(traces)
    timed: list[dict] = []  # "ts" (and "end") in integer ns on the common clock, origin unset
    meta: list[dict] = []
    for trace, offset in zip(traces, offsets):
        events, threads = _rank_events(trace, offset)
        timed += events
        meta += _metadata(trace.rank, threads)
    for profile, offset in zip(profiles or (), offsets):
        for e in profile:
            e = dict(e)
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] = round(e["ts"] * 1e3 - offset * 1e9)
            timed.append(e)
    origin = min((e["ts"] for e in timed if isinstance(e.get("ts"), int)), default=0)
    for e in timed:
        if isinstance(e.get("ts"), int):
            e["ts"] = (e["ts"] - origin) / 1e3
        if "end" in e:
            e["dur"] = (e.pop("end") - origin) / 1e3 - e["ts"]
    return {
        "traceEvents": meta + timed,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "fsdp_lite.tools.trace.chrome_trace",
            "clock_offsets_us": [round(o * 1e6, 3) for o in offsets],
            "memory": "storage accounting by category, bytes (fsdp_lite/tools/trace.py)",
        },
    }


def _rank_events(trace: CollectiveTrace, offset: float) -> tuple[list[dict], list[str]]:
    """One rank's events (times in ns on the common clock) and its threads' names, by tid - 1."""
    pid = trace.rank

    def ns(t: float) -> int:
        return round((t - offset) * 1e9)

    threads: list[str] = []
    events: list[dict] = []

    def track(name: str, spans: list[tuple[int, int, dict]], unfinished: list[tuple[int, dict]]):
        """``spans`` as "X" events on as few threads named ``name`` as keep each one nested."""
        lanes = _lanes([(start, end) for start, end, _ in spans])
        tid = len(threads) + 1
        threads.extend(f"{name} {i + 1}" if i else name for i in range(max(lanes, default=0) + 1))
        for (start, end, event), lane in zip(spans, lanes):
            events.append(
                {**event, "ph": "X", "pid": pid, "tid": tid + lane, "ts": start, "end": end}
            )
        for start, event in unfinished:
            events.append({**event, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": start})

    spans, unfinished = [], []
    for s in trace.spans:
        is_unit = s.phase in ("forward", "backward")
        event = {
            "name": f"{s.unit or '<root>'} {s.phase}" if is_unit else s.unit,
            "cat": "compute" if is_unit else "user",
            "args": {"unit": s.unit, "phase": s.phase, "step": s.step},
        }
        if s.end is None:
            unfinished.append((ns(s.start), {**event, "name": event["name"] + " (never ended)"}))
        else:
            spans.append((ns(s.start), ns(s.end), event))
    track("compute", spans, unfinished)

    issued: dict[tuple, int] = {}  # per group, collectives issued so far: the tag's number
    collectives, waits, unfinished = [], [], []
    for r in trace.records:
        group = tuple(r.group) if r.group is not None else ()
        seq = issued.get(group, 0)
        issued[group] = seq + 1
        args = {
            "kind": r.kind,
            "unit": r.unit,
            "phase": r.phase,
            "step": r.step,
            "dtype": _dtype_name(r.dtype),
            "numel": r.numel,
            "bytes": r.nbytes,
            "group": list(group),
            "tag": f"{r.kind} #{seq} on ranks {','.join(map(str, group)) or '?'}",
        }
        name = f"{r.kind} {r.unit or '<root>'}"
        event = {"name": name, "cat": "collective", "args": args}
        if r.end is None:
            unfinished.append((ns(r.start), {**event, "name": name + " (never waited)"}))
            continue
        collectives.append((ns(r.start), ns(r.end), event))
        if r.wait_start is not None:
            waits.append(
                (ns(r.wait_start), ns(r.end), {**event, "name": f"wait {name}", "cat": "wait"})
            )
    track("collectives", collectives, unfinished)
    track("waits", waits, [])

    for m in trace.memory:
        events.append(
            {
                "name": "memory",
                "ph": "C",
                "pid": pid,
                "tid": 0,
                "ts": ns(m.time),
                "args": {cat: m.total(cat) for cat in MEMORY_CATEGORIES},
            }
        )
    return events, threads


def _lanes(spans: list[tuple[int, int]]) -> list[int]:
    """For each (start, end), the first lane where it nests in or follows what is there; a viewer
    draws the "X" events of one thread as a stack, so they must nest."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    open_ends: list[list[int]] = []  # per lane, the ends of its spans that contain the current one
    lanes = [0] * len(spans)
    for i in order:
        start, end = spans[i]
        lane = 0
        while lane < len(open_ends):
            ends = open_ends[lane]
            while ends and ends[-1] <= start:  # spans of this lane that ended by now
                ends.pop()
            if not ends or end <= ends[-1]:
                break
            lane += 1
        else:
            open_ends.append([])
        open_ends[lane].append(end)
        lanes[i] = lane
    return lanes


def _metadata(rank: int, threads: list[str]) -> list[dict]:
    """The "M" events that name a rank's process and threads and keep them in order."""
    events = [
        {"name": "process_name", "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "args": {"sort_index": rank}},
    ]
    for tid, name in enumerate(threads, 1):
        events.append({"name": "thread_name", "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "tid": tid, "args": {"sort_index": tid}})
    return [{"ph": "M", "pid": rank, "tid": 0, "ts": 0, **e} for e in events]


def _profile_events(path: str | Path, trace: CollectiveTrace) -> list[dict]:
    """This process's torch.profiler trace at ``path``: its events with ``ts`` in microseconds on
    ``trace``'s clock (Note [Chrome trace clocks]), this process as pid ``trace.rank`` and any
    other numbered one (a device's) as a process of its own, named after the rank."""
    data = json.loads(Path(path).read_text())
    wall_ns, perf_ns = time.time_ns(), time.perf_counter_ns()
    base_ns = int(data.get("baseTimeNanoseconds", 0))
    shift_us = (base_ns - (wall_ns - perf_ns) - round(trace.t0 * 1e9)) / 1e3
    host = os.getpid()
    pids: dict = {}  # a device's pid in the profile -> its pid here, past every rank's
    events = []
    for e in data.get("traceEvents", []):
        if not isinstance(e.get("pid"), int):
            continue  # kineto's own marks of the profiling window ("Spans", "Traces"), not work
        is_process_meta = e.get("ph") == "M" and str(e.get("name", "")).startswith("process_")
        if e.get("pid") == host and is_process_meta:
            continue  # the rank's own "M" events name this process
        e = dict(e)
        if e.get("pid") == host:
            e["pid"] = trace.rank
        else:
            e["pid"] = pids.setdefault(e["pid"], trace.world_size * (len(pids) + 1) + trace.rank)
            if is_process_meta and e.get("name") == "process_name":
                e["args"] = {"name": f"rank {trace.rank}: {e.get('args', {}).get('name', '')}"}
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] = e["ts"] + shift_us
        events.append(e)
    return events
