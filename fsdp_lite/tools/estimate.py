"""Planner: per-rank memory and communication of each sharding strategy, by arithmetic alone.

Before launch, not during the step: from a parameter count or a model (real or on the meta device),
`estimate()` says what each rank holds of params, grads and optimizer state, the unsharded working set,
and the collective volume per step, for every strategy side by side. No process group is needed.
`python -m fsdp_lite.estimate` prints the table; `--paper` uses the ZeRO paper's accounting.
The engine's own sharding (param.py, unit.py) adds padding that this model ignores; see Note below.
"""

# Note [Planner conventions]
#
# Memory. Ψ is the parameter count; itemsizes are bytes per element. Model states per rank follow the
# ZeRO paper (arXiv 1910.02054), "(2+2+K)Ψ": params Ψ·param_itemsize, grads Ψ·grad_itemsize,
# optimizer state K·Ψ, each divided by the shard group size when the strategy shards it. K includes
# the fp32 master copy when params are low precision (mixed-precision AdamW: 4 + 4 + 4 = 12); in
# fsdp_lite that master copy is `sharded_param` itself and the low-precision copy exists only
# unsharded, but the total is the same. Padding to a multiple of world_size is ignored (< N elements
# per parameter). GB = 1e9 bytes, as in the paper.
#
# Working set: bytes on the device beyond the resident model states, at the backward peak. Per state:
# resident and whole (not sharded, not offloaded) adds nothing; offloaded but not sharded needs the
# whole copy on the device (Ψ); sharded needs only the units in flight: for params the root (kept
# from forward into backward), the unit computing and a prefetched one (the two largest inner units
# bound them), for grads the largest unit. It needs unit sizes (the root last), so it is
# None when only a count is given and a sharded state needs it.
#
# Communication: collective volume per rank per step in elements, the paper's convention: an
# all-gather or reduce-scatter of a Ψ-element buffer counts Ψ, an all-reduce counts 2Ψ (it is a
# reduce-scatter then an all-gather). A ring sends (N-1)/N of that volume per rank, so the paper's
# 2Ψ / 3Ψ is the large-N limit of what a rank actually sends. A group of one rank moves nothing.
# All-gathers move params in param_itemsize; reduce-scatters and all-reduces move grads in
# grad_itemsize (the reduce dtype). CPU offload's host-device copies are not counted.

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

import torch.nn as nn

from fsdp_lite.api import STRATEGY_RULES, ShardingStrategy

__all__ = [
    "Collective",
    "Estimate",
    "PAPER",
    "Plan",
    "STRATEGY_SHARDING",
    "Sharding",
    "count_numel",
    "estimate",
    "machine_fit",
    "main",
    "paper_table1",
    "unit_numels",
]

GB = 1e9  # the paper's unit; see Note [Planner conventions]


@dataclass(frozen=True)
class Sharding:
    """What one strategy shards, as data; `zero` is its ZeRO paper name."""

    name: str
    zero: str
    shards_optim: bool
    shards_grads: bool
    shards_params: bool
    replicate: bool = False  # HYBRID_SHARD: shard within a group, all-reduce grads across groups


# The ZeRO paper's name for each strategy the planner models, in the order its tables list them.
ZERO_NAMES = {
    "NO_SHARD": "DDP",
    "SHARD_OPTIM": "ZeRO-1",
    "SHARD_GRAD_OP": "ZeRO-2",
    "FULL_SHARD": "ZeRO-3",
    "HYBRID_SHARD": "ZeRO-3 x R",
}


def _sharding(name: str) -> Sharding:
    """What ``name`` shards at the step's peak, read from the engine's own table (api.py).

    The optimizer steps the shards whenever params are sharded at rest; gradients are 1/N when
    reduce-scattered; params are 1/N at the peak only if freed after forward. SHARD_GRAD_OP frees
    params between steps, yet holds them whole from forward through backward: ZeRO-2 at the peak.
    """
    rules = STRATEGY_RULES[ShardingStrategy[name]]
    return Sharding(
        name,
        ZERO_NAMES[name],
        shards_optim=rules.shard_params,
        shards_grads=rules.grad_reduce == "reduce_scatter",
        shards_params=rules.shard_params and rules.reshard_after_forward,
        replicate=rules.replicate,
    )


STRATEGY_SHARDING: tuple[Sharding, ...] = tuple(_sharding(name) for name in ZERO_NAMES)


@dataclass(frozen=True)
class Collective:
    """One collective a rank joins once per step, and its volume (Note [Planner conventions])."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    what: str  # "params" | "grads"
    group_size: int
    payload_numel: float  # elements in the full buffer being gathered / reduced
    itemsize: int

    @property
    def volume_numel(self) -> float:
        if self.group_size == 1:
            return 0.0
        # all-reduce = reduce-scatter + all-gather: twice the payload
        return 2 * self.payload_numel if self.kind == "all_reduce" else self.payload_numel

    @property
    def volume_nbytes(self) -> float:
        return self.volume_numel * self.itemsize


@dataclass(frozen=True)
class Estimate:
    """One strategy's per-rank memory and per-step communication; bytes are floats (Ψ/N need not divide)."""

    sharding: Sharding
    param_nbytes: float
    grad_nbytes: float
    optim_nbytes: float
    working_set_nbytes: float | None  # None: needs unit sizes
    offload: bool
    collectives: tuple[Collective, ...]

    @property
    def states_nbytes(self) -> float:
        """Model states per rank: params + grads + optimizer state, wherever they live."""
        return self.param_nbytes + self.grad_nbytes + self.optim_nbytes

    @property
    def device_nbytes(self) -> float | None:
        resident = 0.0 if self.offload else self.states_nbytes
        if self.working_set_nbytes is None:
            return None
        return resident + self.working_set_nbytes

    @property
    def cpu_nbytes(self) -> float:
        return self.states_nbytes if self.offload else 0.0

    @property
    def comm_numel(self) -> float:
        return sum(c.volume_numel for c in self.collectives)

    @property
    def comm_nbytes(self) -> float:
        return sum(c.volume_nbytes for c in self.collectives)


@dataclass(frozen=True)
class Plan:
    """The inputs of one `estimate()` call and one `Estimate` per strategy, in STRATEGY_SHARDING order."""

    numel: int
    world_size: int
    shard_size: int
    param_itemsize: int
    grad_itemsize: int
    optim_bytes_per_param: int
    offload: bool
    unit_numels: tuple[int, ...] | None
    estimates: tuple[Estimate, ...]

    def __getitem__(self, name: str) -> Estimate:
        """Look up by strategy name or ZeRO name: plan["FULL_SHARD"] or plan["ZeRO-3"]."""
        for e in self.estimates:
            if name in (e.sharding.name, e.sharding.zero):
                return e
        raise KeyError(name)


# ZeRO paper accounting: fp16 params and grads, mixed-precision Adam K = 12 (fp32 params, m, v)
PAPER = dict(param_itemsize=2, grad_itemsize=2, optim_bytes_per_param=12)


def count_numel(module: nn.Module) -> int:
    """Parameter count of `module`; works on the meta device, and counts a shared parameter once."""
    return sum(p.numel() for p in module.parameters())


def unit_numels(module: nn.Module, unit_classes: Iterable[type[nn.Module]]) -> tuple[int, ...]:
    """Numel of each unit if every module of `unit_classes` were wrapped (like ModuleWrapPolicy).

    Nested units own their own params, and the root unit owns what no inner unit does, as in
    wrap.py. Returns inner units first (post-order), then the root if it owns any params.
    """
    classes = tuple(unit_classes)
    numels: list[int] = []
    seen: set[int] = set()  # a shared parameter belongs to the first unit that reaches it

    def own_numel(m: nn.Module) -> int:
        numel = 0
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                numel += p.numel()
        for child in m.children():
            if isinstance(child, classes):
                numels.append(own_numel(child))
            else:
                numel += own_numel(child)
        return numel

    root_numel = own_numel(module)
    if root_numel:
        numels.append(root_numel)
    return tuple(numels)


def _working_set(
    s: Sharding, numel: int, units: Sequence[int] | None, p_size: int, g_size: int, offload: bool
) -> float | None:
    """Transient device bytes at the backward peak; see Note [Planner conventions]."""
    params_in_flight = grads_in_flight = None
    if units:
        # The root (last) keeps its params from forward into backward; beside it, the unit
        # computing and the one prefetched: bounded by the two largest inner units.
        *inner, root = units
        params_in_flight = root + sum(sorted(inner, reverse=True)[:2])
        grads_in_flight = max(units)  # the unit whose grads are being reduced
    total = 0.0
    for sharded, itemsize, in_flight in (
        (s.shards_params, p_size, params_in_flight),
        (s.shards_grads, g_size, grads_in_flight),
    ):
        if sharded:
            if in_flight is None:
                return None
            total += in_flight * itemsize
        elif offload:
            total += numel * itemsize  # computed on the device whole, stored on the CPU
    return total


def _collectives(
    s: Sharding, numel: int, shard_size: int, world_size: int, p_size: int, g_size: int
):
    group = shard_size if s.replicate else world_size
    if not s.shards_optim:  # DDP: every rank steps every param, so all-reduce the grads
        return (Collective("all_reduce", "grads", world_size, numel, g_size),)
    if not s.shards_grads:
        # fsdp_lite's ZeRO-1 all-reduces, so every rank keeps the whole averaged gradient, then
        # gathers the stepped params: 3Ψ. The paper's ZeRO-1 reduce-scatters instead (2Ψ); that
        # traffic with less memory is SHARD_GRAD_OP.
        return (
            Collective("all_reduce", "grads", world_size, numel, g_size),
            Collective("all_gather", "params", world_size, numel, p_size),
        )
    # ZeRO-2 reduce-scatters grads and all-gathers the stepped params: the paper's 2Ψ
    out = [Collective("reduce_scatter", "grads", group, numel, g_size)]
    # ZeRO-3 gathers params before forward and again before backward: 3Ψ with the reduce-scatter
    out += [Collective("all_gather", "params", group, numel, p_size)] * (
        2 if s.shards_params else 1
    )
    if s.replicate:  # HYBRID_SHARD: only this rank's 1/shard_size grad shard crosses replicas
        out.append(
            Collective("all_reduce", "grads", world_size // shard_size, numel / group, g_size)
        )
    return tuple(out)


def estimate(
    model: int | float | nn.Module,
    world_size: int,
    *,
    shard_size: int | None = None,
    param_itemsize: int = 4,
    grad_itemsize: int | None = None,
    optim_bytes_per_param: int | None = None,
    offload: bool = False,
    units: Sequence[int] | None = None,
    unit_classes: Iterable[type[nn.Module]] | None = None,
) -> Plan:
    """Per-rank memory and communication of every strategy in STRATEGY_SHARDING.

    Args:
        model: a parameter count, or an nn.Module (real or on the meta device) whose params are counted.
        world_size: ranks in all.
        shard_size: HYBRID_SHARD's shard group size; must divide world_size. Default min(8, world_size),
            one node of 8 devices.
        param_itemsize: bytes per param element as computed with (2 for bf16). Default 4.
        grad_itemsize: bytes per grad element, and the reduce dtype. Default param_itemsize.
        optim_bytes_per_param: K, optimizer state bytes per param. Default AdamW: 8 (fp32 exp_avg and
            exp_avg_sq), plus 4 for an fp32 master copy when param_itemsize < 4.
        offload: params, grads and optimizer state live on the CPU (CPUOffload(offload_params=True)).
        units: numel of each unit, the root last (as `unit_numels` returns), for the working set.
            Default: from `unit_classes`, else unknown.
        unit_classes: with a module, wrap every module of these classes into a unit (see unit_numels).

    Returns:
        A Plan; index it by strategy name, e.g. plan["FULL_SHARD"].states_nbytes.
    """
    if isinstance(model, nn.Module):
        if units is None and unit_classes is not None:
            units = unit_numels(model, unit_classes)
        numel = count_numel(model)
    else:
        numel = round(model)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shard_size = min(8, world_size) if shard_size is None else shard_size
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(f"shard_size {shard_size} must divide world_size {world_size}")
    grad_itemsize = param_itemsize if grad_itemsize is None else grad_itemsize
    if optim_bytes_per_param is None:
        optim_bytes_per_param = 8 + (4 if param_itemsize < 4 else 0)

    estimates = []
    for s in STRATEGY_SHARDING:
        group = shard_size if s.replicate else world_size

        def per_rank(nbytes: float, sharded: bool, group: int = group) -> float:
            return nbytes / group if sharded else nbytes

        estimates.append(
            Estimate(
                sharding=s,
                param_nbytes=per_rank(numel * param_itemsize, s.shards_params),
                grad_nbytes=per_rank(numel * grad_itemsize, s.shards_grads),
                optim_nbytes=per_rank(numel * optim_bytes_per_param, s.shards_optim),
                working_set_nbytes=_working_set(
                    s, numel, units, param_itemsize, grad_itemsize, offload
                ),
                offload=offload,
                collectives=_collectives(
                    s, numel, shard_size, world_size, param_itemsize, grad_itemsize
                ),
            )
        )
    return Plan(
        numel=numel,
        world_size=world_size,
        shard_size=shard_size,
        param_itemsize=param_itemsize,
        grad_itemsize=grad_itemsize,
        optim_bytes_per_param=optim_bytes_per_param,
        offload=offload,
        unit_numels=None if units is None else tuple(units),
        estimates=tuple(estimates),
    )


def _gb(nbytes: float | None) -> str:
    """GB as the paper prints it: one decimal from 1 GB up (1.875 -> 1.9), two digits below (0.12)."""
    if nbytes is None:
        return "-"
    gb = nbytes / GB
    if gb < 1:
        return "0" if gb == 0 else f"{gb:.2g}"
    # half up, as the paper rounds (41.25 -> 41.3); float formatting would round half to even
    return str(Decimal(repr(gb)).quantize(Decimal("0.1"), ROUND_HALF_UP)).removesuffix(".0")


def _count(numel: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if numel >= scale:
            return f"{numel / scale:g}{suffix}"
    return f"{numel:g}"


def _largest(numel: float) -> str:
    """A parameter count to 3 digits, rounded down: 1.58125e9 -> 1.58B."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3), ("", 1)):
        if numel >= scale:
            digits = max(0, 3 - len(str(int(numel // scale))))
            value = Decimal(repr(numel / scale)).quantize(Decimal(1).scaleb(-digits), ROUND_DOWN)
            return f"{value}{suffix}"
    return "0"


def _render(rows: list[list[str]]) -> str:
    # output is ASCII (psi, not the Greek letter): expecttest pins it inline, and only ASCII round-trips
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    """The side-by-side table the CLI prints."""
    head = (
        f"psi = {_count(plan.numel)} params, world size {plan.world_size}"
        f" (HYBRID_SHARD: {plan.world_size // plan.shard_size} x {plan.shard_size}),"
        f" bytes/param: params {plan.param_itemsize}, grads {plan.grad_itemsize},"
        f" optimizer K = {plan.optim_bytes_per_param}"
        f"{', CPU offload' if plan.offload else ''}. GB = 1e9 bytes, per rank."
    )
    rows = [
        ["strategy", "ZeRO", "params", "grads", "optim", "states", "working", "device", "cpu"]
        + ["comm/step", "comm GB"]
    ]
    for e in plan.estimates:
        rows.append(
            [e.sharding.name, e.sharding.zero]
            + [_gb(b) for b in (e.param_nbytes, e.grad_nbytes, e.optim_nbytes, e.states_nbytes)]
            + [_gb(e.working_set_nbytes), _gb(e.device_nbytes), _gb(e.cpu_nbytes)]
            + [f"{e.comm_numel / plan.numel:.3g}psi" if plan.numel else "0psi", _gb(e.comm_nbytes)]
        )
    foot = (
        "states = params + grads + optim; working = transient unsharded bytes at the backward peak"
        " ('-': needs unit sizes); comm = collective volume per rank (all-reduce = 2psi; a ring sends"
        " (N-1)/N of it)."
    )
    return "\n".join([head, _render(rows), foot])


def _fit(per_node: float, per_param: float, budget: float) -> list[str]:
    """Whether states of ``per_node`` bytes fit ``budget``, and the largest count that would."""
    largest = _largest(budget / per_param) if per_param else "-"
    return ["yes" if per_node <= budget else "no", largest]


def machine_fit(plan: Plan, ram_bytes: float, disk_bytes: float, ranks_per_node: int) -> str:
    """Whether each strategy's model states fit a node's RAM (states in memory, the CPU as the
    device or CPU offload) or its disk (disk offload: the states in files, RAM holds only the
    working set), and the largest parameter count that would, at this plan's bytes per parameter.

    Ignores the working set (it needs unit sizes) and the page cache, which the kernel reclaims.
    The disk tier is modelled where every state is sharded at the step's peak (FULL_SHARD,
    HYBRID_SHARD); the others hold whole params or grads in RAM during the step.
    """
    rows = [["strategy", "states/node", "in RAM", "largest in RAM", "on disk", "largest on disk"]]
    for e in plan.estimates:
        per_node = e.states_nbytes * ranks_per_node
        per_param = per_node / plan.numel if plan.numel else 0.0
        on_disk = e.sharding.shards_params and e.sharding.shards_grads
        disk = _fit(per_node, per_param, disk_bytes) if on_disk else ["not modelled", "-"]
        rows.append([e.sharding.name, _gb(per_node), *_fit(per_node, per_param, ram_bytes), *disk])
    head = (
        f"A node of {_gb(ram_bytes)} GB RAM and {_gb(disk_bytes)} GB free disk, {ranks_per_node}"
        f" rank(s) a node; states/node = per-rank states x ranks a node."
    )
    foot = (
        "largest: the parameter count whose states fill it, at these bytes per parameter (the"
        " working set and the page cache not counted)."
    )
    return "\n".join([head, _render(rows), foot])


PAPER_NUMELS = (7.5e9, 128e9, 1e12)
PAPER_WORLD_SIZES = (1, 4, 16, 64, 256, 1024)


def paper_table1() -> str:
    """The ZeRO paper's Table 1 grid, computed with PAPER accounting (not copied from the paper)."""
    rows = [["psi", "Nd", "P_os (ZeRO-1)", "P_os+g (ZeRO-2)", "P_os+g+p (ZeRO-3)"]]
    for numel in PAPER_NUMELS:
        for world_size in PAPER_WORLD_SIZES:
            plan = estimate(numel, world_size, **PAPER)
            rows.append(
                [_count(numel), str(world_size)]
                + [_gb(plan[z].states_nbytes) for z in ("ZeRO-1", "ZeRO-2", "ZeRO-3")]
            )
    head = "ZeRO (arXiv 1910.02054) Table 1: model states per device in GB (1e9 bytes), (2+2+K)psi, K = 12"
    return head + "\n" + _render(rows)


def _parse_count(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper())
    return float(text[:-1]) * scale if scale else float(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lite.estimate",
        description="Per-rank memory and communication of each sharding strategy.",
    )
    parser.add_argument("--params", type=_parse_count, help="parameter count, e.g. 7.5e9 or 7.5B")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--shard-size", type=int, help="HYBRID_SHARD shard group size (default 8)")
    parser.add_argument("--param-bytes", type=int, help="bytes per param element (default 4)")
    parser.add_argument("--grad-bytes", type=int, help="bytes per grad element (default params')")
    parser.add_argument("--optim-bytes", type=int, help="K: optimizer bytes/param (default AdamW)")
    parser.add_argument("--offload", action="store_true", help="params/grads/optimizer on the CPU")
    parser.add_argument("--ram-gb", type=float, help="a node's RAM, GB: say where the states fit")
    parser.add_argument("--disk-gb", type=float, help="a node's free disk for offload_dir, GB")
    parser.add_argument("--ranks-per-node", type=int, help="default: the world size")
    parser.add_argument(
        "--paper",
        action="store_true",
        help="ZeRO paper accounting (2+2+K, K=12); without --params, print its Table 1",
    )
    args = parser.parse_args(argv)

    if args.paper and args.params is None:
        print(paper_table1())
        return 0
    if args.params is None:
        parser.error("--params is required (or --paper alone for the paper's Table 1)")
    kwargs = dict(PAPER) if args.paper else {}
    for key, value in (
        ("param_itemsize", args.param_bytes),
        ("grad_itemsize", args.grad_bytes),
        ("optim_bytes_per_param", args.optim_bytes),
    ):
        if value is not None:
            kwargs[key] = value
    plan = estimate(
        args.params, args.world_size, shard_size=args.shard_size, offload=args.offload, **kwargs
    )
    print(format_plan(plan))
    if args.ram_gb is not None or args.disk_gb is not None:
        ram, disk = (args.ram_gb or 0.0) * GB, (args.disk_gb or 0.0) * GB
        print()
        print(machine_fit(plan, ram, disk, args.ranks_per_node or args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
