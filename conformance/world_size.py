"""``python -m conformance --world-sizes 1,2,4``: the same training at several world sizes, and how
many bits change between them (docs/conformance.md, "Across world sizes").

In exact arithmetic data parallelism at N ranks trains what one process does on the global batch;
in floating point each rank sums its share and the ranks' sums meet in the collective's order, so
every N gives other bits. This mode trains each case (implementation, strategy, precision,
feature) a few steps at every world size asked for, on one global batch per step that is the same
at every N, and reports per stage (loss, gradients, parameters, optimizer state, after every step)
the largest difference from the smallest world size, in ulps and absolute.

* A plain implementation (and the DDP reference, always run) cuts the global batch into N equal
  local batches: each rank's mean loss, gradients averaged by the implementation; the reported
  loss is the ranks' mean. Its numbers are information.
* An implementation whose adapter has a canonical mode (``Adapter.canonical``, e.g.
  ``fsdp_lite_canonical``) runs its own ``micro_batches`` of the global batch (V of them in all),
  one synced backward each, reports ``mean`` of the micro-batch losses and clips with its own
  ``clip_grad_norm_``. When the adapter claims it (``world_size_invariant``), any difference at
  any stage fails the case, and the run's exit status is 1.

One launch per world size runs every case in one process group, as the suite's ordinary runs do;
rank 0 writes the full tensors of every stage to a scratch file per case as soon as the case is
done, which the launching process compares once every world size has run. A rank that dies ends
only its case, recorded ``crashed`` (exit status 4), and fresh ranks go on with the next
(launcher.py, Note [Results that survive a rank]).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DDP",
    "FEATURES",
    "PRECISIONS",
    "STAGES",
    "compare_runs",
    "format_table",
    "global_parts",
    "parse_world_sizes",
    "rank_main",
    "run",
    "ulps",
    "world_size_cases",
]

DDP = "ddp"  # the suite's DDP reference, run as one more implementation (strategy "-")
DEFAULT_MODEL = "lm_untied"
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "SHARD_OPTIM")
PRECISIONS = ("fp32", "bf16r32")  # fp32; bf16 params with fp32 reduce
# frozen_in_unit: frozen parameters beside trainable ones in a unit (the zoo's transformers only)
FEATURES = ("plain", "clip_grad_norm", "frozen_in_unit")
_FREEZABLE = ("lm", "lm_untied", "wide_lm")
STAGES = ("loss", "grads", "params", "optim_state")
# /2: a case's status may be "crashed" (its "crashes" say how, by world size), and the report
# has "crashes_outside_cases" (launcher.py)
SCHEMA = "conformance-world-sizes/2"


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4"`` as [1, 2, 4]: at least two distinct positive sizes, sorted."""
    try:
        sizes = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        sizes = []
    if len(sizes) < 2 or sizes[0] < 1:
        raise ValueError(f"--world-sizes takes two or more sizes, e.g. 1,2,4, not {text!r}")
    return sizes


def default_virtual_batches(world_sizes: Sequence[int]) -> int:
    """V: the smallest power of two that is at least 4 and at least every world size."""
    v = 4
    while v < max(world_sizes):
        v *= 2
    return v


def global_parts(world_sizes: Sequence[int], virtual_batches: int) -> int:
    """How many of the zoo's per-rank batches make one global batch: a multiple of V and of
    every world size, so that both cuts are equal."""
    return math.lcm(virtual_batches, *world_sizes)


def global_batch(model: str, step: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: the zoo's batches of ranks 0 .. parts - 1, concatenated."""
    from conformance.zoo import local_batch

    pieces = [local_batch(model, step, 0, p) for p in range(parts)]
    return torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces])


def case_key(name: str) -> str:
    """A case's name without its world size: what is compared across world sizes."""
    return name.rsplit("/", 1)[0]


def world_size_cases(adapters: dict[str, Any], world_size: int, model: str) -> list:
    """Every case of a ``--world-sizes`` run at ``world_size``: DDP, then each implementation's
    strategies (HYBRID_SHARD and SHARD_OPTIM where it has them) x PRECISIONS x FEATURES (the
    freezing one on the zoo's transformers only)."""
    from conformance.matrix import CORE_STRATEGIES, Case

    features = [f for f in FEATURES if f != "frozen_in_unit" or model in _FREEZABLE]
    cases = [
        Case(DDP, "-", precision, feature, model, world_size)
        for precision in PRECISIONS
        for feature in features
    ]
    for name, adapter in adapters.items():
        known = set(adapter.strategies())
        for strategy in STRATEGIES:
            if strategy not in CORE_STRATEGIES and strategy not in known:
                continue
            for precision in PRECISIONS:
                for feature in features:
                    cases.append(Case(name, strategy, precision, feature, model, world_size))
    return cases


# ---- the ranks: one launch per world size ------------------------------------------------------


class _PeerFailed(Exception):
    pass


class _WorldSizeCase:
    """One case on one rank at this world size: build, train, hand each stage's full tensors on."""

    def __init__(self, ctx, case, adapter, steps: int, scratch_dir: str, parts: int) -> None:
        self.ctx, self.case, self.adapter = ctx, case, adapter
        self.steps, self.scratch_dir, self.parts = steps, scratch_dir, parts
        self.stage = "wrap"
        self.record: list[dict[str, dict[str, torch.Tensor | None]]] = []

    def run(self) -> dict[str, Any]:
        import traceback

        from conformance.adapters.base import Unsupported

        try:
            if self.adapter is None:  # DDP
                self._train()
            else:
                with self.adapter.case_context(self.case):
                    self._train()
            return {"error": None}
        except _PeerFailed:
            return {"error": None, "peer_failed": True}
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - runner.py, Note [A case's own error]
            unsupported = isinstance(e, Unsupported) or (
                isinstance(e, NotImplementedError) and self.stage == "wrap"
            )
            self.ctx.flag(True, f"{self.stage}, after an error")
            return {
                "error": f"{type(e).__name__}: {e}".strip(),
                "stage": self.stage,
                "unsupported": unsupported,
                "traceback": traceback.format_exc(),
            }

    def _done(self) -> None:
        if self.ctx.flag(False, self.stage):
            raise _PeerFailed(self.stage)

    def _build(self):
        from conformance.matrix import FEATURES as ALL_FEATURES
        from conformance.matrix import PRECISIONS as ALL_PRECISIONS
        from conformance.reference import prepare_model
        from conformance.runner import _CaseRun
        from conformance.training import ReplicaTrainer
        from conformance.zoo import spec

        ctx, case = self.ctx, self.case
        if case.impl == DDP:
            model_spec = spec(case.model)
            feature = ALL_FEATURES[case.feature]
            model = prepare_model(model_spec, feature, 0, ctx.device, for_impl=False)
            precision = ALL_PRECISIONS[case.precision]
            return ReplicaTrainer(model, model_spec, precision, ctx.device, ctx.group), None
        trainer = _CaseRun(ctx, case, self.adapter, self.steps, self.scratch_dir)._build(seed=0)
        return trainer, self.adapter.canonical(trainer.model)

    def _train(self) -> None:
        from conformance.adapters.base import full_tensor
        from conformance.matrix import FEATURES as ALL_FEATURES
        from conformance.training import GRAD_NORM_KEY

        ctx, case = self.ctx, self.case
        feature = ALL_FEATURES[case.feature]
        self.stage = "wrap"
        trainer, canon = self._build()
        self._done()
        n, rank = ctx.world_size, ctx.rank
        for step in range(self.steps):
            self.stage = f"step {step + 1}"
            x, y = global_batch(case.model, step, self.parts)
            if canon is not None:
                losses = [
                    trainer.forward_backward([(xm, ym)]) for xm, ym in canon.micro_batches(x, y)
                ]
                loss = canon.mean(losses).float()
            else:
                cut = x.size(0) // n
                mine = slice(rank * cut, (rank + 1) * cut)
                loss = trainer.forward_backward([(x[mine], y[mine])]).float().clone()
                dist.all_reduce(loss, group=ctx.group)
                loss /= n
            self._done()
            trainer.finish_backward()
            norm = None
            if feature.clip_grad_norm is not None:
                if canon is not None:
                    norm = canon.clip_grad_norm_(feature.clip_grad_norm, feature.clip_norm_type)
                else:
                    norm = trainer.clip_grad_norm_(feature.clip_grad_norm, feature.clip_norm_type)
                norm = full_tensor(norm).detach().float()
            grads = trainer.grads()
            if norm is not None:
                grads[GRAD_NORM_KEY] = norm.reshape(())
            self._done()
            trainer.step()
            params = trainer.params()
            optim_state = trainer.optim_state()
            self._done()
            if rank == 0:
                self.record.append(
                    {
                        "loss": {"loss": loss.detach().cpu().reshape(())},
                        "grads": _cpu(grads),
                        "params": _cpu(params),
                        "optim_state": _cpu(optim_state),
                    }
                )


def _cpu(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {k: None if t is None else t.detach().cpu().clone() for k, t in tensors.items()}


def _settings(args: argparse.Namespace) -> tuple[list[int], int, int, str]:
    worlds = parse_world_sizes(args.world_sizes)
    virtual = args.virtual_batches or default_virtual_batches(worlds)
    model = DEFAULT_MODEL
    if args.model is not None:
        from conformance.zoo import SPECS, register_model, spec_from_factory

        model_spec = spec_from_factory(args.model)
        if SPECS.get(model_spec.name) is None:
            register_model(model_spec)
        model = model_spec.name
    return worlds, virtual, global_parts(worlds, virtual), model


def _adapters(args: argparse.Namespace, virtual: int) -> dict[str, Any]:
    from conformance.adapters import get_adapter

    adapters = {}
    for name in args.impl:
        if name == DDP:
            continue  # always run: the suite's reference
        adapter = get_adapter(name)
        adapter.virtual_batches = virtual
        adapters[adapter.name] = adapter
    return adapters


def selected_cases(args: argparse.Namespace, world_size: int) -> list:
    from conformance.matrix import select

    _, virtual, _, model = _settings(args)
    return select(world_size_cases(_adapters(args, virtual), world_size, model), args.only)


def rank_main(args: argparse.Namespace, device: torch.device, events=None) -> None:
    """One rank of one world size's launch: run the cases of ``--case-range``; rank 0 saves what
    each recorded in ``--world-size-run``'s directory as soon as it is done, and appends its
    events (launcher.py) to ``events``."""
    from conformance.cli import _case_range
    from conformance.runner import RunContext, heartbeat

    worlds, virtual, parts, model = _settings(args)
    adapters = _adapters(args, virtual)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    cases = selected_cases(args, world_size)
    first, last = _case_range(args.case_range, len(cases))
    out = Path(args.world_size_run)
    ctx = RunContext(device, args.timeout)

    def emit(event: dict[str, Any]) -> None:
        if events is not None:
            events.write(event)

    emit({"event": "run", "cases": [c.name for c in cases], "meta": {"world_size": world_size}})
    if rank == 0:
        torch.save({"world_size": world_size, "threads": torch.get_num_threads()}, out / "meta.pt")
        if first == 0:
            print(
                f"world size {world_size}: {len(cases)} cases, {args.steps} steps each, global "
                f"batch of {parts} per-rank batches, V = {virtual}",
                flush=True,
            )
    for index in range(first, last):
        case = cases[index]
        emit({"event": "start", "index": index, "case": case.name, "time": time.time()})
        start = time.perf_counter()
        adapter = adapters.get(case.impl)
        reason = None if adapter is None else adapter.unsupported_reason(case)
        if reason is not None:
            entry: dict[str, Any] = {"status": "unsupported", "reason": reason}
        else:
            heartbeat("busy", "started")
            scratch = ctx.scratch_dir(index)
            run = _WorldSizeCase(ctx, case, adapter, args.steps, scratch, parts)
            outcome = run.run()
            outcomes: list[Any] = [None] * world_size
            dist.all_gather_object(outcomes, outcome, group=ctx.control_group)
            ctx.remove_scratch(scratch)
            errors = [(r, o) for r, o in enumerate(outcomes) if o.get("error")]
            if errors:
                if all(o["unsupported"] for _, o in errors):
                    entry = {"status": "unsupported", "reason": errors[0][1]["error"]}
                else:
                    errors.sort(key=lambda ro: ("timeout" in ro[1]["error"].lower(), ro[0]))
                    r, o = errors[0]
                    entry = {
                        "status": "error",
                        "reason": f"rank {r} raised in {o['stage']}: {o['error']}",
                        "traceback": o["traceback"],
                    }
                    ctx.rebuild()
            else:
                entry = {"status": "ran", "steps": run.record}
            heartbeat("idle", "done")
        entry["seconds"] = round(time.perf_counter() - start, 2)
        if rank == 0:
            torch.save({"key": case_key(case.name), "entry": entry}, out / f"case{index}.pt")
            line = f"[{index + 1:>{len(str(len(cases)))}}/{len(cases)}] {entry['status']:<11} "
            line += f"{case.name}  {entry['seconds']:.1f}s"
            if entry.get("reason"):
                line += f"  ({entry['reason'].splitlines()[0][:160]})"
            print(line, flush=True)
        emit({"event": "case", "index": index, "name": case.name, "status": entry["status"]})
    ctx.remove_scratch(ctx.scratch_root)
    emit({"event": "end"})


# ---- the launching process: compare ------------------------------------------------------------


_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
           torch.float64: torch.int64}  # fmt: skip


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Each float's place among its dtype's representable values (as float64): adjacent floats
    are 1 apart, -0.0 and 0.0 are both 0."""
    bits = t.contiguous().view(_INT_OF[t.dtype]).long()
    magnitude = bits & ((1 << (torch.iinfo(_INT_OF[t.dtype]).bits - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude).double()


def ulps(value: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The largest difference between ``value`` and ``reference`` in ulps, and absolute.

    Ulps count the representable values of ``reference``'s dtype between the two (the distance
    of their bit patterns, read in order): 1 for neighbours, whatever the magnitude, and bounded
    near zero where a spacing-relative count is not. Equal values (infinities included) and NaN
    against NaN count 0; NaN against a number, another dtype or another shape is infinite.
    """
    if value.shape != reference.shape or value.dtype != reference.dtype:
        return math.inf, math.inf
    if value.numel() == 0:
        return 0.0, 0.0
    v, r = value.double(), reference.double()
    same = (v == r) | (v.isnan() & r.isnan())
    diff = torch.where(same, torch.zeros_like(v), (v - r).abs())
    diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
    if reference.dtype not in _INT_OF:
        top = diff.max().item()
        return top, top
    steps = torch.where(same, torch.zeros_like(v), (_ordered(value) - _ordered(reference)).abs())
    steps = torch.where(diff.isinf() & ~same, torch.full_like(steps, math.inf), steps)
    return steps.max().item(), diff.max().item()


def _stage_diff(got: dict, ref: dict) -> tuple[float, float]:
    worst_ulps = worst_abs = 0.0
    for name in set(got) | set(ref):
        a, b = got.get(name), ref.get(name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            u = d = math.inf  # a tensor (or a gradient) on one side only
        else:
            u, d = ulps(a, b)
        worst_ulps, worst_abs = max(worst_ulps, u), max(worst_abs, d)
    return worst_ulps, worst_abs


def compare_runs(runs: dict[int, dict], invariant: Callable[[str], bool]) -> list[dict]:
    """Per case (in the first run's order), its status and, for every world size after the
    smallest that ran it, per stage the largest difference over steps and tensors."""
    worlds = sorted(runs)
    keys: list[str] = []
    for w in worlds:
        keys += [k for k in runs[w]["cases"] if k not in keys]
    rows = []
    for key in keys:
        impl, strategy, precision, feature, model = key.split("/")
        entries = {w: runs[w]["cases"].get(key) for w in worlds}
        row: dict[str, Any] = {
            "name": key,
            "impl": impl,
            "strategy": strategy,
            "precision": precision,
            "feature": feature,
            "model": model,
            "invariant": invariant(impl),
            "base_world_size": None,
            "world_sizes": {},
            "unsupported": {},
            "errors": {},
            "crashes": {},  # world size -> how a rank died (launcher.py)
        }
        ran = [w for w in worlds if entries[w] and entries[w]["status"] == "ran"]
        for w in worlds:
            e = entries[w]
            if e is None:
                continue
            if e["status"] == "unsupported":
                row["unsupported"][str(w)] = e["reason"]
            elif e["status"] in ("error", "crashed"):
                row["errors"][str(w)] = e["reason"]
            if e["status"] == "crashed":
                row["crashes"][str(w)] = e["crash"]
        if ran:
            base = ran[0]
            row["base_world_size"] = base
            for w in ran[1:]:
                per_stage = {}
                for stage in STAGES:
                    worst = {"max_ulps": 0.0, "max_abs": 0.0, "bitwise": True, "first_step": None}
                    ref_steps, got_steps = entries[base]["steps"], entries[w]["steps"]
                    for step, (got, ref) in enumerate(zip(got_steps, ref_steps), start=1):
                        u, d = _stage_diff(got[stage], ref[stage])
                        if u > 0 or d > 0:
                            worst["bitwise"] = False
                            worst["first_step"] = worst["first_step"] or step
                        worst["max_ulps"] = max(worst["max_ulps"], u)
                        worst["max_abs"] = max(worst["max_abs"], d)
                    per_stage[stage] = worst
                row["world_sizes"][str(w)] = per_stage
        if row["crashes"]:
            row["status"] = "crashed"
        elif row["errors"]:
            row["status"] = "error"
        elif not ran:
            row["status"] = "unsupported"
        elif len(ran) == 1:
            row["status"] = "unsupported"  # nothing to compare with
        elif not row["invariant"]:
            row["status"] = "measured"
        elif all(s["bitwise"] for per in row["world_sizes"].values() for s in per.values()):
            row["status"] = "passed"
        else:
            row["status"] = "failed"
        rows.append(row)
    return rows


def _cell(s: dict) -> str:
    if s["bitwise"]:
        return "0"
    u = s["max_ulps"]
    return "inf" if math.isinf(u) else f"{u:.2g}"


_HEADER = ("impl", "strategy", "precision", "feature", "N", "loss", "grads", "params",
           "optim_state", "max abs", "status")  # fmt: skip


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per case and world size compared (cases that ran nowhere else: one line)."""
    out = []
    for row in rows:
        head = [row["impl"], row["strategy"], row["precision"], row["feature"]]
        if not row["world_sizes"]:
            why = row["errors"] or row["unsupported"]
            note = "; ".join(f"N={w}: {r.splitlines()[0][:80]}" for w, r in why.items())
            out.append([*head, "-", "", "", "", "", "", f"{row['status']} ({note})"])
            continue
        for w, per in row["world_sizes"].items():
            top = max(s["max_abs"] for s in per.values())
            out.append(
                [
                    *head,
                    f"{row['base_world_size']}->{w}",
                    *(_cell(per[s]) for s in STAGES),
                    "0" if top == 0 else f"{top:.1e}",
                    row["status"],
                ]
            )
    return out


def format_table(rows: list[dict], markdown: bool = False) -> str:
    body = [list(_HEADER), *table_rows(rows)]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in body]
        lines.insert(1, "|" + "---|" * len(_HEADER))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in body) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exit_status(rows: list[dict], outside: Sequence[dict] = ()) -> int:
    """4 when a rank died (a case crashed, or outside any case); else 1 when an invariant case
    differs at some world size, or a case raised; else 0 (report.py's exit statuses)."""
    if outside or any(r["status"] == "crashed" for r in rows):
        return 4
    return int(any(r["status"] in ("failed", "error") for r in rows))


def run(args: argparse.Namespace, argv: list[str], launchers: Callable[[int], Any]) -> int:
    """The launching process: the launches of each world size (fresh ranks after a dead one),
    then the comparison and the reports. ``launchers(nproc)`` gives a launcher.Launcher."""
    from conformance import report
    from conformance.adapters import get_adapter
    from conformance.launcher import run_surviving

    worlds, virtual, parts, model = _settings(args)
    # The thread count changes how a matmul sums: the same in every launch (torchrun sets 1 for
    # several ranks per node, and nothing for one).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    invariant = {DDP: False}
    for name in args.impl:
        if name != DDP:
            adapter = get_adapter(name)
            invariant[adapter.name] = adapter.world_size_invariant
    start = time.perf_counter()
    runs: dict[int, dict] = {}
    outside: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="conformance-ws-") as scratch:
        events = Path(args.jsonl) if args.jsonl else Path(scratch) / "events.jsonl"
        events.write_text("")  # this run's lines only; every world size appends
        for w in worlds:
            out = Path(scratch) / f"ws{w}"
            out.mkdir()
            print(f"conformance: world size {w} ({w} ranks)", flush=True)
            state = run_surviving(
                launchers(w),
                [*argv, "--world-size-run", str(out)],
                events,
                retry_crashed=args.retry_crashed,
            )
            outside += [{**death, "world_size": w} for death in state.outside]
            if state.plan is None or not (out / "meta.pt").exists():
                print(f"conformance: the launch at world size {w} failed", file=sys.stderr)
                continue
            cases: dict[str, Any] = {}
            for index in sorted(set(state.results) | set(state.crashed)):
                if index in state.crashed:
                    crash = state.crashed[index]
                    key = case_key(state.starts[index]["case"])
                    cases[key] = {"status": "crashed", "reason": crash["summary"], "crash": crash}
                else:
                    saved = torch.load(out / f"case{index}.pt", weights_only=True)
                    cases[saved["key"]] = saved["entry"]
            runs[w] = {"meta": torch.load(out / "meta.pt", weights_only=True), "cases": cases}
    elapsed = time.perf_counter() - start
    threads = {w: r["meta"]["threads"] for w, r in runs.items()}
    rows = compare_runs(runs, lambda impl: invariant.get(impl, False))
    status = exit_status(rows, outside)
    print(
        f"\nthe largest difference from the smallest world size that ran the case, over "
        f"{args.steps} steps and every tensor, in ulps (the last column absolute); 0 = bitwise. "
        f"Model {model}, global batch of {parts} per-rank batches, V = {virtual}."
    )
    print(format_table(rows))
    statuses = ("passed", "failed", "measured", "unsupported", "error", "crashed")
    counts = {s: sum(r["status"] == s for r in rows) for s in statuses}
    print(
        f"\n{len(rows)} cases: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + " (passed / failed: a world-size-invariant implementation, which must show 0 "
        "everywhere; measured: information)"
    )
    for row in rows:
        if row["status"] == "failed":
            print(f"FAILED {row['name']}: differs across world sizes (it claims the same bits)")
        for w, reason in row["errors"].items():
            word = "CRASHED" if w in row["crashes"] else "ERROR"
            print(f"{word} {row['name']} at world size {w}: {reason.splitlines()[0]}")
    for death in outside:
        print(f"a rank died at world size {death['world_size']} ({death.get('where')}): "
              f"{death['summary']}")  # fmt: skip
    print(f"wall time {elapsed:.1f} s")
    doc = {
        "schema": SCHEMA,
        "config": {
            "world_sizes": worlds,
            "impls": [DDP, *[n for n in invariant if n != DDP]],
            "model": model,
            "steps": args.steps,
            "virtual_batches": virtual,
            "global_batch_parts": parts,
            "only": args.only,
            "threads": threads,
            "torch": torch.__version__,
            "seconds": round(elapsed, 2),
        },
        "exit_status": status,
        "crashes_outside_cases": outside,
        "cases": rows,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(report.json_safe(doc), indent=1, allow_nan=False) + "\n")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(format_table(rows, markdown=True) + "\n")
    return status
