"""``torch.optim.Muon`` on sharded parameters, computing what it computes on one device.

Muon orthogonalizes each weight matrix's momentum with Newton-Schulz iterations: whole-matrix math,
not elementwise. torch's own Muon, handed FSDP's DTensor shards, computes something else (the
orthogonalized update of a sharded matrix is not the rows of the whole one's). ``Muon`` here takes
the same arguments and keeps every elementwise part on the shards (momentum, Nesterov, weight
decay, the update), and gathers only the matrix Newton-Schulz needs:

    per matrix, per step:  momentum and update on this rank's rows        (as torch, elementwise)
                           all-gather the update -> the whole matrix      (one collective)
                           torch's Newton-Schulz on it, on every rank     (the same math, bits)
                           take this rank's rows, apply them to the shard (as torch, elementwise)

so every parameter and momentum buffer is bitwise what DDP + ``torch.optim.Muon`` gives (the same
averaged gradient, the same single-device math). Plain (unsharded) parameters take torch's path
unchanged. Not yet: one owner per matrix computing for all (today every rank repeats the
Newton-Schulz), batched collectives, tensor-parallel matrices (refused).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim import Muon as TorchMuon
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

__all__ = ["Muon"]


class Muon(TorchMuon):
    """``torch.optim.Muon`` (same arguments, same state) that is exact on sharded parameters."""

    @torch.no_grad()
    def step(self, closure=None):
        """One step: torch's Muon for plain parameters; for DTensor shards, see the module doc."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)  # torch's checks (2-D, not complex)
            for param, grad, buf in zip(params, grads, bufs):
                if isinstance(param, DTensor):
                    _sharded_step(param, grad, buf, group)
                else:
                    _plain_step(param, grad, buf, group)
        return loss


def _plain_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
    """torch's single-tensor Muon step, on whole tensors."""
    update = _momentum_update(grad, buf, group)
    _apply(param, _orthogonalize(update, group), group, param.shape)


def _sharded_step(param: DTensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
    mesh, placements = param.device_mesh, param.placements
    if any(type(pl) not in (Shard, Replicate) for pl in placements):
        raise NotImplementedError(
            f"fsdp_lite.Muon on a parameter with placements {placements}: only Shard and "
            "Replicate placements are built (not tensor parallel's strided or partial ones)"
        )
    # Elementwise on DTensors of one layout: local ops, and the in-place updates bump the
    # parameter's version as torch's do (SHARD_OPTIM re-gathers a unit whose shards changed).
    update = _momentum_update(grad, buf, group)
    orthogonal = _orthogonalize(update.full_tensor(), group)
    # This rank's rows of the result, cut as its shard is (no collective: every rank has it all).
    mine = distribute_tensor(orthogonal, mesh, placements, src_data_rank=None)
    _apply(param, mine, group, param.shape)


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
