"""Per-step loss and gradient-norm curves of a case, for the HTML report (conformance/html.py).

The comparisons keep one number per stage and reference (the worst over the steps); a person
looking at a failing case also wants to see *how* it drifts: the implementation's loss and total
gradient norm at every step next to DDP's and the single process's. ``CurveRecorder`` is the
runner's observer (runner.set_observer) on rank 0: it reads the values each stage hands to the
comparison, so it costs a sum of squares of the full gradients per step and no collective.

What is recorded (per case, lists indexed by step - 1; the last entry is the step after the
state-dict round trip; None where a stage was not read at that step, e.g. ``move_mid_training``):

  loss       rank 0's loss (mean over its micro-batches) for ``impl`` and ``ddp`` (DDP on the same
             batches); ``single``: the single process's loss on the global batch, so it differs
             from rank 0's by the batch, not by a bug
  grad_norm  the total L2 norm of the full gradients (after clipping: what the optimizer sees),
             for ``impl``, ``ddp`` and ``single``, all over the same global gradient
"""

from __future__ import annotations

import math
from typing import Any

import torch

from conformance.report import json_safe

__all__ = ["CurveRecorder", "SERIES", "total_norm"]

SERIES = ("impl", "ddp", "single")
_GRAD_NORM_KEY_PREFIX = "("  # training.GRAD_NORM_KEY and other non-tensor-name entries


def total_norm(tensors: dict[str, Any]) -> float | None:
    """The L2 norm of every tensor of ``tensors`` together (None entries and the clip norm's
    entry left out), in float64; None when there is none."""
    squares = [
        t.detach().double().pow(2).sum()
        for name, t in tensors.items()
        if t is not None and not name.startswith(_GRAD_NORM_KEY_PREFIX) and t.numel()
    ]
    if not squares:
        return None
    return math.sqrt(float(torch.stack(squares).sum()))


def _mean_loss(losses: dict[str, Any]) -> float | None:
    values = [float(v.detach().double()) for v in losses.values() if v is not None]
    return sum(values) / len(values) if values else None


class CurveRecorder:
    """The runner's observer: each case's loss and gradient-norm curves, taken by ``pop``."""

    def __init__(self) -> None:
        self._curves: dict[str, dict[str, dict[str, list[float | None]]]] = {}

    def __call__(self, case, step: int, stage: str, actual: Any, expected: dict[str, Any]) -> None:
        if stage == "loss":
            values = {"impl": _mean_loss(actual), **{k: _mean_loss(v) for k, v in expected.items()}}
        elif stage == "grads":
            values = {"impl": total_norm(actual), **{k: total_norm(v) for k, v in expected.items()}}
        else:
            return
        metric = "loss" if stage == "loss" else "grad_norm"
        per = self._curves.setdefault(case.name, {}).setdefault(metric, {})
        for series in SERIES:
            points = per.setdefault(series, [])
            points += [None] * (step - len(points))
            value = values.get(series)
            points[step - 1] = json_safe(value)  # a non-finite one as report.NON_FINITE writes it

    def pop(self, name: str) -> dict[str, dict[str, list[float | None]]] | None:
        """The curves of case ``name`` (None if nothing was recorded), forgotten here."""
        return self._curves.pop(name, None)
