"""The adapter for fsdp_lite: torch FSDP1's constructor, sharded parameters as DTensors.

fsdp_lite takes FSDP1's arguments, so wrapping is FSDP1's recipe (a lambda auto-wrap policy that
picks the case's units, ``device_id``, ``process_group``); its parameters, gradients and optimizer
state are DTensors, so the base class's full-tensor helpers apply unchanged. Whatever fsdp_lite
does not build yet raises NotImplementedError when wrapping, which the runner reports unsupported.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch.nn as nn

from conformance.adapters.base import Adapter, Unsupported, WrapRequest
from conformance.matrix import Case

__all__ = ["FsdpLiteAdapter"]


class FsdpLiteAdapter(Adapter):
    name = "fsdp_lite"
    description = "fsdp_lite.FullyShardedDataParallel (this repository)"

    def strategies(self) -> list[str]:
        from fsdp_lite import ShardingStrategy

        return [s.name for s in ShardingStrategy if not s.name.startswith("_")]

    def unsupported_reason(self, case: Case) -> str | None:
        if case.strategy not in self.strategies():
            return f"fsdp_lite.ShardingStrategy has no {case.strategy}"
        return None

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        import fsdp_lite
        from fsdp_lite.wrap import lambda_auto_wrap_policy

        kwargs: dict[str, Any] = {}
        if request.param_dtype is not None:
            dtype = request.param_dtype
            kwargs["mixed_precision"] = fsdp_lite.MixedPrecision(
                param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype
            )
        if request.cpu_offload:
            kwargs["cpu_offload"] = fsdp_lite.CPUOffload(offload_params=True)
        if request.backward_prefetch != "default":
            kwargs["backward_prefetch"] = (
                None
                if request.backward_prefetch == "NONE"
                else fsdp_lite.BackwardPrefetch[request.backward_prefetch]
            )
        if request.strategy.startswith("HYBRID"):
            kwargs["device_mesh"] = request.hybrid_mesh()
        else:
            kwargs["process_group"] = request.group
        return fsdp_lite.FullyShardedDataParallel(
            model,
            sharding_strategy=fsdp_lite.ShardingStrategy[request.strategy],
            auto_wrap_policy=functools.partial(
                lambda_auto_wrap_policy, lambda_fn=request.unit_policy()
            ),
            device_id=request.device,
            forward_prefetch=request.forward_prefetch,
            use_orig_params=True,
            **kwargs,
        )

    def make_grad_scaler(self, model: nn.Module, request: WrapRequest, init_scale: float) -> Any:
        try:
            module = importlib.import_module("fsdp_lite.sharded_grad_scaler")
        except ImportError:
            raise Unsupported(
                "fsdp_lite.sharded_grad_scaler does not exist yet (fp16 needs it)"
            ) from None
        return module.ShardedGradScaler(
            device=request.device.type, init_scale=init_scale, process_group=request.group
        )
