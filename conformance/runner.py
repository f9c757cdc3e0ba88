"""Running cases inside one process group, in lockstep, and turning them into results.

``run_cases`` is called on every rank of an initialized process group (by the CLI, or by a test's
ranks). Each case wraps the model through its adapter, trains it a few steps next to the cached
references, compares every stage, and ends with a state-dict round trip; it gets a scratch
directory (offload files, checkpoints), the same path on every rank, removed when it ends. Ranks stay in lockstep:
see Note [Lockstep]. A case's outcome is gathered from all ranks, so every rank returns the same
``CaseResult`` list. Printing is report.py's business.

Note [Lockstep]: at the end of every stage each rank all-reduces an error flag on a separate gloo
*control* group. A rank that raises reports 1 in its next flag instead of going on; the others see
the flag at their next stage end and stop the case too, so no rank waits in a collective its peer
will never join. A rank already blocked inside a data collective is freed by the *data* group's
timeout (the backstop), and reports then. After any error the data group is rebuilt, because the
ranks may have left it with unmatched collectives.

Note [A case's own error]: whatever a case raises is that case's error, ``BaseException`` included
(DCP gathers every rank's failure into a ``CheckpointException``, which is not an ``Exception``;
a library may call ``sys.exit``): the case fails with the traceback and the run goes on. Only
``KeyboardInterrupt`` ends the run, since a person asked for that. A rank that dies natively
takes no exception at all; the launcher sees that (launcher.py, Note [Results that survive a
rank]).

Note [Progress]: the launcher tells a hang from a slow stage by who waits: ``set_heartbeat``
gives this module a callable, called with (state, where): "busy" when a case starts and each time
every rank has passed a stage end (the control group's flag), "waiting" while this rank waits in
that flag for the others to finish the stage, "idle" when the case is done. Each rank's callable
writes a small file the launching process watches: a rank waiting longer than twice the
collective timeout waits for a peer that stopped (launcher.py). A stage that is merely slow on
every rank (DeepSpeed building its native ops at the first wrap, minutes) has no rank waiting.
Nothing else changes when no callable is set.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh

from conformance.adapters.base import Adapter, Unsupported, WrapRequest
from conformance.compare import StageTally, compare, merge_tallies
from conformance.matrix import FEATURES, PRECISIONS, Case
from conformance.models import Block
from conformance.reference import (
    FRESH_SEED,
    REFERENCES,
    ReferenceCache,
    micro_batches,
    prepare_model,
)
from conformance.results import CaseResult
from conformance.tolerances import STAGES, tolerance
from conformance.training import ImplTrainer, OptimizerFactory, matrix_names, train_step
from conformance.zoo import spec

__all__ = ["CaseResult", "RunContext", "run_cases"]

log = logging.getLogger("conformance")

DEFAULT_STEPS = 3
DEFAULT_TIMEOUT_S = 60.0


class _PeerFailed(Exception):
    """Another rank failed in this case; this rank stops it too (see Note [Lockstep])."""


_heartbeat: Callable[[str, str], None] | None = None  # Note [Progress]


def set_heartbeat(hook: Callable[[str, str], None] | None) -> None:
    """Call ``hook(state, where)`` at each case's start, stage ends and end (Note [Progress])."""
    global _heartbeat
    _heartbeat = hook


_observer: Callable[[Case, int, str, Any, dict[str, Any]], None] | None = None


def set_observer(hook: Callable[[Case, int, str, Any, dict[str, Any]], None] | None) -> None:
    """Call ``hook(case, step, stage, actual, expected)`` with each stage's values before they are
    compared (``expected``: the references' by name); cli.py records loss and gradient-norm
    curves for the HTML report with it (conformance/curves.py). ``step`` is 1-based; the step
    after the state-dict round trip is ``steps + 1``."""
    global _observer
    _observer = hook


def heartbeat(state: str, where: str) -> None:
    """Tell the hook set by ``set_heartbeat`` (if any) what this rank does: "busy", "waiting"
    (for the other ranks, in the control group) or "idle" (between cases)."""
    if _heartbeat is not None:
        _heartbeat(state, where)


@dataclass
class _Outcome:
    """One rank's view of a case, gathered from every rank at the case's end."""

    error: str | None = None  # traceback
    error_summary: str | None = None  # "ExcType: message"
    unsupported: bool = False
    stage: str = ""
    tallies: dict[str, dict[str, StageTally]] = field(default_factory=dict)


class RunContext:
    """The process groups, meshes and reference recordings shared by the cases of one run."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # Longer than the data group's, so that a rank freed by the data timeout still finds its
        # peers waiting on the control group (see Note [Lockstep]).
        self.control_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=2 * timeout_s + 30)
        )
        self.references = ReferenceCache()
        self._new_data_group()
        # One directory for the run, the same path on every rank (rank 0 makes it); each case gets
        # a subdirectory for offload files and checkpoints, removed when the case ends.
        made = [tempfile.mkdtemp(prefix="conformance-") if self.rank == 0 else None]
        dist.broadcast_object_list(made, src=0, group=self.control_group)
        self.scratch_root: str = made[0]

    def scratch_dir(self, index: int) -> str:
        """Case ``index``'s directory, made on every rank (ranks may not share a file system)."""
        path = os.path.join(self.scratch_root, f"case{index}")
        os.makedirs(path, exist_ok=True)
        return path

    def remove_scratch(self, path: str) -> None:
        """Remove ``path`` on this rank, once every rank is done with it (after a collective)."""
        shutil.rmtree(path, ignore_errors=True)  # ranks sharing the directory race: ignore

    def _new_data_group(self) -> None:
        self.group = dist.new_group(
            backend=self.backend, timeout=datetime.timedelta(seconds=self.timeout_s)
        )
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        self._meshes_2d: dict[tuple[int, int], DeviceMesh] = {}

    def rebuild(self) -> None:
        """A fresh data group after a failed case (the old one may hold unmatched collectives)."""
        log.info("rebuilding the data process group after a failed case")
        self._new_data_group()  # recorded references stay valid: a partial one is never stored

    def mesh_2d(self, replicate: int, shard: int) -> DeviceMesh:
        if replicate * shard != self.world_size:
            raise ValueError(
                f"a {replicate} x {shard} mesh needs {replicate * shard} ranks, not {self.world_size}"
            )
        if (replicate, shard) not in self._meshes_2d:
            ranks = torch.arange(self.world_size).view(replicate, shard)  # (replicate, shard)
            self._meshes_2d[(replicate, shard)] = DeviceMesh(
                self.device.type, ranks, mesh_dim_names=("replicate", "shard")
            )
        return self._meshes_2d[(replicate, shard)]

    def flag(self, failed: bool, where: str = "") -> bool:
        """All-reduce an error flag on the control group; True when any rank failed. Every
        rank got past ``where`` then: progress (Note [Progress])."""
        t = torch.tensor([1.0 if failed else 0.0])
        heartbeat("waiting", where)
        dist.all_reduce(t, group=self.control_group)
        heartbeat("busy", where)
        return t.item() > 0


class _CaseRun:
    """One case on one rank: build, train and compare, stage by stage."""

    def __init__(
        self, ctx: RunContext, case: Case, adapter: Adapter, steps: int, scratch_dir: str
    ) -> None:
        self.ctx, self.case, self.adapter, self.steps = ctx, case, adapter, steps
        self.scratch_dir = scratch_dir
        self.spec = spec(case.model)
        self.feature = FEATURES[case.feature]
        self.precision = PRECISIONS[case.precision]
        self.outcome = _Outcome()
        self.outcome.tallies = {
            stage: {ref: StageTally(tolerance(case, ref, stage)) for ref in REFERENCES}
            for stage in STAGES
        }

    def run(self) -> _Outcome:
        out = self.outcome
        try:
            with self.adapter.case_context(self.case):
                self._train()
            self._stage_done("end")
        except _PeerFailed:
            pass
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - Note [A case's own error]
            out.error = traceback.format_exc()
            out.error_summary = f"{type(e).__name__}: {e}".strip()
            out.unsupported = isinstance(e, Unsupported) or (
                isinstance(e, NotImplementedError) and out.stage == "wrap"
            )
            log.debug(
                "rank %d: case %s raised in %s:\n%s",
                self.ctx.rank,
                self.case.name,
                out.stage,
                out.error,
            )
            self.ctx.flag(True, f"{out.stage}, after an error")
        return out

    def _stage_done(self, stage: str) -> None:
        if self.ctx.flag(False, stage):
            raise _PeerFailed(stage)

    def _request(self, model: torch.nn.Module) -> WrapRequest:
        ctx = self.ctx
        return WrapRequest(
            case=self.case,
            units=self.spec.units(model),
            group=ctx.group,
            device=ctx.device,
            param_dtype=self.precision.dtype,
            reduce_dtype=self.precision.reduce_dtype,
            backward_prefetch=self.feature.backward_prefetch,
            forward_prefetch=self.feature.forward_prefetch,
            cpu_offload=self.feature.cpu_offload,
            mesh=ctx.mesh,
            mesh_2d=ctx.mesh_2d,
            disk_offload=self.feature.disk_offload,
            optimizer_offload=self.feature.optimizer_offload,
            scratch_dir=self.scratch_dir,
            make_optimizer=OptimizerFactory(
                self.case.optimizer, self.feature.foreach_optimizer, matrix_names(model)
            ),
        )

    def _build(self, seed: int) -> ImplTrainer:
        model = prepare_model(self.spec, self.feature, seed, self.ctx.device, for_impl=True)
        request = self._request(model)
        wrapped = self.adapter.wrap(model, request)
        if self.feature.checkpoint_after_wrap:
            checkpoint_blocks(wrapped)
        if self.feature.checkpoint_outside_unit:
            checkpoint_units(wrapped, request.units)
        return ImplTrainer(self.adapter, wrapped, request, self.spec, self.precision)

    def _train(self) -> None:
        ctx, case, out = self.ctx, self.case, self.outcome
        out.stage = "wrap"
        impl = self._build(seed=0)
        self._stage_done(out.stage)

        out.stage = "reference"
        refs = ctx.references.get(
            case, self.steps, ctx.device, ctx.group, self.adapter.unsynced_grads_in_reduce_dtype
        )
        self._stage_done(out.stage)

        for step in range(self.steps):
            out.stage = f"step {step + 1}"
            if step == 1 and self.feature.move_mid_training:
                impl.model.to(_with_index(ctx.device))  # the device it is on, spelled another way
            batches = micro_batches(case, step, ctx.rank, ctx.world_size)
            train_step(
                impl,
                batches,
                self.feature,
                self._checker(step + 1, {k: r.steps[step] for k, r in refs.items()}),
                observe=self._observed(step),
            )

        out.stage = "state_dict"
        state_dict = impl_model_state_dict = impl.state_dict()
        expected = {k: r.state_dict for k, r in refs.items()}
        optim_state_dict = impl.optim_state_dict()
        if optim_state_dict is not None:  # the optimizer state dict, by name, as saved
            state_dict = {**state_dict, **optim_state_dict}
            expected = {k: {**r.state_dict, **r.optim_state_dict} for k, r in refs.items()}
        # A checkpoint keeps dtypes (fp32 params, buffers in their own dtype under buffer_dtype).
        self._compare("state_dict", self.steps + 1, state_dict, expected, check_dtype=True)
        self._stage_done(out.stage)
        checkpoint_id = os.path.join(self.scratch_dir, "dcp")
        if self.feature.sharded_checkpoint:
            dcp.save(
                self.adapter.sharded_state_dict(impl.model),
                checkpoint_id=checkpoint_id,
                process_group=ctx.group,
            )
            # The checkpoint at another layout: one process reads every tensor whole, as its
            # metadata describes it, which is what a load at any other world size relies on.
            whole = {_WHOLE + k: v for k, v in read_checkpoint_whole(checkpoint_id).items()}
            expected_whole = {
                k: {_WHOLE + n: t for n, t in r.state_dict.items()} for k, r in refs.items()
            }
            self._compare("state_dict", self.steps + 1, whole, expected_whole, check_dtype=True)
            self._stage_done(out.stage)
        del impl
        fresh = self._build(seed=FRESH_SEED)
        if self.feature.sharded_checkpoint:
            target = self.adapter.sharded_state_dict(fresh.model)
            dcp.load(target, checkpoint_id=checkpoint_id, process_group=ctx.group)
            self.adapter.load_sharded_state_dict(fresh.model, target)
        else:
            self.adapter.load_full_state_dict(fresh.model, impl_model_state_dict)
        self._stage_done(out.stage)
        batches = micro_batches(case, self.steps, ctx.rank, ctx.world_size)
        train_step(
            fresh,
            batches,
            self.feature,
            self._checker(
                self.steps + 1, {k: r.after_load for k, r in refs.items()}, into="state_dict"
            ),
        )

    def _observed(self, step: int) -> tuple[str, ...]:
        """The stages read at 0-based ``step`` besides the loss (see train_step)."""
        if self.feature.move_mid_training and step < 2:
            # As a loop that never gathers: nothing read from the wrap to the step after the
            # move but the losses, then the params that step left. A read gathers, and native
            # FSDP1's summon_full_params re-points its parameters, hiding what the move broke.
            return () if step == 0 else ("params", "optim_state")
        return ("grads", "params", "optim_state")

    def _checker(self, step: int, expected: dict[str, dict[str, Any]], into: str | None = None):
        """The sink for the implementation's train_step: compare each stage, then sync the ranks."""

        def check(stage: str, actual: Any) -> None:
            where = self.outcome.stage
            self.outcome.stage = f"{where}, comparing {stage}"
            refs = {k: e[stage] for k, e in expected.items()}
            if _observer is not None:
                _observer(self.case, step, stage, actual, refs)
            if stage == "loss":
                self._compare_loss(step, actual, refs, into or stage)
            else:
                self._compare(into or stage, step, actual, refs)
            self._stage_done(self.outcome.stage)
            self.outcome.stage = where  # what runs next belongs to the step again

        return check

    def _compare(
        self,
        stage: str,
        step: int,
        actual: dict,
        expected: dict[str, dict],
        check_dtype: bool = False,
    ) -> None:
        for ref in REFERENCES:
            skip = frozenset()
            if ref == "single" and self.spec.batch_coupled:
                # BatchNorm statistics: the single process updates them once per rank's part.
                skip = frozenset(k for k in actual if "running_" in k or "num_batches_tracked" in k)
            tally = self.outcome.tallies[stage][ref]
            tally.add(step, compare(actual, expected[ref], tally.tolerance, skip, check_dtype))

    def _compare_loss(self, step: int, losses: dict, expected: dict[str, dict], stage: str) -> None:
        tallies = self.outcome.tallies[stage]
        tallies["ddp"].add(step, compare(losses, expected["ddp"], tallies["ddp"].tolerance))
        # The single process saw the global batch: compare with the mean of the ranks' losses.
        local = torch.stack([losses[k].float() for k in sorted(losses)])
        dist.all_reduce(local, group=self.ctx.group)
        mean = dict(zip(sorted(losses), local / self.ctx.world_size))
        tallies["single"].add(step, compare(mean, expected["single"], tallies["single"].tolerance))


_WHOLE = "(checkpoint read whole) "  # the keys of a DCP checkpoint read in one process


def read_checkpoint_whole(checkpoint_id: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read by this process alone (``no_dist``): the
    sizes and chunks its metadata records, which is all a reader at another layout has."""
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    whole = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: it does
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        dcp.load(whole, checkpoint_id=checkpoint_id, no_dist=True)
    return whole


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """What Accelerate and HF Trainer do after wrapping: a non-reentrant checkpoint_wrapper
    around every transformer block."""
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, Block),
    )


def checkpoint_units(model: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    """A non-reentrant checkpoint_wrapper around each unit's outermost module: the unit itself
    (FSDP2 hooks it in place), or the wrapper that holds it and nothing else (FSDP1's).

    The unit's pre-backward (a hook on its output) runs first; the recompute, at the first
    unpack of a saved tensor, then reruns the unit's forward inside its backward (and stops as
    soon as it has what backward needs: torch's checkpoint early stop). A reentrant wrapper would
    run the first forward under no_grad, where no pre-backward is registered at all.
    """
    parents = {
        id(child): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
    }
    for unit in units:
        target = unit
        while id(target) in parents:
            parent, _ = parents[id(target)]
            if parent is model or len(list(parent.children())) != 1:
                break
            target = parent
        parent, name = parents[id(target)]
        wrapped = checkpoint_wrapper(target, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(parent, name, wrapped)


def _with_index(device: torch.device) -> torch.device:
    """``device`` with an explicit index: cpu -> cpu:0 (Trainer's args.device under torchrun)."""
    if device.index is not None:
        return device
    index = torch.cuda.current_device() if device.type == "cuda" else 0
    return torch.device(device.type, index)


def _merge(case: Case, outcomes: list[_Outcome], seconds: float) -> CaseResult:
    result = CaseResult(case, "passed", seconds=seconds)
    result.stages = {
        stage: {ref: merge_tallies([o.tallies[stage][ref] for o in outcomes]) for ref in REFERENCES}
        for stage in STAGES
    }
    errors = [(rank, o) for rank, o in enumerate(outcomes) if o.error is not None]
    if errors:
        if all(o.unsupported for _, o in errors):
            result.status = "unsupported"
            result.reason = errors[0][1].error_summary
            return result

        # The root cause first: a rank freed by the data group's timeout only reports the wait.
        def waited(error: str | None) -> bool:
            text = (error or "").lower()
            return "timed out" in text or "timeout" in text

        errors.sort(key=lambda ro: (waited(ro[1].error), ro[0]))
        rank, first = errors[0]
        result.status = "failed"
        result.reason = f"rank {rank} raised in {first.stage}: {first.error_summary}"
        result.traceback = "\n".join(f"--- rank {r} ({o.stage}) ---\n{o.error}" for r, o in errors)
        return result
    if result.failed_stages():
        result.status = "failed"
        step, stage = result.first_failure() or (None, result.failed_stages()[0])
        result.reason = f"{stage} differs from the references (first at step {step})"
    return result


def run_cases(
    cases: Sequence[Case],
    adapters: Mapping[str, Adapter] | Sequence[Adapter],
    *,
    steps: int = DEFAULT_STEPS,
    device: torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Callable[[int, int, CaseResult], None] | None = None,
    exitfirst: bool = False,
    references: ReferenceCache | None = None,
    started: Callable[[int, Case], None] | None = None,
) -> list[CaseResult]:
    """Run ``cases`` on every rank of the default process group; return the same results everywhere.

    Args:
        cases: what to run; ``case.impl`` names the adapter and ``case.world_size`` must be the
            world size. Every rank must pass the same cases in the same order.
        adapters: adapters by name (or a list; each is keyed by its ``name``).
        steps: optimizer steps per case before the state-dict round trip (default 3).
        device: this rank's device (default: cpu; pass cuda:LOCAL_RANK for NCCL).
        timeout_s: the data group's collective timeout, the backstop of Note [Lockstep].
        progress: called on every rank after each case with (index, total, result).
        started: called on every rank before each case with (index, case), so that what a rank
            dying in the case leaves behind names it (launcher.py, Note [Results that survive a
            rank]).
        exitfirst: stop after the first failed case (every rank sees the same results, so all
            stop there together).
        references: recorded reference runs to reuse (and add to), e.g. across several calls
            judging one implementation after another; by default each call records its own.

    Returns:
        One CaseResult per case, in order (fewer under ``exitfirst``).
    """
    if not dist.is_initialized():
        raise RuntimeError("run_cases needs torch.distributed initialized on every rank")
    by_name = dict(adapters) if isinstance(adapters, Mapping) else {a.name: a for a in adapters}
    ctx = RunContext(device or torch.device("cpu"), timeout_s)
    if references is not None:
        ctx.references = references
    results = []
    for index, case in enumerate(cases):
        if case.impl not in by_name:
            raise KeyError(
                f"case {case.name}: no adapter named {case.impl!r} (have {sorted(by_name)})"
            )
        if case.world_size != ctx.world_size:
            raise ValueError(
                f"case {case.name} is for world size {case.world_size}, running {ctx.world_size}"
            )
        if started is not None:
            started(index, case)
        start = time.perf_counter()
        adapter = by_name[case.impl]
        reason = adapter.unsupported_reason(case)  # no collectives: every rank decides alike
        if reason is None and case.optimizer not in adapter.optimizers():
            reason = f"{adapter.name} is not trained with {case.optimizer} (Adapter.optimizers)"
        variant = FEATURES[case.feature].wrap_variant
        if reason is None and variant is not None and variant not in adapter.wrap_variants():
            reason = f"{adapter.name} has no {variant} (Adapter.wrap_variants)"
        if reason is not None:
            result = CaseResult(case, "unsupported", reason=reason)
        else:
            heartbeat("busy", "started")
            scratch_dir = ctx.scratch_dir(index)
            outcome = _CaseRun(ctx, case, adapter, steps, scratch_dir).run()
            outcomes: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(outcomes, outcome, group=ctx.control_group)
            ctx.remove_scratch(scratch_dir)  # every rank is past the case: the gather above
            result = _merge(case, outcomes, time.perf_counter() - start)
            if result.status == "failed" and result.traceback is not None:
                ctx.rebuild()
            heartbeat("idle", "done")
        results.append(result)
        if progress is not None:
            progress(index, len(cases), result)
        if exitfirst and result.status == "failed":
            break
    ctx.remove_scratch(ctx.scratch_root)
    return results
