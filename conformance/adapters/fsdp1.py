"""The adapter for native torch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``).

Wraps with ``use_orig_params=True`` and an explicit ``device_id`` (``torch.device('cpu')`` on CPU),
the case's units chosen by a lambda auto-wrap policy. Full parameters and gradients come from
``summon_full_params(with_grads=True)``, optimizer state from ``FSDP.optim_state_dict``, and state
dicts are FSDP1's default FULL_STATE_DICT.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from conformance.adapters.base import (
    Fsdp1ApiAdapter,
    Unsupported,
    WrapRequest,
    clean_name,
    wrap_variant,
)
from conformance.matrix import Case

__all__ = ["TorchFSDP1Adapter"]


class TorchFSDP1Adapter(Fsdp1ApiAdapter):
    name = "torch_fsdp1"
    description = "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1), use_orig_params=True"
    api = "torch.distributed.fsdp"
    # DTensor values need FSDP1 built on a device_mesh ("NoneType has no attribute ndim" from
    # _create_chunk_dtensor otherwise); ShardedTensor ones save and load through DCP alike.
    sharded_use_dtensor = False

    def unsupported_reason(self, case: Case) -> str | None:
        if case.optimizer == "muon":
            # use_orig_params exposes each parameter as a 1-D view of the rank's flat shard.
            return (
                "FSDP1's parameters are 1-D views of flat shards: torch.optim.Muon takes 2-D ones"
            )
        return super().unsupported_reason(case)

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        if request.cpu_offload and request.device.type == "cpu":
            # FSDP1 moves offloaded shards to the accelerator for compute; without one, the first
            # forward raises "Cannot access accelerator device when none is available".
            raise Unsupported("FSDP1's CPUOffload needs an accelerator as the compute device")
        if wrap_variant(request.case) == "sync_module_states" and request.device.type == "cpu":
            # "The module has CPU parameters or buffers when `sync_module_states=True`, which
            # requires them to be on GPU" (FSDP1's words, raised when wrapping).
            raise Unsupported("FSDP1's sync_module_states needs parameters on an accelerator")
        return super().wrap(model, request)

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
        # FULL_STATE_DICT (FSDP1's default): unsharded tensors on every rank, original names
        # (FSDP1 strips its own prefixes, checkpoint_wrapper its own: keys are compared as saved).
        return {
            k: v.detach().clone()
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
