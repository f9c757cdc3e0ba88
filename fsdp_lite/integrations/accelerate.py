"""fsdp_lite under HF Accelerate: ``FSDPLiteAccelerator``, an ``Accelerator`` for models that
fsdp_lite sharded (either front). A script changes its ``Accelerator`` to it, nothing else::

    from fsdp_lite.integrations.accelerate import FSDPLiteAccelerator as Accelerator

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)                      # or FullyShardedDataParallel(model, auto_wrap_policy=...)
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model, optim, loader = accelerator.prepare(model, optim, loader)

Accelerate shards with torch's own FSDP, and only on GPU-type backends; everywhere else it wraps a
model in DDP, which fails on the DTensor shards. ``prepare`` leaves a model that fsdp_lite sharded
as it is (fsdp_lite places the shards and reduces the gradients) and applies only what Accelerate
applies in evaluation mode: the autocast of ``mixed_precision`` and ``torch.compile``. The calls
whose meaning depends on the sharding are fsdp_lite's here: ``no_sync`` (and so ``accumulate``),
``clip_grad_norm_``, ``unwrap_model``, ``get_state_dict`` (full plain tensors, a collective) and
``save_state``/``load_state``, which write each sharded model with its optimizers as an fsdp_lite
checkpoint (fsdp_lite/state/checkpoint.py: DCP, every rank its own shards, atomic) in
``CHECKPOINT_DIR`` of the state folder, and leave the rest (schedulers, RNG, samplers, scaler) to
Accelerate. Models that fsdp_lite did not shard get Accelerate's own behaviour throughout.

Refused before anything runs: an ``fsdp_plugin`` and Accelerate's own FSDP, DeepSpeed or
Megatron-LM turned on by its config (each would shard or wrap the model a second time), and a
model that holds fsdp_lite units but whose root fsdp_lite did not shard. docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, extract_model_from_parallel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_lite.engine.unit import owns_unit, unit_owners
from fsdp_lite.fronts.fsdp1 import FullyShardedModule
from fsdp_lite.optim.grad_scaler import ShardedGradScaler
from fsdp_lite.state import checkpoint

__all__ = [
    "ACCELERATE_PRIVATE_API",
    "CHECKPOINT_DIR",
    "FSDPLiteAccelerator",
    "as_fsdp_lite_accelerator",
    "checkpoint_dir",
    "full_state_dict",
    "sharded_root",
]

log = logging.getLogger("fsdp_lite")

# Where save_state (and FSDPLiteTrainer's checkpoints) put a sharded model and its optimizers.
CHECKPOINT_DIR = "fsdp_lite_checkpoint"

# Accelerate's private names this module uses, checked against accelerate==1.16.0 (pyproject.toml
# pins it; tests/test_accelerate.py fails when one changes): the registries that save_state and
# load_state walk. _hidden_from_accelerate is the one place that touches them.
ACCELERATE_PRIVATE_API = ("Accelerator._models", "Accelerator._optimizers")


def sharded_root(model: nn.Module) -> nn.Module | None:
    """The module fsdp_lite sharded at ``model``'s root (seen through torch.compile), or None for
    a model without fsdp_lite units.

    Raises:
        ValueError: the model holds fsdp_lite units but its root is not one: its own parameters
            would train on each rank alone.
    """
    root = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
    if owns_unit(root):
        return root
    if unit_owners(root):
        raise ValueError(
            f"{type(root).__name__} holds modules sharded by fsdp_lite, but its root is not "
            "sharded: its own parameters would train unsynchronized on each rank. Shard the root "
            "too (fully_shard(model) after its layers, or wrap it in FullyShardedDataParallel), "
            "and pass the model that prepare() returned, not accelerator.unwrap_model(model)"
        )
    return None


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s state dict with full, plain tensors on CPU, keyed as the unwrapped model's:
    on rank 0 only (other ranks get ``{}``), or on every rank.

    Every rank must call it: each parameter is gathered in turn (torch's ``get_model_state_dict``,
    which treats both of fsdp_lite's fronts as FSDP2: fsdp_lite/state/state_dict.py, Note [torch's
    get_state_dict]).
    """
    root = sharded_root(model)
    if root is None:
        raise ValueError(f"{type(model).__name__} is not sharded by fsdp_lite")
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(root, options=options)
    if not rank0_only:  # cpu_offload would keep them on rank 0 alone
        state = {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
    return state


def checkpoint_dir(folder: str | Path, index: int = 0) -> Path:
    """Where ``save_state`` puts the ``index``-th sharded model (in order of ``prepare``)."""
    return Path(folder) / (CHECKPOINT_DIR if index == 0 else f"{CHECKPOINT_DIR}_{index}")


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


@contextlib.contextmanager
def _without_gradient_sync(root: nn.Module) -> Iterator[None]:
    """Backwards in the block keep local unsharded gradients to accumulate, as DDP's no_sync."""
    if isinstance(root, FullyShardedModule):
        with root.no_sync():
            yield
        return
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _hidden_from_accelerate(
    accelerator: Accelerator, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> Iterator[None]:
    """Accelerate's save_state/load_state without these models and optimizers: its own path
    would write rank 0's shards alone and load them on every rank. See ACCELERATE_PRIVATE_API."""
    kept_models, kept_optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in kept_models if not any(m is x for x in models)]
    accelerator._optimizers = [o for o in kept_optimizers if not any(o is x for x in optimizers)]
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = kept_models, kept_optimizers


def _checked(accelerator: Accelerator) -> None:
    """Refuse what would shard or wrap an fsdp_lite model a second time."""
    theirs = {
        DistributedType.FSDP: "FSDP",
        DistributedType.DEEPSPEED: "DeepSpeed",
        DistributedType.MEGATRON_LM: "Megatron-LM",
    }.get(accelerator.distributed_type)
    if theirs is not None:
        raise ValueError(
            f"FSDPLiteAccelerator: Accelerate's own {theirs} is on (from its config or its "
            f"ACCELERATE_USE_* environment variables); fsdp_lite shards the model itself, so "
            f"turn {theirs} off"
        )


def _setup(accelerator: FSDPLiteAccelerator) -> None:
    _checked(accelerator)
    scaler = accelerator.scaler
    if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, ShardedGradScaler):
        # fp16: each rank sees only its shards' gradients, so the inf/nan verdict that skips a
        # step must be agreed by all ranks, or the replicas drift apart.
        accelerator.scaler = ShardedGradScaler(
            accelerator.device.type,
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )
    accelerator._lite_models = []  # (as prepared, its sharded root), in order of prepare
    accelerator._lite_optimizers = []  # every optimizer prepared, in order


class FSDPLiteAccelerator(Accelerator):
    """``accelerate.Accelerator`` for models that fsdp_lite sharded; Accelerate's own behaviour
    for every other model. Takes Accelerator's arguments.

    Raises:
        ValueError: an ``fsdp_plugin``, or Accelerate's FSDP, DeepSpeed or Megatron-LM turned on
            by its config: fsdp_lite shards the model itself.
    """

    _lite_models: list[tuple[nn.Module, nn.Module]]
    _lite_optimizers: list[torch.optim.Optimizer]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("fsdp_plugin") is not None:
            raise ValueError(
                "FSDPLiteAccelerator takes no fsdp_plugin: shard the model with fsdp_lite "
                "(fully_shard or FullyShardedDataParallel) before prepare()"
            )
        super().__init__(*args, **kwargs)
        _setup(self)

    # ---- preparing ----------------------------------------------------------------------------

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """A model fsdp_lite sharded gets autocast and compilation only (no device move, no DDP:
        fsdp_lite places the shards and reduces the gradients); any other model as Accelerate
        prepares it."""
        root = sharded_root(model)
        if root is None:
            return super().prepare_model(model, device_placement, evaluation_mode)
        prepared = super().prepare_model(model, device_placement=False, evaluation_mode=True)
        if not any(r is root for _, r in self._lite_models):
            self._lite_models.append((model, root))
        return prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> torch.optim.Optimizer:
        prepared = super().prepare_optimizer(optimizer, device_placement)
        if not any(o is prepared for o in self._lite_optimizers):
            self._lite_optimizers.append(prepared)
        return prepared

    def free_memory(self, *objects: Any) -> Any:
        self._lite_models, self._lite_optimizers = [], []
        return super().free_memory(*objects)

    # ---- training -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Backwards in the block accumulate local gradients; the first backward after it syncs
        them (fsdp_lite's ``no_sync`` / ``set_requires_gradient_sync(False)``)."""
        root = sharded_root(model)
        if root is None:
            with super().no_sync(model):
                yield
            return
        with _without_gradient_sync(root):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type=2):
        """As Accelerate clips torch FSDP's models: a FullyShardedDataParallel model's own
        ``clip_grad_norm_`` when ``parameters`` are all of its parameters, else the DTensor-aware
        norm over the ranks."""
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for _, root in self._lite_models:
            if isinstance(root, FullyShardedModule) and ids == {id(p) for p in root.parameters()}:
                self.unscale_gradients()
                return root.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """Also takes off a FullyShardedDataParallel wrapper (Accelerate takes off torch's); its
        parameters stay sharded, so save with ``get_state_dict``'s full tensors."""
        model = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        return model.module if isinstance(model, FullyShardedModule) else model

    # ---- state --------------------------------------------------------------------------------

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """For a model fsdp_lite sharded: full plain tensors on CPU on the main process, ``{}`` on
        the others (what Accelerate gives for torch FSDP); every rank must call it."""
        if sharded_root(model) is None:
            return super().get_state_dict(model, unwrap)
        return full_state_dict(model)

    def _lite_checkpointed(self) -> list[tuple[nn.Module, nn.Module, list[Any]]]:
        """(as prepared, root, its prepared optimizers) for each sharded model; checked before
        any collective, alike on every rank."""
        found = []
        for model, root in self._lite_models:
            params = {id(p) for p in root.parameters()}
            mine = []
            for optimizer in self._lite_optimizers:
                held = {id(p) for g in _inner(optimizer).param_groups for p in g["params"]}
                if held and held <= params:
                    mine.append(optimizer)
                elif held & params:
                    raise ValueError(
                        f"an optimizer holds parameters of the sharded {type(root).__name__} and "
                        "of other models: save_state checkpoints each sharded model with its own "
                        "optimizers; give each model its own optimizer"
                    )
            found.append((model, root, mine))
        return found

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Any:
        """Accelerate's ``save_state``; each model fsdp_lite sharded and its optimizers are an
        fsdp_lite checkpoint in ``checkpoint_dir(folder, index)``. Every rank must call it."""
        entries = self._lite_checkpointed()
        if not entries:
            return super().save_state(output_dir, safe_serialization, **kwargs)

        def save_shards(models: list, weights: list, folder: str) -> None:
            for index, (_, root, optimizers) in enumerate(entries):
                inner = [_inner(o) for o in optimizers]
                checkpoint.save(root, inner, checkpoint_dir(folder, index))

        handle = self.register_save_state_pre_hook(save_shards)  # it gets the final folder
        models = [m for m, _, _ in entries]
        optimizers = [o for _, _, opts in entries for o in opts]
        try:
            with _hidden_from_accelerate(self, models, optimizers):
                return super().save_state(output_dir, safe_serialization, **kwargs)
        finally:
            handle.remove()

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """Accelerate's ``load_state``; models fsdp_lite sharded and their optimizers from their
        fsdp_lite checkpoints, each rank its own shards. Every rank must call it."""
        entries = self._lite_checkpointed()
        if not entries:
            return super().load_state(input_dir, load_kwargs, **kwargs)

        def load_shards(models: list, folder: str) -> None:
            for index, (_, root, optimizers) in enumerate(entries):
                inner = [_inner(o) for o in optimizers]
                checkpoint.load(root, inner, checkpoint_dir(folder, index))

        handle = self.register_load_state_pre_hook(load_shards)  # it gets the final folder
        models = [m for m, _, _ in entries]
        optimizers = [o for _, _, opts in entries for o in opts]
        try:
            with _hidden_from_accelerate(self, models, optimizers):
                return super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            handle.remove()


def as_fsdp_lite_accelerator(accelerator: Accelerator) -> FSDPLiteAccelerator:
    """``accelerator`` (built by code that names ``Accelerator`` itself, as Trainer does), made an
    ``FSDPLiteAccelerator`` in place, before anything was prepared with it.

    Raises:
        TypeError: an Accelerator subclass (its overrides would be lost).
        ValueError: Accelerate's FSDP, DeepSpeed or Megatron-LM is on.
    """
    if isinstance(accelerator, FSDPLiteAccelerator):
        return accelerator
    if type(accelerator) is not Accelerator:
        raise TypeError(
            f"as_fsdp_lite_accelerator takes an accelerate.Accelerator, got "
            f"{type(accelerator).__module__}.{type(accelerator).__qualname__}"
        )
    _checked(accelerator)
    # The class adds methods only; _setup gives the instance the state its __init__ would.
    accelerator.__class__ = FSDPLiteAccelerator
    _setup(accelerator)
    return accelerator
