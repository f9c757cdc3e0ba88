"""Comparing an implementation's tensors with a reference's, and summing that up per stage.

``compare`` measures one stage at one step: named tensors against the reference's (max abs error,
max relative error, bitwise equality, and whether every element is within the tolerance).
``StageTally`` folds the steps of one case together, and ``merge_tallies`` folds the ranks
together, so a case ends with one number per stage and reference. Pure tensor arithmetic: no
collectives here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from conformance.tolerances import Tolerance

__all__ = ["Comparison", "StageTally", "compare", "merge_tallies"]

_MAX_PROBLEMS = 5  # messages kept per stage; the first ones say enough


@dataclass
class Comparison:
    """One stage at one step against one reference, over all of the stage's named tensors.

    Per tensor, with a the implementation's and b the reference's values:
      max_abs = max |a - b|        max_rel = max |a - b| / max |b|   (relative to the tensor's scale)
    and the tensor passes when max |a - b| <= atol + rtol * max |b|. Relative to the tensor's
    largest element, not elementwise: a gradient is a sum, and its small elements carry the
    rounding error of its large summands. NaN matches NaN; NaN on one side is an infinite error.
    passed also needs the names, shapes and missing gradients to agree.
    """

    max_abs: float = 0.0
    max_rel: float = 0.0
    bitwise: bool = True
    passed: bool = True
    worst: str = ""  # the tensor with the largest excess over its tolerance (or max abs error)
    problems: list[str] = field(default_factory=list)


def compare(
    actual: dict[str, torch.Tensor | None],
    expected: dict[str, torch.Tensor | None],
    tol: Tolerance,
    skip: frozenset[str] = frozenset(),
    check_dtype: bool = False,
) -> Comparison:
    """Compare named tensors (None = no gradient) with the reference's; ``skip`` names are left
    out; with ``check_dtype`` a tensor of another dtype fails whatever its values."""
    result = Comparison()
    worst_excess = -math.inf

    def problem(message: str) -> None:
        result.passed = result.bitwise = False
        if len(result.problems) < _MAX_PROBLEMS:
            result.problems.append(message)

    for name in sorted(set(actual) | set(expected)):
        if name in skip:
            continue
        if name not in actual:
            problem(f"{name}: missing (the reference has it)")
            continue
        if name not in expected:
            problem(f"{name}: not in the reference")
            continue
        a, b = actual[name], expected[name]
        if a is None or b is None:
            if (a is None) != (b is None):
                problem(
                    f"{name}: {'no gradient' if a is None else 'a gradient'}, the reference "
                    f"has {'one' if a is None else 'none'}"
                )
            continue
        if a.shape != b.shape:
            problem(f"{name}: shape {tuple(a.shape)}, the reference {tuple(b.shape)}")
            continue
        if check_dtype and a.dtype != b.dtype:
            problem(f"{name}: dtype {a.dtype}, the reference {b.dtype}")
        if a.numel() == 0:
            continue
        # float64 on the tensors' device: exact for every dtype compared here.
        a64, b64 = a.detach().double(), b.detach().to(a.device).double()
        same = (a64.isnan() & b64.isnan()) | (a64 == b64)  # inf == inf too (inf - inf is NaN)
        diff = (a64 - b64).abs().masked_fill(same, 0.0)
        # A NaN or inf on one side only is an infinite error (nan_to_num would make inf the
        # largest finite float by default).
        diff = diff.nan_to_num(nan=math.inf, posinf=math.inf)
        max_abs = diff.max().item()
        scale = b64.abs().nan_to_num(nan=0.0).max().item()
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
        excess = max_abs - (tol.atol + tol.rtol * scale)
        result.max_abs = max(result.max_abs, max_abs)
        result.max_rel = max(result.max_rel, max_rel)
        result.bitwise &= max_abs == 0.0 and a.dtype == b.dtype
        if excess > worst_excess:
            worst_excess, result.worst = excess, name
        if excess > 0:
            result.passed = False
            if len(result.problems) < _MAX_PROBLEMS:
                result.problems.append(
                    f"{name}: max abs error {max_abs:.3g} > atol {tol.atol:g} + rtol {tol.rtol:g} * "
                    f"max |ref| {scale:.3g}"
                )
    return result


@dataclass
class StageTally:
    """One stage against one reference, over all steps of a case (and, merged, over all ranks)."""

    tolerance: Tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    bitwise: bool = True
    passed: bool = True
    first_failed_step: int | None = None  # 1-based; the state_dict stage counts as steps + 1
    worst: str = ""  # "step N: tensor name" of the largest max_abs
    problems: list[str] = field(default_factory=list)
    compared: bool = False  # False: the case ended before this stage ran

    def add(self, step: int, c: Comparison) -> None:
        self.compared = True
        if c.max_abs > self.max_abs or not self.worst:
            self.worst = f"step {step}: {c.worst}" if c.worst else self.worst
        self.max_abs = max(self.max_abs, c.max_abs)
        self.max_rel = max(self.max_rel, c.max_rel)
        self.bitwise &= c.bitwise
        if not c.passed:
            self.passed = False
            if self.first_failed_step is None:
                self.first_failed_step = step
            for p in c.problems:
                if len(self.problems) < _MAX_PROBLEMS:
                    self.problems.append(f"step {step}: {p}")


def merge_tallies(per_rank: list[StageTally]) -> StageTally:
    """One tally from every rank's: worst errors, AND of the flags, earliest failure."""
    merged = StageTally(per_rank[0].tolerance)
    for t in per_rank:
        if not t.compared:
            continue
        merged.compared = True
        if t.max_abs > merged.max_abs or not merged.worst:
            merged.worst = t.worst
        merged.max_abs = max(merged.max_abs, t.max_abs)
        merged.max_rel = max(merged.max_rel, t.max_rel)
        merged.bitwise &= t.bitwise
        merged.passed &= t.passed
        if t.first_failed_step is not None:
            merged.first_failed_step = min(
                merged.first_failed_step or t.first_failed_step, t.first_failed_step
            )
        for p in t.problems:
            if p not in merged.problems and len(merged.problems) < _MAX_PROBLEMS:
                merged.problems.append(p)
    return merged
