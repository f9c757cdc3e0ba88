"""fsdp_lite: fully sharded data parallelism (ZeRO stages) with torch FSDP's API, readable end to end.

Swap it in for torch FSDP by changing one import: ``from fsdp_lite import FullyShardedDataParallel
as FSDP`` (the FSDP1 wrapper) or ``from fsdp_lite import fully_shard, MixedPrecisionPolicy`` (FSDP2).
"""

from fsdp_lite.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_lite.canonical import Canonical
from fsdp_lite.fronts.fsdp1 import FullyShardedDataParallel, FullyShardedModule
from fsdp_lite.fronts.fsdp2 import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from fsdp_lite.optim.muon import Muon
from fsdp_lite.optim.whole_matrix import WholeMatrix
from fsdp_lite.tools.launch import distributed
from fsdp_lite.tools.order import set_collective_order_check

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "Canonical",
    "DataParallelMeshDims",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "FullyShardedModule",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "Muon",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "WholeMatrix",
    "distributed",
    "fully_shard",
    "register_fsdp_forward_method",
    "set_collective_order_check",
]
