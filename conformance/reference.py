"""The two references a case is compared with, and the data each one is fed.

DDP trains the same model on each rank's own batch; a single process trains it on the global batch
(every rank's batch concatenated; BatchNorm models see each rank's part separately). Both run the
same ``train_step`` as the implementation and record every stage. A reference run depends only on
the model, the training loop, the precision and the step count, so ``ReferenceCache`` runs it once
and every implementation and strategy with that key compares against the recording.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.matrix import FEATURES, PRECISIONS, Case, Feature
from conformance.models import Block, TinyLM
from conformance.training import Batch, ReplicaTrainer, train_step
from conformance.zoo import ModelSpec, local_batch, spec

__all__ = ["REFERENCES", "ReferenceCache", "ReferenceRun", "micro_batches", "prepare_model"]

REFERENCES = ("ddp", "single")
FRESH_SEED = 1  # the state-dict stage loads into a model built from other weights


def prepare_model(
    model_spec: ModelSpec, feature: Feature, seed: int, device: torch.device, for_impl: bool
) -> nn.Module:
    """Build the case's model on ``device`` with the feature's changes to the module itself."""
    model = model_spec.build(seed)
    if feature.freeze is not None:
        if not isinstance(model, TinyLM):
            raise ValueError(f"feature {feature.name} needs a TinyLM model, not {model_spec.name}")
        if feature.freeze == "block":
            model.blocks[0].requires_grad_(False)  # a whole unit frozen
            model.pos.requires_grad_(False)  # one frozen parameter in the root unit
        else:  # "in_unit": autograd reads the LayerNorm weight after the block's last gradient
            model.tok.weight.requires_grad_(False)
            model.blocks[0].ln1.requires_grad_(False)
    if feature.activation_checkpointing and for_impl:
        # Only the implementation recomputes; the references keep activations. Same math.
        for m in model.modules():
            if isinstance(m, Block):
                m.checkpoint = True
    return model.to(device)


def micro_batches(case: Case, step: int, rank: int | None, world_size: int) -> list[Batch]:
    """The inputs of 0-based ``step``: rank ``rank``'s, or the global batch when ``rank`` is None."""
    model_spec, feature = spec(case.model), FEATURES[case.feature]
    out = []
    for micro in range(feature.micro_batches):
        if rank is not None:
            out.append([local_batch(case.model, step, micro, rank)])
            continue
        parts = [local_batch(case.model, step, micro, r) for r in range(world_size)]
        if model_spec.batch_coupled:
            out.append(parts)  # one forward per rank's part, as the ranks do
        else:
            out.append([(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))])
    return out


@dataclass
class ReferenceRun:
    """Everything one reference recorded in one case's training: per step, then the state dict."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # stage -> tensors, per step
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    optim_state_dict: dict[str, torch.Tensor] = field(default_factory=dict)  # "(optimizer) n:k"
    after_load: dict[str, Any] = field(default_factory=dict)  # the step after reloading


def _record_into(record: dict[str, Any]):
    def sink(stage: str, value: Any) -> None:
        record[stage] = value

    return sink


def run_reference(
    kind: str,
    case: Case,
    steps: int,
    device: torch.device,
    group: dist.ProcessGroup,
    unsynced_in_reduce_dtype: bool = False,
) -> ReferenceRun:
    """Train the ``kind`` reference ("ddp" or "single") as ``case`` says and record every stage."""
    model_spec, feature = spec(case.model), FEATURES[case.feature]
    precision = PRECISIONS[case.precision]
    rank = dist.get_rank(group) if kind == "ddp" else None
    ddp_group = group if kind == "ddp" else None
    model = prepare_model(model_spec, feature, 0, device, for_impl=False)
    trainer = ReplicaTrainer(
        model, model_spec, precision, device, ddp_group, unsynced_in_reduce_dtype, case.optimizer
    )
    run = ReferenceRun()
    for step in range(steps):
        record: dict[str, Any] = {}
        train_step(
            trainer, micro_batches(case, step, rank, case.world_size), feature, _record_into(record)
        )
        run.steps.append(record)
    run.state_dict = trainer.state_dict()
    run.optim_state_dict = trainer.optim_state_dict()
    fresh = prepare_model(model_spec, feature, FRESH_SEED, device, for_impl=False)
    fresh.load_state_dict(run.state_dict)
    trainer = ReplicaTrainer(
        fresh, model_spec, precision, device, ddp_group, unsynced_in_reduce_dtype, case.optimizer
    )
    train_step(
        trainer,
        micro_batches(case, steps, rank, case.world_size),
        feature,
        _record_into(run.after_load),
    )
    return run


class ReferenceCache:
    """Reference runs by what determines them; lives as long as one run of the suite."""

    def __init__(self) -> None:
        self._runs: dict[tuple, dict[str, ReferenceRun]] = {}

    @staticmethod
    def key(case: Case, steps: int, unsynced_in_reduce_dtype: bool = False) -> tuple:
        feature, precision = FEATURES[case.feature], PRECISIONS[case.precision]
        # Only backwards without sync under a reduce dtype of its own tell the two apart.
        unsynced = feature.micro_batches > 1 and not feature.sync_micro_batches
        in_reduce_dtype = (
            unsynced and precision.reduce_dtype is not None and unsynced_in_reduce_dtype
        )
        return (
            case.model,
            feature.reference_key,
            case.precision,
            case.world_size,
            steps,
            in_reduce_dtype,
            case.optimizer,
        )

    def get(
        self,
        case: Case,
        steps: int,
        device: torch.device,
        group: dist.ProcessGroup,
        unsynced_in_reduce_dtype: bool = False,
    ) -> dict[str, ReferenceRun]:
        """Both references for ``case``; runs them (collectively, on every rank) on first use.

        ``unsynced_in_reduce_dtype``: the implementation sums backwards without gradient sync in
        the reduce dtype (``Adapter.unsynced_grads_in_reduce_dtype``); the references do too.
        """
        key = self.key(case, steps, unsynced_in_reduce_dtype)
        in_reduce_dtype = key[-2]
        if key not in self._runs:
            self._runs[key] = {
                kind: run_reference(kind, case, steps, device, group, in_reduce_dtype)
                for kind in REFERENCES
            }
        return self._runs[key]
