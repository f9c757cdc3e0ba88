"""``torch.optim.Muon`` on sharded parameters, computing what it computes on one device.

Muon orthogonalizes each weight matrix's momentum with Newton-Schulz iterations: whole-matrix math,
not elementwise. torch's own Muon, handed FSDP's DTensor shards, computes something else (the
orthogonalized update of a sharded matrix is not the rows of the whole one's). ``Muon`` here takes
the same arguments and keeps every elementwise part on the shards (momentum, Nesterov, weight
decay, the update); one owner rank per matrix (``WholeMatrix``, chosen at construction) runs
Newton-Schulz on the whole update:

    per step, every rank    momentum and update on its rows of each matrix   (as torch, elementwise)
                            the update in bf16 (Newton-Schulz's first op)    (as torch, elementwise)
    all_to_all #1           each owner receives every rank's rows of its matrices
    owner                   torch's Newton-Schulz on the whole update        (the same math, bits)
    all_to_all #2           each rank receives its rows of the results (bf16)
    every rank              weight decay and the update on its shard         (as torch, elementwise)

two collectives per step for all the matrices of one process group (per bucket, with
``bucket_numel``: then a bucket's traffic runs while the owners compute another's), so every
parameter and
momentum buffer is bitwise what DDP + ``torch.optim.Muon`` gives (the same averaged gradient, the
same single-device math). Plain (unsharded) and replicated parameters take torch's path, no
traffic. A matrix cut by tensor parallel too is gathered across both mesh dims (``WholeMatrix``).
"""

from __future__ import annotations

import torch
from torch.optim import Muon as TorchMuon
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

from fsdp_lite.engine.observe import Observer
from fsdp_lite.optim.whole_matrix import WholeMatrix

__all__ = ["Muon"]


class Muon(TorchMuon):
    """``torch.optim.Muon`` (same arguments, same state) that is exact on sharded parameters;
    ``whole`` is its owner placement (``WholeMatrix``)."""

    whole: WholeMatrix

    def __init__(self, params, *args, bucket_numel: int | None = None, **kwargs) -> None:
        """torch's arguments; ``bucket_numel``: ``WholeMatrix``'s (default: one bucket)."""
        self._bucket_numel = bucket_numel
        super().__init__(params, *args, **kwargs)  # torch's checks first (2-D, arguments)
        self._place_owners()

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the owner placement over every parameter again (the same on all ranks)."""
        super().add_param_group(param_group)
        if hasattr(self, "whole"):  # after construction
            self._place_owners()

    def _place_owners(self) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        observers = self.whole.observers if hasattr(self, "whole") else []
        self.whole = WholeMatrix(params, name="fsdp_lite.Muon", bucket_numel=self._bucket_numel)
        self.whole.observers.extend(observers)

    def watch(self, observer: Observer) -> None:
        """``observer`` (a trace) sees each step's exchanges: ``WholeMatrix.watch``."""
        self.whole.watch(observer)

    def unwatch(self, observer: Observer) -> None:
        self.whole.unwatch(observer)

    @torch.no_grad()
    def step(self, closure=None):
        """One step; see the module doc."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: list[torch.Tensor] = []
        updates: list[torch.Tensor] = []
        groups: dict[torch.Tensor, dict] = {}
        for group in self.param_groups:
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            start = len(params)
            self._init_group(group, params, grads, bufs)  # torch's checks (2-D, not complex)
            for param, grad, buf in zip(params[start:], grads, bufs):
                # Elementwise on DTensors of one layout: local ops. Newton-Schulz starts with
                # bfloat16(), so casting here is the same math, and halves the traffic.
                updates.append(_momentum_update(grad, buf, group).bfloat16())
                groups[param] = group
        orthogonal = self.whole.map(
            lambda param, update: _orthogonalize(update, groups[param]), params, updates
        )
        # In-place on the DTensors, so the parameter's version moves as torch's does (SHARD_OPTIM
        # re-gathers a unit whose shards changed).
        for param, update in zip(params, orthogonal):
            _apply(param, update, groups[param], param.shape)
        return loss


def _momentum_update(grad: torch.Tensor, buf: torch.Tensor, group: dict) -> torch.Tensor:
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    return _zeropower_via_newtonschulz(
        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
    )


def _apply(param: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
    lr = _to_scalar(group["lr"])
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
