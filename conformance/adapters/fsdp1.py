"""The adapter for native torch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``).

Wraps with ``use_orig_params=True`` and an explicit ``device_id`` (``torch.device('cpu')`` on CPU),
the case's units chosen by a lambda auto-wrap policy. Full parameters and gradients come from
``summon_full_params(with_grads=True)``, optimizer state from ``FSDP.optim_state_dict``, and state
dicts are FSDP1's default FULL_STATE_DICT.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from conformance.adapters.base import Adapter, Unsupported, WrapRequest, clean_name
from conformance.matrix import Case

__all__ = ["TorchFSDP1Adapter"]


class TorchFSDP1Adapter(Adapter):
    name = "torch_fsdp1"
    description = "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1), use_orig_params=True"

    def strategies(self) -> list[str]:
        from torch.distributed.fsdp import ShardingStrategy

        return [s.name for s in ShardingStrategy if not s.name.startswith("_")]

    def unsupported_reason(self, case: Case) -> str | None:
        if case.strategy not in self.strategies():
            return f"torch FSDP1's ShardingStrategy has no {case.strategy}"
        return None

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            CPUOffload,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        if request.cpu_offload and request.device.type == "cpu":
            # FSDP1 moves offloaded shards to the accelerator for compute; without one, the first
            # forward raises "Cannot access accelerator device when none is available".
            raise Unsupported("FSDP1's CPUOffload needs an accelerator as the compute device")
        kwargs: dict[str, Any] = {}
        if request.param_dtype is not None:
            dtype = request.param_dtype
            kwargs["mixed_precision"] = MixedPrecision(
                param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype
            )
        if request.cpu_offload:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
        if request.backward_prefetch != "default":
            kwargs["backward_prefetch"] = (
                None
                if request.backward_prefetch == "NONE"
                else BackwardPrefetch[request.backward_prefetch]
            )
        if request.strategy.startswith("HYBRID"):
            kwargs["device_mesh"] = request.hybrid_mesh()
        else:
            kwargs["process_group"] = request.group
        return FSDP(
            model,
            sharding_strategy=ShardingStrategy[request.strategy],
            auto_wrap_policy=functools.partial(
                lambda_auto_wrap_policy, lambda_fn=request.unit_policy()
            ),
            device_id=request.device,
            forward_prefetch=request.forward_prefetch,
            use_orig_params=True,
            **kwargs,
        )

    def make_grad_scaler(self, model: nn.Module, request: WrapRequest, init_scale: float) -> Any:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(
            device=request.device.type, init_scale=init_scale, process_group=request.group
        )

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            # A frozen parameter sharing a flat parameter with trainable ones shows a zero
            # gradient here, but its .grad outside (what the optimizer sees) stays None.
            return {
                clean_name(n): None
                if p.grad is None or not p.requires_grad
                else p.grad.detach().clone()
                for n, p in model.named_parameters()
            }

    def full_optim_state(
        self, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, dict[str, torch.Tensor]]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # The default state-dict type is FULL_STATE_DICT: whole tensors on every rank, by FQN.
        osd = FSDP.optim_state_dict(model, optim)
        return {
            clean_name(name): {
                k: v.detach().clone()
                for k, v in per_param.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            }
            for name, per_param in osd["state"].items()
        }

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # FULL_STATE_DICT (FSDP1's default): unsharded tensors on every rank, original names.
        return {
            clean_name(k): v.detach().clone()
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
