"""The one tolerance table: how far an implementation may be from each reference, and why.

A case's tolerance for (reference, stage) is the largest of the rows that apply to it; a row
applies by precision, reference and a condition on the case (always, world size above 2, or a
feature). Exact (0) wherever the arithmetic is the same; every non-zero row names where the
difference comes from and what was measured. docs/conformance.md shows this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["STAGES", "TABLE", "Rule", "Tolerance", "tolerance"]

STAGES = ("loss", "grads", "params", "optim_state", "state_dict")


@dataclass(frozen=True)
class Tolerance:
    """A tensor passes when max |actual - reference| <= atol + rtol * max |reference|
    (relative to the tensor's scale; see compare.Comparison)."""

    atol: float = 0.0
    rtol: float = 0.0

    def __or__(self, other: Tolerance) -> Tolerance:
        return Tolerance(max(self.atol, other.atol), max(self.rtol, other.rtol))


EXACT = Tolerance()

# When a row applies, by the case's fields.
WHEN: dict[str, Callable] = {
    "always": lambda case: True,
    "world_size > 2": lambda case: case.world_size > 2,
    "clip_grad_norm": lambda case: case.feature.startswith("clip_grad_norm"),
    "accumulate": lambda case: case.feature == "accumulate",
    # The optimizer axis (--optimizers); SGD, every matrix's, has no rows of its own.
    "adamw": lambda case: getattr(case, "optimizer", "sgd") == "adamw",
    "muon": lambda case: getattr(case, "optimizer", "sgd") == "muon",
    "adamw, clip_grad_norm": lambda case: (
        getattr(case, "optimizer", "sgd") == "adamw" and case.feature.startswith("clip_grad_norm")
    ),
    "muon, clip_grad_norm": lambda case: (
        getattr(case, "optimizer", "sgd") == "muon" and case.feature.startswith("clip_grad_norm")
    ),
}


@dataclass(frozen=True)
class Rule:
    """One row: for ``precision`` against ``reference`` when ``when`` holds, these tolerances."""

    precision: str
    reference: str  # "ddp" | "single"
    when: str  # a key of WHEN
    stages: dict[str, Tolerance]  # stage -> tolerance; a missing stage is exact
    why: str


def _all(tol: Tolerance) -> dict[str, Tolerance]:
    return {stage: tol for stage in STAGES}


def _rel(rtol: float, **per_stage: float) -> dict[str, Tolerance]:
    """rtol for every stage (relative to the tensor's scale), with per-stage exceptions."""
    return {stage: Tolerance(rtol=per_stage.get(stage, rtol)) for stage in STAGES}


# Measured on CPU/gloo, torch 2.13, fsdp_lite + torch FSDP1 + FSDP2 over the full default matrix
# at 2, 3 and 4 ranks; "measured" quotes the largest max_rel seen (relative to the tensor's scale),
# and each bound leaves a margin of about 10x (3x for bf16, whose errors are already large).
TABLE: list[Rule] = [
    # ---- against DDP: exact where the arithmetic is the same ----
    Rule(
        "fp32",
        "ddp",
        "always",
        _all(EXACT),
        "2 ranks: (x + y) / 2 is one rounding whether DDP divides first or FSDP splits the "
        "division around a reduce-scatter, so every stage is bitwise equal",
    ),
    Rule(
        "bf16",
        "ddp",
        "always",
        _all(EXACT),
        "the DDP reference emulates FSDP's mixed precision (bf16 compute copy, bf16 gradient "
        "all-reduce, fp32 master step): at 2 ranks the same roundings in the same places",
    ),
    Rule("fp16", "ddp", "always", _all(EXACT), "as bf16, with the same loss scale on both sides"),
    Rule(
        "fp32",
        "ddp",
        "world_size > 2",
        _rel(1e-5, loss=2e-6),
        "gloo adds 3+ contributions in another order in all-reduce (DDP) and reduce-scatter "
        "(FSDP), and FSDP1 / fsdp_lite divide by 2 then N/2 where DDP divides by N: last-bit "
        "differences that momentum carries into params (measured 9.9e-7, loss 1.2e-7)",
    ),
    Rule(
        "bf16",
        "ddp",
        "world_size > 2",
        _rel(0.2, loss=1e-2),
        "as fp32, but the differently placed divisions and sums round to bf16's 8-bit mantissa "
        "(measured 2.4e-2, loss 1.1e-3)",
    ),
    Rule(
        "fp16",
        "ddp",
        "world_size > 2",
        _rel(3e-2, loss=1e-3),
        "as bf16 with fp16's 11-bit mantissa (measured 2.8e-3, loss 1.0e-4)",
    ),
    Rule(
        "fp32",
        "ddp",
        "clip_grad_norm",
        _rel(5e-6),
        "the total norm is summed per shard and then across ranks, DDP's over whole gradients: "
        "a few ulps in the norm and so in the clip coefficient (measured 5.3e-7)",
    ),
    Rule(
        "bf16", "ddp", "clip_grad_norm", _rel(5e-6), "as fp32; the norm is fp32 (measured 2.4e-7)"
    ),
    Rule(
        "fp16", "ddp", "clip_grad_norm", _rel(5e-6), "as fp32; the norm is fp32 (measured 2.8e-7)"
    ),
    Rule(
        "fp32",
        "ddp",
        "accumulate",
        _rel(5e-6),
        "two synced backwards: the references add the second averaged gradient to the first, as "
        "FSDP adds reduced shards; an unsharded (NO_SHARD) gradient may instead take the second "
        "backward's local gradient on top of the first average and average again, as DDP does: "
        "the same sum, rounded otherwise (fsdp_lite NO_SHARD fp32: measured 6.4e-7, loss 1.1e-7)",
    ),
    Rule(
        "bf16r32",
        "ddp",
        "always",
        _all(EXACT),
        "as bf16, with gradients reduced in fp32 on both sides: at 2 ranks (a + b) / 2 in fp32 is "
        "the same rounding whichever side divides",
    ),
    Rule(
        "bf16r32",
        "ddp",
        "world_size > 2",
        _rel(0.2, loss=1e-2),
        "as bf16: the bf16 forward and backward round the same differences",
    ),
    Rule("bf16r32", "ddp", "clip_grad_norm", _rel(5e-6), "as bf16"),
    # ---- the optimizer axis against DDP: only the clipped norm's ulps, amplified ----
    Rule(
        "fp32",
        "ddp",
        "adamw, clip_grad_norm",
        {"params": Tolerance(rtol=3e-4), "state_dict": Tolerance(rtol=2e-3)},
        "the clip coefficient's ulps (the clip_grad_norm row) reach AdamW, whose first steps "
        "are about lr * sign(g): a few ulps in a near-zero gradient entry move its step by up to "
        "2 lr (measured 3.5e-5 params, 1.6e-4 state_dict, fsdp_lite and torch FSDP2 alike); "
        "without clipping AdamW is bitwise DDP at 2 ranks",
    ),
    Rule(
        "fp32",
        "ddp",
        "muon, clip_grad_norm",
        {"params": Tolerance(rtol=3e-4), "state_dict": Tolerance(rtol=5e-3)},
        "as AdamW's row: the parameters outside Muon (biases, LayerNorms, embeddings) step with "
        "AdamW, whose first steps amplify the clip coefficient's ulps (measured 5.1e-5 relative "
        "on blocks.1.qkv.bias at step 3 on an Intel Xeon machine, 2026-12-06; on the machine of "
        "2026-12-03 it stayed under 5e-6), and the fresh AdamW's first step after the reload "
        "(1.7e-3 on a LayerNorm bias, fsdp_lite); Muon's own matrices stay within the "
        "clip_grad_norm row (7.3e-8). torch FSDP2 + torch.optim.Muon: 4.7e-3 params",
    ),
    # ---- against one process on the global batch: never the same arithmetic ----
    Rule(
        "fp32",
        "single",
        "always",
        _rel(3e-5, loss=3e-6),
        "one pass over the global batch vs per-rank passes averaged: other summation orders in "
        "every reduction over the batch (measured 3.1e-6 in BatchNorm, loss 2.3e-7)",
    ),
    Rule(
        "bf16",
        "single",
        "always",
        _rel(0.2, loss=1e-2),
        "per-rank bf16 matmuls and a bf16 gradient sum vs one bf16 pass: different sums rounded "
        "to 8 bits (measured 6.7e-2, loss 9.1e-4). Catches a 2x scale or a missing gradient; "
        "the 2-rank DDP comparison is the sharp one",
    ),
    Rule(
        "bf16r32",
        "single",
        "always",
        _rel(0.2, loss=1e-2),
        "as bf16: per-rank bf16 passes against one bf16 pass",
    ),
    Rule(
        "fp16",
        "single",
        "always",
        _rel(5e-2, loss=1e-3),
        "as bf16 with fp16's 11-bit mantissa (measured 7.3e-3, loss 8.9e-5)",
    ),
    # The optimizer axis: AdamW and Muon normalize their updates, so the single process's
    # last-bit differences in the gradients (the rows above) grow into the parameters. Only
    # the stages named widen; the DDP comparison (exact at 2 ranks) is the sharp one.
    Rule(
        "fp32",
        "single",
        "adamw",
        {"params": Tolerance(rtol=0.1), "state_dict": Tolerance(rtol=0.1)},
        "AdamW's first steps are about lr * sign(g): an ulp in a near-zero gradient entry can "
        "move its step by up to 2 lr (measured 1.0e-2 params, 1.6e-2 state_dict)",
    ),
    Rule(
        "bf16",
        "single",
        "adamw",
        {"params": Tolerance(rtol=0.5), "state_dict": Tolerance(rtol=0.8)},
        "as fp32 on bf16's larger differences (measured 0.14 params, 0.25 state_dict): catches "
        "a step on the wrong parameters, not a rounding",
    ),
    Rule(
        "fp32",
        "single",
        "muon",
        {
            "loss": Tolerance(rtol=1e-5),
            "grads": Tolerance(rtol=5e-3),
            "optim_state": Tolerance(rtol=5e-3),
            "params": Tolerance(rtol=0.1),
            "state_dict": Tolerance(rtol=1.0),
        },
        "Newton-Schulz runs in bf16: an ulp in the gradient flips bf16 roundings of the whole "
        "update, and later steps' gradients follow (measured 1.5e-6 loss, 1.2e-3 grads, 1.1e-3 optim_state, "
        "8.1e-3 params); the fresh AdamW step after the reload moves a near-zero-gradient entry "
        "of a sign flipped by that by 2 lr: 0.020 on a LayerNorm bias whose largest entry is "
        "0.038 (state_dict 0.53). The single process catches only gross errors in that stage",
    ),
    Rule(
        "bf16",
        "single",
        "muon",
        {"params": Tolerance(rtol=0.5), "state_dict": Tolerance(rtol=1.0)},
        "as fp32 on bf16 compute (measured 0.15 params, 0.53 state_dict); loss, grads and "
        "optimizer state keep the bf16 row",
    ),
]


def tolerance(case, reference: str, stage: str) -> Tolerance:
    """The tolerance for ``case`` against ``reference`` at ``stage``: the widest applicable row."""
    tol = EXACT
    for rule in TABLE:
        if (
            rule.precision == case.precision
            and rule.reference == reference
            and WHEN[rule.when](case)
        ):
            tol = tol | rule.stages.get(stage, EXACT)
    return tol
