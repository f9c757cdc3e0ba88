"""One training step, written once and run by the implementation and by both references.

``train_step`` is the loop: micro-batches (all but the last under no_sync), loss scaling for fp16,
unscale, clip, optimizer step. It hands each stage's full tensors to a ``sink``: the references'
sink records them, the implementation's compares them. A ``Trainer`` is what the loop drives:
``ImplTrainer`` through an adapter, ``ReplicaTrainer`` as DDP or as one process on the global batch,
emulating FSDP's mixed precision (fp32 master weights, low-precision compute copy) when asked.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from conformance.adapters.base import Adapter, Unsupported, WrapRequest, clean_name, full_tensor
from conformance.matrix import Feature, Precision
from conformance.zoo import ModelSpec

__all__ = [
    "ADAMW",
    "GRAD_NORM_KEY",
    "LR",
    "MOMENTUM",
    "MUON",
    "ImplTrainer",
    "MatricesAndRest",
    "OptimizerFactory",
    "ReplicaTrainer",
    "Trainer",
    "make_sgd",
    "matrix_names",
    "train_step",
]

# SGD with momentum, not Adam: Adam normalizes a wrongly scaled gradient away (measured: a gradient scaled by 1e-3 moved AdamW params by ~1e-5 in 3 steps).
LR = 0.05
MOMENTUM = 0.9
# Small enough that tiny models' fp16 gradients never overflow, so no step is skipped.
INIT_SCALE = 256.0
GRAD_NORM_KEY = "(total norm)"  # the norm clip_grad_norm_ returned, compared with the grads

Batch = list[tuple[torch.Tensor, torch.Tensor]]  # (input, target) parts; one part but for BatchNorm
Sink = Callable[[str, Any], None]


# FSDP leaves buffers (BatchNorm statistics) rank-local after init; so must DDP. torch 2.13 renamed
# broadcast_buffers (and warns about it); the new name still syncs once at init, which is harmless
# here because every rank builds identical buffers.
if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
    _RANK_LOCAL_BUFFERS = {"forward_sync_buffers": False}
else:
    _RANK_LOCAL_BUFFERS = {"broadcast_buffers": False}


def make_sgd(params, foreach: bool = False) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor kernels whatever the parameter type (DTensor or not).
    # The multi-tensor kernels (feature foreach_optimizer) give the same bits on plain tensors.
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, foreach=foreach)


# The other optimizers of the axis (--optimizers). AdamW's update is elementwise, as SGD's; Muon
# (torch.optim.Muon's arguments, as tests/test_muon.py) orthogonalizes each whole matrix.
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
MUON = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw", "nesterov": True}


def matrix_names(model: nn.Module) -> frozenset[str]:
    """The parameters Muon takes: the 2-D ``weight`` of every module but an ``nn.Embedding`` (so
    neither a token embedding, nor an output head tied to it, nor a bare 2-D parameter such as a
    position table), by name as in the unwrapped module. An untied output head is a matrix here."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return frozenset(
        clean_name(n)
        for n, p in model.named_parameters()
        if p.ndim == 2 and n.rsplit(".", 1)[-1] == "weight" and id(p) not in embeddings
    )


class MatricesAndRest:
    """Muon on the matrices and AdamW on the rest, stepped as one optimizer: ``param_groups``,
    ``state``, ``step`` and ``zero_grad`` as torch's (what a gradient scaler and the suite use);
    ``optimizers`` the two (or one, when a side has no parameters)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure=None):
        loss = None if closure is None else closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class OptimizerFactory:
    """The suite's optimizer for one case: ``factory(params, muon=...)`` (what
    ``WrapRequest.make_optimizer`` and ``Adapter.make_optimizer`` call).

    ``params`` are parameters, or (name, parameter) pairs, which "muon" needs: the parameters
    named in ``matrices`` (``matrix_names`` of the unwrapped model) go to ``muon`` (the class:
    torch.optim.Muon unless the adapter passes its own), the others to AdamW.
    """

    def __init__(
        self, optimizer: str = "sgd", foreach: bool = False, matrices: frozenset[str] = frozenset()
    ) -> None:
        self.optimizer, self.foreach, self.matrices = optimizer, foreach, matrices

    def __call__(self, params, muon: type | None = None):
        params = list(params)
        named = [p for p in params if isinstance(p, tuple)]
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        if self.optimizer == "sgd":
            return make_sgd(tensors, foreach=self.foreach)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(tensors, **ADAMW, foreach=self.foreach)
        if len(named) != len(params):
            raise Unsupported("muon splits the parameters by name: pass model.named_parameters()")
        matrices = [p for n, p in named if clean_name(n) in self.matrices]
        rest = [p for n, p in named if clean_name(n) not in self.matrices]
        optimizers = []
        if matrices:
            optimizers.append((muon or torch.optim.Muon)(matrices, **MUON))
        if rest:
            optimizers.append(torch.optim.AdamW(rest, **ADAMW, foreach=self.foreach))
        return MatricesAndRest(*optimizers)


class Trainer:
    """What ``train_step`` drives; one instance per model per case."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Forward, loss (fp32), backward (scaled under fp16); returns the detached loss."""
        raise NotImplementedError

    def finish_backward(self) -> None:
        """After the last backward of a step: land gradients in fp32, unscale them under fp16."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def grads(self) -> dict[str, torch.Tensor | None]:
        raise NotImplementedError

    def params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def optim_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def train_step(
    trainer: Trainer,
    micro_batches: list[Batch],
    feature: Feature,
    sink: Sink,
    observe: tuple[str, ...] = ("grads", "params", "optim_state"),
) -> None:
    """One optimizer step over ``micro_batches``; each stage's full tensors go to ``sink``.

    ``observe`` names the stages read besides the loss. Reading one gathers full tensors (native
    FSDP1: ``summon_full_params``), which can also repair state the implementation lost, so a
    step that must show such a loss as a training loop would see it reads less.
    """
    losses = {}
    for i, batch in enumerate(micro_batches):
        synced = i == len(micro_batches) - 1 or feature.sync_micro_batches
        with contextlib.nullcontext() if synced else trainer.no_sync():
            losses[f"micro-batch {i}"] = trainer.forward_backward(batch)
    sink("loss", losses)
    trainer.finish_backward()
    norm = None
    if feature.clip_grad_norm is not None:
        norm = trainer.clip_grad_norm_(feature.clip_grad_norm, feature.clip_norm_type)
        norm = full_tensor(norm).detach().float()
    if "grads" in observe:
        grads = trainer.grads()
        if norm is not None:
            grads[GRAD_NORM_KEY] = norm.reshape(())
        sink("grads", grads)
    trainer.step()
    if "params" in observe:
        sink("params", trainer.params())
    if "optim_state" in observe:
        sink("optim_state", trainer.optim_state())


def _optimizer_step(optim: torch.optim.Optimizer, scaler) -> None:
    """Step (through the fp16 scaler when there is one), then drop the gradients."""
    if scaler is not None:
        scaler.step(optim)
        scaler.update()
    else:
        optim.step()
    optim.zero_grad(set_to_none=True)


def _flat_optim_state(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{name}:{key}": t for name, per in state.items() for key, t in per.items()}


def _optimizer_entries(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Optimizer state by name as the state_dict stage compares it, beside the model's keys."""
    return {f"(optimizer) {k}": t for k, t in _flat_optim_state(state).items()}


def _to(batch: Batch, device: torch.device) -> Batch:
    return [(x.to(device), y.to(device)) for x, y in batch]


class ImplTrainer(Trainer):
    """The implementation under test, through its adapter."""

    def __init__(
        self,
        adapter: Adapter,
        model: nn.Module,
        request: WrapRequest,
        spec: ModelSpec,
        precision: Precision,
    ) -> None:
        self.adapter, self.model, self.spec = adapter, model, spec
        self.device = request.device
        self.optim = adapter.make_optimizer(model, request.make_optimizer)
        self.scaler = (
            adapter.make_grad_scaler(model, request, INIT_SCALE) if precision.grad_scaler else None
        )

    def no_sync(self):
        return self.adapter.no_sync(self.model)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        ((x, y),) = _to(batch, self.device)  # ranks get one part each
        loss = self.spec.compute_loss(self.model(x), y)
        self.adapter.backward(self.model, self.scaler.scale(loss) if self.scaler else loss)
        return loss.detach()

    def finish_backward(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optim)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type == 2.0:  # adapters written before norm_type was passed take two arguments
            return self.adapter.clip_grad_norm_(self.model, max_norm)
        return self.adapter.clip_grad_norm_(self.model, max_norm, norm_type=norm_type)

    def step(self) -> None:
        if self.scaler is not None:
            _optimizer_step(self.optim, self.scaler)
        else:
            self.adapter.step(self.model, self.optim)  # DeepSpeed: engine.step()

    def grads(self):
        return self.adapter.full_grads(self.model)

    def params(self):
        return self.adapter.full_params(self.model)

    def optim_state(self):
        state = _flat_optim_state(self.adapter.full_optim_state(self.model, self.optim))
        if self.scaler is not None:
            state["(grad scaler):scale"] = torch.as_tensor(self.scaler.get_scale()).float()
        return state

    def state_dict(self):
        return self.adapter.full_state_dict(self.model)

    def optim_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The implementation's own optimizer state dict, flat ("(optimizer) name:key"), or None."""
        merged: dict[str, dict[str, torch.Tensor]] = {}
        for optim in getattr(self.optim, "optimizers", [self.optim]):  # MatricesAndRest: each
            osd = self.adapter.full_optim_state_dict(self.model, optim)
            if osd is None:
                return None
            merged.update(osd)
        return _optimizer_entries(merged)


class ReplicaTrainer(Trainer):
    """A reference: DDP over ``group`` (``group`` given) or a single process (``group`` None).

    Under mixed precision it does what FSDP's MixedPrecision does, with whole tensors: the
    optimizer steps fp32 master weights; forward and backward run on a copy cast to the low
    dtype (float inputs cast too); gradients are reduced in the low dtype (DDP over the copy) and
    cast to fp32 for the step. torch's own DDP mixed precision needs CUDA events, so not used.
    A reduce dtype other than the low dtype (bf16r32) is done by hand: each rank's accumulated
    gradients, cast to it and divided by N, are all-reduced after the last backward. Backwards
    without sync sum in the low dtype (torch FSDP1's no_sync), or with ``unsynced_in_reduce_dtype``
    in the reduce dtype (torch FSDP2: the first cast, each later one added in place).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        precision: Precision,
        device: torch.device,
        group: dist.ProcessGroup | None,
        unsynced_in_reduce_dtype: bool = False,
        optimizer: str = "sgd",
    ) -> None:
        self.spec, self.device, self.dtype = spec, device, precision.dtype
        self.master = model
        self.compute = copy.deepcopy(model).to(self.dtype) if self.dtype else model
        self.group = group
        reduce_dtype = precision.grad_reduce_dtype
        # Reduced by hand in finish_backward: DDP would reduce in the gradients' (low) dtype.
        self.reduce_dtype = reduce_dtype if reduce_dtype != precision.dtype else None
        if group is None or self.reduce_dtype is not None:
            self.runner: nn.Module = self.compute
        else:
            self.runner = DistributedDataParallel(
                self.compute,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=group,
                find_unused_parameters=spec.has_unused_params,
                **_RANK_LOCAL_BUFFERS,
            )
        make = OptimizerFactory(optimizer, matrices=matrix_names(self.master))
        self.optim = make(self.master.named_parameters())
        self._local_backward = False  # inside no_sync(): gradients stay local
        # parameter index -> the unsynced backwards' sum in the reduce dtype (FSDP2's way)
        self._unsynced: dict[int, torch.Tensor] | None = (
            {} if unsynced_in_reduce_dtype and reduce_dtype != precision.dtype else None
        )
        self._landed: dict[int, torch.Tensor] = {}  # parameter index -> this step's gradient
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)
            if precision.grad_scaler
            else None
        )

    @contextlib.contextmanager
    def no_sync(self):
        self._local_backward = True
        try:
            if isinstance(self.runner, DistributedDataParallel):
                with self.runner.no_sync():
                    yield
            else:
                yield  # one process, or reduced by hand: nothing to hold back
        finally:
            self._local_backward = False

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        losses = []
        for x, y in _to(batch, self.device):
            if self.dtype is not None and x.is_floating_point():
                x = x.to(self.dtype)  # FSDP casts the root's floating-point inputs too
            losses.append(self.spec.compute_loss(self.runner(x), y))
        # Several parts: the mean of the parts' losses, as DDP's mean over ranks.
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if not self._local_backward:
            self._land_grads()
        elif self._unsynced is not None:
            self._sum_unsynced()
        return loss.detach()

    def _sum_unsynced(self) -> None:
        """Move this backward's low-precision gradients into the reduce-dtype sums."""
        with torch.no_grad():
            for i, low in enumerate(self.compute.parameters()):
                if low.grad is None:
                    continue
                if i in self._unsynced:
                    self._unsynced[i] += low.grad  # in place: fp32 += bf16, as torch FSDP2
                else:
                    self._unsynced[i] = low.grad.to(self.reduce_dtype)
                low.grad = None

    def _land_grads(self) -> None:
        """After a backward that synced: add its (reduced) gradients to the step's, in fp32.

        As FSDP does: each synced backward's averaged gradient lands on the full-precision
        (sharded) grad, and a second one is added there. DDP alone would add the second
        backward's local gradients to the first's averaged ones and average again: the same sum,
        rounded otherwise. With one synced backward per step this moves tensors and adds nothing.
        """
        with torch.no_grad():
            grads = [low.grad for low in self.compute.parameters()]
            for low in self.compute.parameters():
                low.grad = None
            for i, unsynced in (self._unsynced or {}).items():
                if grads[i] is not None:
                    unsynced += grads[i]  # in place, as torch FSDP2 adds the synced backward's
                grads[i] = unsynced
            if self._unsynced:
                self._unsynced = {}
            if self.reduce_dtype is not None and self.group is not None:
                # As FSDP with reduce_dtype: the low-precision gradients are cast, then averaged
                # over the ranks in the reduce dtype (divided first, as DDP divides).
                world_size = dist.get_world_size(self.group)
                for i, grad in enumerate(grads):
                    if grad is not None:
                        grads[i] = grad.to(self.reduce_dtype).div_(world_size)
                        dist.all_reduce(grads[i], group=self.group)
            for i, grad in enumerate(grads):
                if grad is None:
                    continue
                grad = grad if self.dtype is None else grad.float()
                self._landed[i] = grad if i not in self._landed else self._landed[i] + grad

    def finish_backward(self) -> None:
        for i, master in enumerate(self.master.parameters()):
            master.grad = self._landed.pop(i, None)
        if self.scaler is not None:
            self.scaler.unscale_(self.optim)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.master.parameters(), max_norm, norm_type)

    def step(self) -> None:
        _optimizer_step(self.optim, self.scaler)
        if self.dtype is not None:
            with torch.no_grad():
                for master, low in zip(self.master.parameters(), self.compute.parameters()):
                    low.copy_(master)  # the next forward's low-precision weights

    def grads(self):
        return {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in self.master.named_parameters()
        }

    def params(self):
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}

    def optim_state(self):
        state = {
            n: {
                k: v.detach().clone() for k, v in self.optim.state.get(p, {}).items() if v.dim() > 0
            }
            for n, p in self.master.named_parameters()
        }
        flat = _flat_optim_state({n: s for n, s in state.items() if s})
        if self.scaler is not None:
            flat["(grad scaler):scale"] = torch.as_tensor(self.scaler.get_scale()).float()
        return flat

    def optim_state_dict(self) -> dict[str, torch.Tensor]:
        state = {
            n: {
                k: v.detach().clone() for k, v in self.optim.state.get(p, {}).items() if v.dim() > 0
            }
            for n, p in self.master.named_parameters()
        }
        return _optimizer_entries({n: s for n, s in state.items() if s})

    def state_dict(self):
        sd = {k: v.detach().clone() for k, v in self.master.state_dict().items()}
        if self.dtype is not None:
            # Buffers live (and are updated) on the compute copy; checkpoints keep full precision.
            for k, v in self.compute.named_buffers():
                if k in sd:
                    sd[k] = v.detach().to(sd[k].dtype).clone()
        return sd
