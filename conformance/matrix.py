"""The cases the suite runs: what a case is, what each feature does, and the default matrices.

A ``Case`` names one run: implementation, sharding strategy, precision, feature and model at one
world size. ``FEATURES`` says what each feature changes in the training loop or in the wrapping;
``build_matrix`` crosses them as documented in docs/conformance.md (features with one transformer,
models with the plain loop, mixed precision with a few features) and ``select`` applies ``--only``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from conformance.zoo import SPECS

__all__ = [
    "CORE_STRATEGIES",
    "EXTRA_FEATURES",
    "EXTRA_STRATEGIES",
    "FEATURES",
    "OPTIMIZERS",
    "PRECISIONS",
    "RANKS_FEATURES",
    "Case",
    "Feature",
    "Precision",
    "build_matrix",
    "parse_shard",
    "select",
    "shard",
]

CORE_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
# Run only for implementations whose ShardingStrategy has the member (see Adapter.strategies).
EXTRA_STRATEGIES = ("HYBRID_SHARD", "SHARD_OPTIM")
# The optimizer axis (``--optimizers``): "sgd" is every matrix's; the others run OPTIMIZER_MATRIX.
# training.make_optimizer says what each builds.
OPTIMIZERS = ("sgd", "adamw", "muon")


@dataclass(frozen=True, order=True)
class Case:
    """One run of the suite: an implementation trained a few steps against the references."""

    impl: str
    strategy: str
    precision: str
    feature: str
    model: str
    world_size: int
    optimizer: str = "sgd"  # one of OPTIMIZERS

    @property
    def name(self) -> str:
        """``impl/strategy/precision/feature/model/wsN``, then ``/optimizer`` unless it is sgd
        (so the SGD cases keep the names baselines and reports know them by)."""
        parts = [
            self.impl,
            self.strategy,
            self.precision,
            self.feature,
            self.model,
            f"ws{self.world_size}",
        ]
        if self.optimizer != "sgd":
            parts.append(self.optimizer)
        return "/".join(parts)


@dataclass(frozen=True)
class Precision:
    """Mixed precision as FSDP1's MixedPrecision(param_dtype=dtype, reduce_dtype=reduce_dtype or
    dtype, buffer_dtype=dtype)."""

    name: str
    dtype: torch.dtype | None  # None: everything in fp32, no mixed precision
    grad_scaler: bool = False  # fp16 needs loss scaling (a ShardedGradScaler)
    reduce_dtype: torch.dtype | None = None  # None: gradients are reduced in ``dtype``

    @property
    def grad_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (None: fp32, no mixed precision)."""
        return self.reduce_dtype or self.dtype


PRECISIONS = {
    p.name: p
    for p in [
        Precision("fp32", None),
        Precision("bf16", torch.bfloat16),
        Precision("fp16", torch.float16, grad_scaler=True),
        # bf16 compute, fp32 gradient reduction: a policy whose reduce dtype differs from the
        # param dtype, which the three above never exercise (each reduces in its param dtype).
        Precision("bf16r32", torch.bfloat16, reduce_dtype=torch.float32),
    ]
}


@dataclass(frozen=True)
class Feature:
    """What one feature changes; the fields are read by the runner and passed to adapters."""

    name: str
    doc: str
    # Training loop (the references do the same):
    micro_batches: int = 1  # > 1: all but the last backward run under no_sync()
    sync_micro_batches: bool = False  # every micro-batch's backward syncs (no no_sync())
    clip_grad_norm: float | None = None  # clip_grad_norm_(max_norm) between backward and step
    clip_norm_type: float = 2.0  # clip_grad_norm_'s norm_type
    # Freeze before wrapping: "block" the first block and the position embedding (a whole unit
    # frozen), "in_unit" the token embedding and the first block's LayerNorm (frozen beside
    # trainable params in both units).
    freeze: str | None = None
    # Wrapping only (the references train exactly as in "plain"):
    activation_checkpointing: bool = False
    checkpoint_after_wrap: bool = False  # torch's checkpoint_wrapper per Block, after wrapping
    # torch's checkpoint_wrapper around each unit's outermost module after wrapping, so that the
    # recompute in backward runs the implementation's own forward hooks again.
    checkpoint_outside_unit: bool = False
    # The state-dict round trip goes through torch.distributed.checkpoint and the sharded state
    # dict (each rank saves and loads its shards) instead of a full state dict.
    sharded_checkpoint: bool = False
    move_mid_training: bool = False  # model.to(this rank's device, with its index) after step 1
    cpu_offload: bool = False  # parameters in CPU memory between uses
    disk_offload: bool = False  # parameters in files under the case's scratch directory
    optimizer_offload: str | None = None  # the optimizer's state and step: "cpu" | "disk"
    backward_prefetch: str = "default"  # "default" | "BACKWARD_PRE" | "BACKWARD_POST" | "NONE"
    forward_prefetch: bool = False
    # The implementation's optimizer runs torch's multi-tensor (foreach) kernels, as it does by
    # default on accelerators; the references keep the per-tensor loop (the same bits).
    foreach_optimizer: bool = False
    # A construction path or setter of one API family, wrapping only (adapters/base.py WRAP_VARIANTS);
    # an adapter whose API lacks it reports the case unsupported.
    wrap_variant: str | None = None

    @property
    def reference_key(self) -> tuple:
        """Features with the same key train the references identically (their runs are shared)."""
        return (
            self.micro_batches,
            self.sync_micro_batches,
            self.clip_grad_norm,
            self.clip_norm_type,
            self.freeze,
        )


FEATURES = {
    f.name: f
    for f in [
        Feature("plain", "forward, backward, optimizer step"),
        Feature("no_sync", "2 micro-batches, the first under no_sync()", micro_batches=2),
        # Small enough that every step clips: the clip coefficient, and so the norm, matters.
        Feature("clip_grad_norm", "clip_grad_norm_(0.05) before the step", clip_grad_norm=0.05),
        # The inf-norm is a max, combined across ranks by MAX, not SUM; max_norm 1 is above every
        # inf-norm of these models' gradients, so the clip coefficient must stay exactly 1.
        Feature(
            "clip_grad_norm_inf",
            "clip_grad_norm_(1.0, norm_type=inf) before the step (never clips: coefficient 1)",
            clip_grad_norm=1.0,
            clip_norm_type=float("inf"),
        ),
        Feature(
            "accumulate",
            "2 micro-batches, both synced (gradient accumulation without no_sync())",
            micro_batches=2,
            sync_micro_batches=True,
        ),
        Feature(
            "activation_checkpointing",
            "transformer blocks recompute activations in backward",
            activation_checkpointing=True,
        ),
        Feature("cpu_offload", "CPUOffload(offload_params=True)", cpu_offload=True),
        Feature(
            "backward_prefetch_pre",
            "BackwardPrefetch.BACKWARD_PRE",
            backward_prefetch="BACKWARD_PRE",
        ),
        Feature(
            "backward_prefetch_post",
            "BackwardPrefetch.BACKWARD_POST",
            backward_prefetch="BACKWARD_POST",
        ),
        Feature("backward_prefetch_none", "backward_prefetch=None", backward_prefetch="NONE"),
        Feature("forward_prefetch", "forward_prefetch=True", forward_prefetch=True),
        Feature(
            "frozen_params",
            "first block and pos embedding frozen (requires_grad=False)",
            freeze="block",
        ),
        Feature(
            "frozen_in_unit",
            "token embedding and first block's LayerNorm frozen, beside trainable params",
            freeze="in_unit",
        ),
        Feature(
            "checkpoint_after_wrap",
            "apply_activation_checkpointing(NO_REENTRANT checkpoint_wrapper) after wrapping",
            checkpoint_after_wrap=True,
        ),
        Feature(
            "checkpoint_outside_unit",
            "a NO_REENTRANT checkpoint_wrapper around each wrapped unit: its recompute reruns the "
            "unit's own forward, hooks included, inside backward, after the unit's pre-backward",
            checkpoint_outside_unit=True,
        ),
        Feature(
            "sharded_checkpoint",
            "the round trip saves the sharded state dict with torch.distributed.checkpoint and "
            "loads it into the fresh model's sharded state dict",
            sharded_checkpoint=True,
        ),
        Feature(
            "move_mid_training",
            "model.to(torch.device(type, index)) after the first step, as HF Trainer does",
            move_mid_training=True,
        ),
        Feature("tied_weights", "embedding and output head share one parameter (model lm)"),
        Feature(
            "foreach_optimizer",
            "SGD with foreach=True (multi-tensor kernels, torch's default on accelerators)",
            foreach_optimizer=True,
        ),
        # Construction paths and setters (wrapping only: the references train as in "plain").
        Feature(
            "sync_module_states",
            "FSDP1's sync_module_states=True; every rank but 0 starts from other values",
            wrap_variant="sync_module_states",
        ),
        Feature(
            "meta_init",
            "the model on the meta device when wrapped, then materialized with the initial values "
            "(FSDP1: param_init_fn; FSDP2: to_empty and a copy into the shards)",
            wrap_variant="meta_init",
        ),
        Feature(
            "shard_dim1",
            "FSDP2's shard_placement_fn: every 2-D parameter sharded on dim 1",
            wrap_variant="shard_dim1",
        ),
        Feature(
            "keep_after_backward",
            "2 micro-batches, the first under FSDP2's set_requires_gradient_sync(False) and "
            "set_reshard_after_backward(False) (gradient accumulation without a second gather)",
            micro_batches=2,
            wrap_variant="keep_after_backward",
        ),
        Feature(
            "apply",
            "every parameter perturbed before wrapping; FSDP1's model.apply(fn) after wrapping puts "
            "the initial values back (apply runs fn on full parameters and writes them back)",
            wrap_variant="apply",
        ),
        Feature(
            "summon_writeback",
            "every parameter perturbed before wrapping; restored inside FSDP1's "
            "summon_full_params(writeback=True)",
            wrap_variant="summon_writeback",
        ),
        Feature(
            "policy_override",
            "FSDP1's CustomPolicy wraps the units with a sharding strategy of their own (FULL_SHARD "
            "and SHARD_GRAD_OP swapped, NO_SHARD's units FULL_SHARD)",
            wrap_variant="policy_override",
        ),
        Feature(
            "mixed_reshard",
            "FSDP2's units with reshard_after_forward the opposite of the root's",
            wrap_variant="mixed_reshard",
        ),
        # Only in a matrix of 4 or more ranks (RANKS_MATRIX): hpZ's group must divide the shard
        # group's size and be neither 1 nor all of it.
        Feature(
            "hpz",
            "FSDP2's units with reshard_after_forward=2 (ZeRO++'s hpZ): after forward each rank "
            "keeps its share of 2 ranks' rows, and backward gathers within those 2 ranks",
            wrap_variant="hpz",
        ),
        # The offload features below are EXTRA_FEATURES: run only for implementations that list
        # them (Adapter.features), since torch FSDP has no equivalent of any of them.
        Feature(
            "offload_optimizer",
            "optimizer state and step in CPU memory (DeepSpeed offload_optimizer: cpu)",
            optimizer_offload="cpu",
        ),
        Feature(
            "disk_offload",
            "parameters in files in a temporary directory (fsdp_lite CPUOffload(offload_dir=...), "
            "DeepSpeed offload_param: nvme)",
            disk_offload=True,
        ),
        Feature(
            "disk_offload_optimizer",
            "optimizer state in files in a temporary directory (DeepSpeed offload_optimizer: nvme)",
            optimizer_offload="disk",
        ),
    ]
}
# Run only for implementations whose adapter lists them (Adapter.features), in their own slice of
# the default matrix: the matrix every other implementation runs does not grow.
EXTRA_FEATURES = ("offload_optimizer", "disk_offload", "disk_offload_optimizer")


@dataclass(frozen=True)
class Slice:
    """A product of strategies x precisions x features x models, one part of a matrix."""

    strategies: tuple[str, ...]
    precisions: tuple[str, ...]
    features: tuple[str, ...]
    models: tuple[str, ...]


_ALL_STRATEGIES = CORE_STRATEGIES + EXTRA_STRATEGIES
# Features that need more ranks than the default 2: only in RANKS_MATRIX.
RANKS_FEATURES = ("hpz",)
_LOOP_FEATURES = tuple(
    f
    for f in FEATURES
    if f != "tied_weights" and f not in EXTRA_FEATURES and f not in RANKS_FEATURES
)

# Every feature with one transformer, in every precision. The transformer has no tied weights, so
# a tied-weights bug fails only the tied_weights case (which trains lm, the same model tied).
# Every model with the loop features that change gradients. BatchNorm (convnet) stays in fp32:
# FSDP1 keeps BatchNorm in fp32 under MixedPrecision and FSDP2 does not, so there is no one
# mixed-precision reference for it.
_MODELS = ("mlp", "nested", "convnet", "frozen", "hf_llama")
DEFAULT_MATRIX = (
    # A reduce dtype other than the param dtype; a persistent float buffer through a state-dict
    # round trip under buffer_dtype; a parameter no rank uses (its grad must stay None).
    Slice(CORE_STRATEGIES, ("bf16r32",), ("plain",), ("lm_untied", "bufnet")),
    # ... and backwards without sync under it: FSDP1 sums them in bf16, FSDP2 in fp32.
    Slice(CORE_STRATEGIES, ("bf16r32",), ("no_sync",), ("lm_untied",)),
    Slice(CORE_STRATEGIES, ("fp32", "bf16"), ("plain",), ("bufnet", "unused")),
    # Construction paths on a model with float and integer buffers (lm_untied has none).
    Slice(CORE_STRATEGIES, ("fp32", "bf16"), ("sync_module_states", "meta_init"), ("bufnet",)),
    # fp16: an inf in the gradient rows of one rank only; the gradient scaler must agree.
    Slice(CORE_STRATEGIES, ("fp16",), ("plain",), ("spiky",)),
    Slice(CORE_STRATEGIES, ("fp32", "bf16", "fp16"), _LOOP_FEATURES, ("lm_untied",)),
    Slice(CORE_STRATEGIES, ("fp32", "bf16", "fp16"), ("tied_weights",), ("lm",)),
    Slice(CORE_STRATEGIES, ("fp32",), ("plain", "no_sync", "clip_grad_norm"), _MODELS),
    Slice(
        CORE_STRATEGIES, ("bf16", "fp16"), ("plain",), tuple(m for m in _MODELS if m != "convnet")
    ),
    Slice(
        EXTRA_STRATEGIES,
        ("fp32", "bf16"),
        ("plain", "no_sync", "clip_grad_norm", "foreach_optimizer"),
        ("lm_untied",),
    ),
    Slice(_ALL_STRATEGIES, ("fp32", "bf16"), EXTRA_FEATURES, ("lm_untied",)),
    # Disk offload on a model big enough to reach the disk (DeepSpeed swaps only tensors >= 1 MiB).
    Slice(
        _ALL_STRATEGIES, ("fp32", "bf16"), ("disk_offload", "disk_offload_optimizer"), ("wide_lm",)
    ),
)
# Added to the default matrix at 4 or more ranks (the nightly's --nproc 4): what 2 ranks cannot
# show. HYBRID_SHARD is already in DEFAULT_MATRIX; at 4 ranks its mesh is 2 replicas x 2 shards.
RANKS_MATRIX = (Slice(("FULL_SHARD",), ("fp32", "bf16"), RANKS_FEATURES, ("lm_untied",)),)
QUICK_MATRIX = (
    Slice(
        CORE_STRATEGIES,
        ("fp32",),
        ("plain", "no_sync", "clip_grad_norm", "clip_grad_norm_inf"),
        ("lm_untied",),
    ),
    Slice(CORE_STRATEGIES, ("fp32",), ("tied_weights",), ("lm",)),
    Slice(CORE_STRATEGIES, ("fp32",), ("plain",), ("mlp", "nested")),
    Slice(("FULL_SHARD",), ("bf16", "fp16", "bf16r32"), ("plain",), ("lm_untied",)),
    Slice(("FULL_SHARD",), ("bf16r32",), ("no_sync",), ("lm_untied",)),
    # One case of each other thing the self-test's catalog shows can break on its own (the
    # extra strategies and features only for implementations that have them).
    Slice(EXTRA_STRATEGIES, ("fp32",), ("plain", "foreach_optimizer"), ("lm_untied",)),
    Slice(
        ("FULL_SHARD",),
        ("fp32",),
        (
            "accumulate",
            "frozen_in_unit",
            "move_mid_training",
            "checkpoint_outside_unit",
            "sharded_checkpoint",
            "disk_offload",
        ),
        ("lm_untied",),
    ),
    Slice(("FULL_SHARD",), ("fp32",), ("plain",), ("unused",)),
    Slice(("FULL_SHARD",), ("bf16",), ("plain",), ("bufnet",)),
    Slice(("FULL_SHARD",), ("fp16",), ("plain",), ("spiky",)),
)
# A user's own model (--model): the features that do not depend on the model's structure (the
# freezing features need the zoo's transformer, activation checkpointing its Block). "*" stands
# for the model's name.
_ANY_MODEL_FEATURES = (
    "cpu_offload",
    "backward_prefetch_pre",
    "backward_prefetch_post",
    "backward_prefetch_none",
    "forward_prefetch",
    "move_mid_training",
)
MODEL_MATRIX = (
    Slice(
        CORE_STRATEGIES, ("fp32", "bf16", "fp16"), ("plain", "no_sync", "clip_grad_norm"), ("*",)
    ),
    Slice(CORE_STRATEGIES, ("fp32",), _ANY_MODEL_FEATURES, ("*",)),
    Slice(EXTRA_STRATEGIES, ("fp32", "bf16"), ("plain", "no_sync", "clip_grad_norm"), ("*",)),
)
# The optimizers other than SGD (``--optimizers``), a matrix of their own so that the default
# one does not grow: the loop features that change what the optimizer sees (no_sync's summed
# gradients, a clipped norm), mixed precision's fp32 master step, and a model without embeddings.
OPTIMIZER_MATRIX = (
    Slice(CORE_STRATEGIES, ("fp32",), ("plain", "no_sync", "clip_grad_norm"), ("lm_untied",)),
    Slice(CORE_STRATEGIES, ("bf16",), ("plain",), ("lm_untied",)),
    Slice(EXTRA_STRATEGIES, ("fp32",), ("plain",), ("lm_untied",)),
    Slice(("FULL_SHARD",), ("fp32",), ("plain",), ("mlp",)),
    Slice(("FULL_SHARD",), ("fp32",), ("tied_weights",), ("lm",)),
)
OPTIMIZER_QUICK_MATRIX = (
    Slice(("FULL_SHARD",), ("fp32",), ("plain", "no_sync"), ("lm_untied",)),
    Slice(("SHARD_GRAD_OP",), ("fp32",), ("plain",), ("lm_untied",)),
)
MODEL_QUICK_MATRIX = (
    Slice(CORE_STRATEGIES, ("fp32",), ("plain", "no_sync", "clip_grad_norm"), ("*",)),
    Slice(("FULL_SHARD",), ("bf16",), ("plain",), ("*",)),
)


def build_matrix(
    impls: Sequence[str],
    known_strategies: dict[str, Iterable[str]],
    world_size: int,
    quick: bool = False,
    known_features: dict[str, Iterable[str]] | None = None,
    model: str | None = None,
    optimizers: Sequence[str] = ("sgd",),
) -> tuple[list[Case], list[str]]:
    """The cases to run for ``impls``, and notes on what was left out and why.

    ``known_strategies[impl]`` lists the ShardingStrategy members that implementation has; an
    extra strategy (HYBRID_SHARD, SHARD_OPTIM) runs only where it exists, a core one always (an
    implementation without it reports it unsupported). ``known_features[impl]`` likewise lists the
    EXTRA_FEATURES it has; the others run for every implementation. ``model`` (a registered
    user's model, ``--model``) replaces the zoo: ``MODEL_MATRIX`` (``MODEL_QUICK_MATRIX``) on it.
    ``optimizers`` (``OPTIMIZERS``): "sgd" runs that matrix, each other one ``OPTIMIZER_MATRIX``
    (``OPTIMIZER_QUICK_MATRIX``; with ``model``, the plain loop on it).
    """
    cases: list[Case] = []
    notes: list[str] = []
    seen: set[Case] = set()
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizers {unknown}: use some of {list(OPTIMIZERS)}")
    for optimizer in optimizers:
        if optimizer != "sgd":
            slices = OPTIMIZER_QUICK_MATRIX if quick else OPTIMIZER_MATRIX
            if model is not None:
                slices = (Slice(CORE_STRATEGIES, ("fp32",), ("plain",), ("*",)),)
        elif model is not None:
            slices = MODEL_QUICK_MATRIX if quick else MODEL_MATRIX
        else:
            slices = QUICK_MATRIX if quick else DEFAULT_MATRIX
            if not quick and world_size >= 4:
                slices += RANKS_MATRIX
        for impl in impls:
            known = set(known_strategies.get(impl, ()))
            features_known = set((known_features or {}).get(impl, ()))
            for part in slices:
                for strategy in part.strategies:
                    if strategy not in CORE_STRATEGIES and strategy not in known:
                        continue
                    for precision in part.precisions:
                        for feature in part.features:
                            if feature in EXTRA_FEATURES and feature not in features_known:
                                continue
                            for name in part.models:
                                name = model if name == "*" else name
                                case = Case(
                                    impl, strategy, precision, feature, name, world_size, optimizer
                                )
                                if case not in seen:
                                    seen.add(case)
                                    cases.append(case)
    for name in sorted({c.model for c in cases}):
        reason = SPECS[name].unavailable()
        if reason:
            notes.append(f"model {name} left out: {reason}")
            cases = [c for c in cases if c.model != name]
    return cases, notes


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (1 <= i <= n) as (i, n), for ``--shard``."""
    index, slash, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not slash or not 1 <= i <= n:
        raise ValueError(f"--shard takes i/n with 1 <= i <= n, e.g. 2/4, not {text!r}")
    return i, n


def shard(cases: list[Case], index: int, count: int) -> list[Case]:
    """Part ``index`` (1-based) of ``count`` of ``cases``: every count-th case from index - 1.

    Round robin, not blocks, so that every part gets a similar mix of models and precisions (and
    of slow cases); the same for the same case list on every machine, since the list is.
    """
    return list(cases[index - 1 :: count])


def select(cases: list[Case], patterns: Sequence[str]) -> list[Case]:
    """Cases whose name matches any pattern: a glob if it has * ? or [, else a substring."""
    if not patterns:
        return cases

    def matches(name: str, pattern: str) -> bool:
        if any(ch in pattern for ch in "*?["):
            return fnmatch.fnmatchcase(name, pattern)
        return pattern in name

    return [c for c in cases if any(matches(c.name, p) for p in patterns)]
