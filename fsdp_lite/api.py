"""Public enums and config dataclasses, and the strategy table the engine reads.

Names, members and field defaults mirror torch FSDP's ``api`` module, so that user code written for
torch FSDP works after changing one import. ``STRATEGY_RULES`` is the one place that says what a
sharding strategy keeps and how it reduces gradients. A unit reads it when it is built, to choose
its parameters' kind and its reduction (engine/unit.py), and reads what to keep after forward and
backward from it at each reshard, since FSDP2's setters may change those between steps.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, TypeVar

import torch

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "Rules",
    "STRATEGY_RULES",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "as_ours",
]


class ShardingStrategy(Enum):
    """What each rank keeps of parameters, gradients and optimizer state (see ``STRATEGY_RULES``)."""

    FULL_SHARD = auto()  # ZeRO-3
    SHARD_GRAD_OP = auto()  # ZeRO-2
    NO_SHARD = auto()  # DDP
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()
    SHARD_OPTIM = auto()  # ZeRO-1; fsdp_lite only (torch FSDP has no ZeRO-1)


class BackwardPrefetch(Enum):
    """When the next unit's all-gather is issued during backward."""

    BACKWARD_PRE = auto()  # before this unit's gradient computation
    BACKWARD_POST = auto()  # after this unit's gradient computation


class StateDictType(Enum):
    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(Enum):
    """How an optimizer state dict names parameters: by name, or by position (torch's own)."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass
class CPUOffload:
    """Whether sharded parameters (and their gradients) live in CPU memory between uses.

    ``offload_dir`` (fsdp_lite only, with ``offload_params=True``): keep them, and the optimizer
    state, in memory-mapped files in a new directory under this one instead (docs/disk_offload.md).
    """

    offload_params: bool = False
    offload_dir: str | os.PathLike | None = None


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for the unsharded parameters, gradient reduction and buffers (torch FSDP1 meaning)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (
        torch.nn.modules.batchnorm._BatchNorm,
    )


@dataclass
class StateDictConfig:
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


@dataclass(frozen=True)
class Rules:
    """What one sharding strategy does, as data.

    shard_params: parameters at rest are 1/N shards (otherwise every rank holds them whole).
    reshard_after_forward: free the unsharded parameters after forward and all-gather again in backward.
    reshard_after_backward: free them after backward. Otherwise their memory stays allocated between
        steps (the FSDP1 front's modules see the shards again, the FSDP2 front's keep the unsharded
        params, as torch's do: Note [Unsharded after backward]) and the next forward gathers
        again, in place, only if the shards have changed since.
    grad_reduce: the collective that averages gradients across the shard group; with "all_reduce"
        on sharded params every rank keeps the whole averaged gradient and steps its rows of it.
    replicate: the shard group is one of several replicas; gradients are then all-reduced across
        them (HYBRID_SHARD), and parameters are sharded only within the shard group.
    """

    shard_params: bool
    reshard_after_forward: bool
    grad_reduce: str  # "reduce_scatter" | "all_reduce"
    replicate: bool = False
    reshard_after_backward: bool = True


# ZeRO (arXiv 1910.02054): stage 3 = P_os+g+p, stage 2 = P_os+g, stage 1 = P_os; NO_SHARD is plain
# data parallelism.
STRATEGY_RULES: dict[ShardingStrategy, Rules] = {
    ShardingStrategy.FULL_SHARD: Rules(
        shard_params=True, reshard_after_forward=True, grad_reduce="reduce_scatter"
    ),
    ShardingStrategy.SHARD_GRAD_OP: Rules(
        shard_params=True, reshard_after_forward=False, grad_reduce="reduce_scatter"
    ),
    ShardingStrategy.NO_SHARD: Rules(
        shard_params=False, reshard_after_forward=False, grad_reduce="all_reduce"
    ),
    # Shard within a group (e.g. a node), replicate across groups: ZeRO-3 / ZeRO-2 traffic stays
    # inside the group, and only the 1/N gradient shard crosses groups.
    ShardingStrategy.HYBRID_SHARD: Rules(
        shard_params=True, reshard_after_forward=True, grad_reduce="reduce_scatter", replicate=True
    ),
    ShardingStrategy._HYBRID_SHARD_ZERO2: Rules(
        shard_params=True, reshard_after_forward=False, grad_reduce="reduce_scatter", replicate=True
    ),
    # ZeRO-1: params and averaged grads stay whole on every rank, as in DDP; only the optimizer
    # state is 1/N, because the optimizer steps the 1/N shards. See Note [ZeRO-1] in unit.py.
    ShardingStrategy.SHARD_OPTIM: Rules(
        shard_params=True,
        reshard_after_forward=False,
        reshard_after_backward=False,
        grad_reduce="all_reduce",
    ),
}


T = TypeVar("T")

# torch's FSDP defines the same enums and configs; their objects are taken by name (as_ours),
# recognized as torch's by their top-level package, so that nothing here imports torch's FSDP.
_TORCH = "torch"


def as_ours(value: Any, ours: type[T], what: str) -> T | None:
    """``value`` as fsdp_lite's ``ours``: itself, or torch FSDP's object of the same name, mapped.

    Clients (Accelerate, Lightning) build torch's ``ShardingStrategy``, ``MixedPrecision``,
    ``CPUOffload``, ``StateDictType``, ``*StateDictConfig``...; an enum member maps by its name and
    a dataclass by its fields, without importing torch's FSDP (the type is known by its name).
    None stays None.

    Raises:
        TypeError: anything else, naming both types with their modules.
    """
    if value is None or isinstance(value, ours):
        return value
    theirs = type(value)
    if theirs.__name__ == ours.__name__ and theirs.__module__.split(".")[0] == _TORCH:
        if issubclass(ours, Enum):
            return ours[value.name]
        if dataclasses.is_dataclass(value):
            known = {f.name for f in dataclasses.fields(ours)}
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            unknown = sorted(set(fields) - known)
            if unknown:
                raise TypeError(
                    f"{what}: {theirs.__module__}.{theirs.__qualname__} has fields {unknown} "
                    f"that {ours.__module__}.{ours.__qualname__} does not know"
                )
            return ours(**fields)
    raise TypeError(
        f"{what} must be {ours.__module__}.{ours.__qualname__} (or torch FSDP's "
        f"{ours.__name__}), got {theirs.__module__}.{theirs.__qualname__}: {value!r}"
    )
