"""Which conformance cases exercise each documented feature of fsdp_lite, in which matrix.

    python scripts/feature_cases.py [--markdown]

Each row of ``FEATURES`` is a feature the docs describe (the page that does), and the case
patterns (``--only``'s globs over ``impl/strategy/precision/feature/model/wsN[/optimizer]``) whose
cases exercise it. Counted for fsdp_lite's two fronts (adapters ``fsdp_lite`` and
``fsdp_lite_fsdp2``) in ``--quick``, the default matrix, and the opt-in optimizer axes
(``--optimizers adamw,muon``), the cases each adapter would run (not the ones it reports
unsupported before wrapping). A row without a pattern has no case: its ``why`` says where it is
tested instead, so the gaps stay in view. ``tests/test_feature_cases.py`` keeps the table in
docs/conformance.md equal to this script's output.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conformance.adapters import get_adapter  # noqa: E402
from conformance.matrix import FEATURES as MATRIX_FEATURES  # noqa: E402
from conformance.matrix import build_matrix  # noqa: E402

IMPLS = ("fsdp_lite", "fsdp_lite_fsdp2")


@dataclass(frozen=True)
class Documented:
    feature: str
    doc: str
    patterns: tuple[str, ...] = ()
    why: str = ""  # for a row without patterns: where it is tested instead


FEATURES = (
    # ---- sharding strategies (docs/zero1.md ... docs/hybrid.md)
    Documented("FULL_SHARD (ZeRO-3)", "docs/zero3.md", ("*/FULL_SHARD/*",)),
    Documented("SHARD_GRAD_OP (ZeRO-2)", "docs/zero2.md", ("*/SHARD_GRAD_OP/*",)),
    Documented("SHARD_OPTIM (ZeRO-1)", "docs/zero1.md", ("*/SHARD_OPTIM/*",)),
    Documented("NO_SHARD", "docs/ddp.md", ("*/NO_SHARD/*",)),
    Documented("HYBRID_SHARD (HSDP)", "docs/hybrid.md", ("*/HYBRID_SHARD/*",)),
    # ---- precision
    Documented("MixedPrecision bf16 / fp16", "docs/mixed_precision.md", ("*/bf16/*", "*/fp16/*")),
    Documented("reduce_dtype other than param_dtype", "docs/mixed_precision.md", ("*/bf16r32/*",)),
    Documented("ShardedGradScaler (fp16)", "docs/mixed_precision.md", ("*/fp16/*",)),
    # ---- the training loop
    Documented("no_sync()", "docs/zero3.md", ("*/no_sync/*",)),
    Documented("gradient accumulation with sync", "docs/zero3.md", ("*/accumulate/*",)),
    Documented("clip_grad_norm_ (2-norm, inf-norm)", "docs/zero3.md", ("*/clip_grad_norm*",)),
    Documented(
        "frozen parameters",
        "docs/zero3.md",
        ("*/frozen_params/*", "*/frozen_in_unit/*", "*/frozen/*"),
    ),
    Documented("tied weights", "docs/zero3.md", ("*/tied_weights/*",)),
    Documented("unused parameters", "docs/engine.md", ("*/unused/*",)),
    # ---- construction
    Documented("auto_wrap_policy", "docs/zero3.md", ("fsdp_lite/*",)),
    Documented("policy overrides (CustomPolicy)", "docs/zero3.md", ("*/policy_override/*",)),
    Documented("sync_module_states", "docs/zero3.md", ("*/sync_module_states/*",)),
    Documented("meta-device init (param_init_fn, to_empty)", "docs/zero3.md", ("*/meta_init/*",)),
    Documented("apply() on full parameters", "docs/zero3.md", ("*/apply/*",)),
    Documented("summon_full_params(writeback=True)", "docs/zero3.md", ("*/summon_writeback/*",)),
    Documented(
        "ignored_modules / ignored_params",
        "docs/fsdp2.md",
        why="not in the matrix: ignored parameters are not reduced, so no shared reference; "
        "tests/test_wrap.py, tests/test_shard_dim.py, tests/test_fsdp1_surface.py",
    ),
    Documented("model.to() after wrapping", "docs/zero3.md", ("*/move_mid_training/*",)),
    # ---- prefetch and overlap
    Documented("forward_prefetch", "docs/zero3.md", ("*/forward_prefetch/*",)),
    Documented("backward_prefetch (PRE, POST, None)", "docs/zero3.md", ("*/backward_prefetch_*",)),
    # ---- activation checkpointing
    Documented(
        "activation checkpointing (inside, after and around units)",
        "docs/zero3.md",
        (
            "*/activation_checkpointing/*",
            "*/checkpoint_after_wrap/*",
            "*/checkpoint_outside_unit/*",
        ),
    ),
    # ---- offload
    Documented("CPUOffload / CPUOffloadPolicy", "docs/offload.md", ("*/cpu_offload/*",)),
    Documented("disk offload (offload_dir)", "docs/disk_offload.md", ("*/disk_offload*",)),
    # ---- state dicts and checkpoints
    Documented("full state dict round trip", "docs/state_dicts.md", ("fsdp_lite*",)),
    Documented(
        "sharded state dict through DCP", "docs/checkpoints.md", ("*/sharded_checkpoint/*",)
    ),
    # ---- the FSDP2 front
    Documented("fully_shard per block and root", "docs/fsdp2.md", ("fsdp_lite_fsdp2/*",)),
    Documented("shard_placement_fn Shard(1)", "docs/fsdp2.md", ("*/shard_dim1/*",)),
    Documented(
        "set_requires_gradient_sync + set_reshard_after_backward",
        "docs/fsdp2.md",
        ("*/keep_after_backward/*",),
    ),
    Documented("per-unit reshard_after_forward", "docs/fsdp2.md", ("*/mixed_reshard/*",)),
    Documented("reshard_after_forward=k (hpZ)", "docs/fsdp2.md", ("*/hpz/*",)),
    Documented(
        "set_modules_to_forward_prefetch / _backward_prefetch",
        "docs/fsdp2.md",
        ("fsdp_lite_fsdp2/*/forward_prefetch/*",),
    ),
    # ---- optimizers
    Documented("multi-tensor (foreach) optimizers", "docs/zero1.md", ("*/foreach_optimizer/*",)),
    Documented("AdamW", "docs/performance.md", ("*/adamw",)),
    Documented("Muon", "docs/muon.md", ("*/muon",)),
    # ---- composition
    Documented(
        "tensor parallel (fully_shard over mesh['dp'])",
        "docs/composition.md",
        why="not in the matrix: tests/test_tensor_parallel.py against torch FSDP2 + TP",
    ),
    Documented(
        "pipeline parallel",
        "docs/composition.md",
        why="not in the matrix: tests/test_pipelining.py",
    ),
    Documented(
        "torch.compile",
        "docs/composition.md",
        why="not in the matrix: tests/test_compile.py",
    ),
)


def counts() -> dict[str, dict[str, int]]:
    """Feature -> {matrix: cases} for fsdp_lite's two fronts."""
    adapters = {name: get_adapter(name) for name in IMPLS}
    known = {name: a.strategies() for name, a in adapters.items()}
    extra = {name: a.features() for name, a in adapters.items()}
    matrices = {  # label: (world size, build_matrix's options)
        "quick": (2, dict(quick=True)),
        "default": (2, dict()),
        "ranks4": (4, dict()),
        "optimizers": (2, dict(optimizers=("adamw", "muon"))),
    }
    runnable = {}
    for label, (world_size, kwargs) in matrices.items():
        cases, _ = build_matrix(list(IMPLS), known, world_size, known_features=extra, **kwargs)
        runnable[label] = [c.name for c in cases if _supported(adapters[c.impl], c)]
    table = {}
    for row in FEATURES:
        table[row.feature] = {
            label: sum(1 for n in names if any(fnmatch.fnmatchcase(n, p) for p in row.patterns))
            for label, names in runnable.items()
        }
    return table


def _supported(adapter, case) -> bool:
    """What the runner decides before wrapping (runner.py): the adapter's reason, its optimizers
    and its construction paths."""
    if adapter.unsupported_reason(case) is not None:
        return False
    if case.optimizer not in adapter.optimizers():
        return False
    variant = MATRIX_FEATURES[case.feature].wrap_variant
    return variant is None or variant in adapter.wrap_variants()


def markdown(table: dict[str, dict[str, int]]) -> str:
    lines = [
        "| documented feature | page | --quick | default | default at 4 ranks | "
        "--optimizers adamw,muon |",
        "|---|---|---|---|---|---|",
    ]
    for row in FEATURES:
        n = table[row.feature]
        if row.patterns:
            cells = f"{n['quick']} | {n['default']} | {n['ranks4']} | {n['optimizers']}"
        else:
            cells = f"none | none | none | none: {row.why}"
        lines.append(f"| {row.feature} | {row.doc} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    sys.stdout.write(markdown(counts()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
