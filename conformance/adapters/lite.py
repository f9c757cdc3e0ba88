"""The adapter for fsdp_lite: torch FSDP1's constructor, sharded parameters as DTensors.

fsdp_lite takes FSDP1's arguments under the same names, so wrapping is the shared FSDP1 recipe
(``Fsdp1ApiAdapter`` with ``api = "fsdp_lite"``); its parameters, gradients and optimizer state are
DTensors, so the base class's full-tensor helpers apply unchanged. Whatever fsdp_lite does not
build raises NotImplementedError when wrapping, which the runner reports unsupported.
"""

from __future__ import annotations

from conformance.adapters.base import Fsdp1ApiAdapter

__all__ = ["FsdpLiteAdapter"]


class FsdpLiteAdapter(Fsdp1ApiAdapter):
    name = "fsdp_lite"
    description = "fsdp_lite.FullyShardedDataParallel (this repository)"
    api = "fsdp_lite"

    def features(self) -> list[str]:
        # CPUOffload(offload_params=True, offload_dir=...): params, grads and optimizer state in
        # files (docs/disk_offload.md). Its optimizer state never goes to disk without the params.
        return ["disk_offload"]
