"""The adapters for FSDP2's API: native torch (``torch.distributed.fsdp.fully_shard``) and
fsdp_lite's FSDP2 front (``fsdp_lite.fully_shard``), one recipe under the module named ``api``.

Each unit gets ``fully_shard``, then the root. Strategies map to FSDP2's terms: FULL_SHARD is
``reshard_after_forward=True``, SHARD_GRAD_OP ``False``, HYBRID_SHARD a 2-D (replicate, shard)
mesh, and NO_SHARD a (world_size, 1) mesh, i.e. every rank a replica of one unsharded shard.
Mixed precision is a ``MixedPrecisionPolicy``; gradients and optimizer state are DTensors; state
dicts go through ``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.nn as nn

from conformance.adapters.base import (
    FSDP2_VARIANTS,
    Adapter,
    WrapRequest,
    _named_tensors,
    full_tensor,
    materialize,
    to_meta,
    wrap_variant,
)
from conformance.matrix import Case

__all__ = ["FsdpLiteFSDP2Adapter", "TorchFSDP2Adapter"]


class TorchFSDP2Adapter(Adapter):
    name = "torch_fsdp2"
    description = "torch.distributed.fsdp.fully_shard (FSDP2), per unit and root"
    unsynced_grads_in_reduce_dtype = True
    # Holds fully_shard, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy and a
    # sharded_grad_scaler submodule.
    api: ClassVar[str] = "torch.distributed.fsdp"

    def strategies(self) -> list[str]:
        return ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"]

    def unsupported_reason(self, case: Case) -> str | None:
        from conformance.matrix import FEATURES

        if case.strategy not in self.strategies():
            return f"no FSDP2 equivalent of {case.strategy}"
        prefetch = FEATURES[case.feature].backward_prefetch
        if prefetch in ("BACKWARD_POST", "NONE"):
            # FSDP2 always prefetches the previous unit in pre-backward; an explicit
            # set_modules_to_backward_prefetch([]) falls back to that same default.
            return f"FSDP2 has no backward_prefetch={prefetch} mode"
        if FEATURES[case.feature].wrap_variant == "hpz":
            if case.strategy != "FULL_SHARD":
                return "hpZ (an int reshard_after_forward) is a FULL_SHARD variant here"
            if case.world_size < 4 or case.world_size % 2:
                return f"hpZ's 2-rank groups must divide {case.world_size} ranks, neither 1 nor all"
        return None

    def wrap_variants(self) -> list[str]:
        return list(FSDP2_VARIANTS)

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        api = importlib.import_module(self.api)
        CPUOffloadPolicy, MixedPrecisionPolicy = api.CPUOffloadPolicy, api.MixedPrecisionPolicy
        OffloadPolicy, fully_shard = api.OffloadPolicy, api.fully_shard

        if request.strategy == "NO_SHARD":
            mesh = request.mesh_2d(request.case.world_size, 1)
        elif request.strategy == "HYBRID_SHARD":
            mesh = request.hybrid_mesh()
        else:
            mesh = request.mesh
        mp_policy = MixedPrecisionPolicy(
            param_dtype=request.param_dtype, reduce_dtype=request.grad_reduce_dtype
        )
        if request.param_dtype is not None:
            # The case's precision includes buffer_dtype (FSDP1's MixedPrecision); FSDP2's policy
            # has none, so cast floating-point buffers (e.g. rotary inv_freq) as FSDP1 would, and
            # save them in their own dtype as FSDP1 does (full_state_dict).
            saved_dtypes = {}
            for module_name, module in model.named_modules():
                for name, buf in module.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        saved_dtypes[f"{module_name}.{name}" if module_name else name] = buf.dtype
                        module._buffers[name] = buf.to(request.param_dtype)
            model.__dict__["_conformance_buffer_dtypes"] = saved_dtypes  # per model: per case
        offload_policy = (
            CPUOffloadPolicy(pin_memory=request.device.type == "cuda")
            if request.cpu_offload
            else OffloadPolicy()
        )
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=request.strategy in ("FULL_SHARD", "HYBRID_SHARD"),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
        variant = wrap_variant(request.case)
        if variant == "shard_dim1":
            from torch.distributed.tensor import Shard

            kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else None
        values = to_meta(model) if variant == "meta_init" else None
        # mixed_reshard: the units gather after forward as the root does not (per-unit configs).
        unit_kwargs = dict(kwargs)
        if variant == "mixed_reshard":
            unit_kwargs["reshard_after_forward"] = not kwargs["reshard_after_forward"]
        elif variant == "hpz":  # the root keeps True: torch reshards no root after forward anyway
            unit_kwargs["reshard_after_forward"] = 2
        for unit in request.units:
            fully_shard(unit, **unit_kwargs)
        fully_shard(model, **kwargs)
        if values is not None:  # torchtitan's recipe: to_empty, then each rank inits its shards
            model.to_empty(device=request.device)
            for name, module in model.named_modules():
                materialize(module, f"{name}." if name else "", values)
        model.__dict__["_conformance_keep"] = variant == "keep_after_backward"  # per case
        if request.forward_prefetch:
            _chain_forward_prefetch(request.units, api.FSDPModule)
        return model

    def make_grad_scaler(self, model: nn.Module, request: WrapRequest, init_scale: float) -> Any:
        scaler = importlib.import_module(f"{self.api}.sharded_grad_scaler").ShardedGradScaler
        return scaler(
            device=request.device.type, init_scale=init_scale, process_group=request.group
        )

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # keep_after_backward: the unsharded params also stay until the next forward, as FSDP2's
        # docs suggest for gradient accumulation.
        keep = model.__dict__.get("_conformance_keep", False)
        model.set_requires_gradient_sync(False)
        if keep:
            model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            if keep:
                model.set_reshard_after_backward(True)

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # Works on DTensor gradients: the norm is reduced over the mesh.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return full_tensor(norm)

    def full_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, dict[str, torch.Tensor]] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        return _named_tensors(osd)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        dtypes = model.__dict__.get("_conformance_buffer_dtypes", {})
        return {k: v.detach().to(dtypes.get(k, v.dtype)).clone() for k, v in sd.items()}

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)

    def load_sharded_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state_dict)

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def _chain_forward_prefetch(units: list[nn.Module], FSDPModule: type) -> None:  # noqa: N803
    """Each unit prefetches the next one in forward order (skipping units nested in each other)."""
    outer = [u for u in units if not any(u is not o and u in set(o.modules()) for o in units)]
    for current, following in zip(outer, outer[1:]):
        if isinstance(current, FSDPModule) and isinstance(following, FSDPModule):
            current.set_modules_to_forward_prefetch([following])


class FsdpLiteFSDP2Adapter(TorchFSDP2Adapter):
    """fsdp_lite's FSDP2 front through the same recipe as torch's."""

    name = "fsdp_lite_fsdp2"
    description = "fsdp_lite.fully_shard (this repository's FSDP2 front), per unit and root"
    api = "fsdp_lite"

    def muon(self) -> type:
        return importlib.import_module(self.api).Muon  # exact on shards (docs/muon.md)
