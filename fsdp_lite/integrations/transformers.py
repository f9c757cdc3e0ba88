"""fsdp_lite under HF Trainer: ``FSDPLiteTrainer``, a ``transformers.Trainer`` that shards the model
with fsdp_lite. A Trainer script changes its import, nothing else::

    from fsdp_lite.integrations.transformers import FSDPLiteTrainer as Trainer

Why the Trainer class is the one change: Trainer decides how a model is prepared, saved and
resumed, and builds its Accelerator itself; no argument, callback or model attribute reaches all
of that, a subclass does. It keeps Accelerate's FSDP plugin out (Accelerate would shard with
torch's FSDP on GPU-type backends and fall back to DDP elsewhere) and makes Trainer's Accelerator
an ``FSDPLiteAccelerator`` (integrations/accelerate.py): no DDP, autocast for ``bf16``/``fp16`` as
Trainer's DDP runs have it (fp16's loss scaler agreed across ranks), fsdp_lite's ``no_sync`` for
gradient accumulation, and its clipping.

The model: one that fsdp_lite sharded already is used as it is; any other is sharded at the end of
``__init__`` (and after ``model_init``), as ``TrainingArguments.fsdp_config`` says, with Trainer's
defaults (``ShardingPlan``): ``version`` 2 (default) shards each layer class with ``fully_shard``
and then the root, version 1 wraps the root in ``FullyShardedDataParallel`` with a transformer
auto-wrap policy; the layer classes are ``transformer_layer_cls_to_wrap``, else the model's
``_no_split_modules``; ``reshard_after_forward``, ``auto_wrap_policy`` (``min_num_params``),
``cpu_offload``, and version 1's ``backward_prefetch``, ``forward_prefetch`` and
``sync_module_states`` are honoured. Mixed precision is Trainer's autocast: the shards, the
optimizer and the gradient reduction stay in the parameters' dtype, as under DDP.

Saving: ``save_model`` gathers the full weights (every rank takes part, a parameter at a time)
and writes them from the main process: a folder ``from_pretrained`` loads. A checkpoint (``save_steps``) holds that too, unless
``fsdp_config["state_dict_type"]`` is ``SHARDED_STATE_DICT``, plus the model and optimizer as an
fsdp_lite checkpoint (DCP, each rank its own shards, atomic) in ``CHECKPOINT_DIR``, and Trainer's
own scheduler, scaler, RNG and trainer state; ``resume_from_checkpoint`` and
``load_best_model_at_end`` read the sharded one (a ``save_only_model`` checkpoint: its full
weights, into the shards).

Refused in ``__init__``, before fsdp_lite's first collective, alike on every rank: ``fsdp_config``
options that are not built here (``xla``, ``activation_checkpointing``: Trainer's own
``activation_checkpointing`` argument works, ``cpu_ram_efficient_loading``), values Trainer
would not take, layer class names the model lacks, ``save_only_model`` with
``SHARDED_STATE_DICT`` (no weights would be saved), ``optimizers=`` built on a model that is
sharded afterwards (they would hold the replaced parameters), and a run that is not distributed.
Resuming from a checkpoint another Trainer wrote with its optimizer is refused too: that file
holds whole parameters' state. docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    can_return_loss,
    find_labels,
)

from fsdp_lite.api import BackwardPrefetch, CPUOffload, ShardingStrategy
from fsdp_lite.engine.runtime import to_rest
from fsdp_lite.engine.unit import unit_owners
from fsdp_lite.fronts.fsdp1 import FullyShardedModule
from fsdp_lite.fronts.fsdp2 import CPUOffloadPolicy, OffloadPolicy, fully_shard
from fsdp_lite.integrations.accelerate import (
    CHECKPOINT_DIR,
    as_fsdp_lite_accelerator,
    full_state_dict,
    sharded_root,
)
from fsdp_lite.names import clean_name
from fsdp_lite.state import checkpoint
from fsdp_lite.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = ["CHECKPOINT_DIR", "FSDPLiteTrainer", "ShardingPlan", "TRANSFORMERS_PRIVATE_API"]

log = logging.getLogger("fsdp_lite")

# transformers' private names this module relies on, checked against transformers==5.25.0
# (pyproject.toml pins it; tests/test_trainer.py fails when one changes): the Trainer methods
# FSDPLiteTrainer overrides or calls, with their signatures, and the model attribute that names
# its layer classes (Accelerate's default for the transformer auto-wrap policy too). Trainer has
# no public hook for how a model is saved, checkpointed or resumed.
TRANSFORMERS_PRIVATE_API = {
    "Trainer._save": "(self, output_dir: str | None = None, state_dict: dict | None = None) -> None",
    "Trainer._save_optimizer_and_scheduler": "(self, output_dir: str) -> None",
    "Trainer._load_from_checkpoint": (
        "(self, resume_from_checkpoint: str, model: torch.nn.modules.module.Module | None = None)"
        " -> None"
    ),
    "Trainer._load_optimizer_and_scheduler": "(self, checkpoint: str | None) -> None",
    "Trainer._load_best_model": "(self) -> None",
    "Trainer._set_signature_columns_if_needed": "(self) -> None",
    "Trainer._signature_columns": None,  # an attribute: None until the method above fills it
    "PreTrainedModel._no_split_modules": None,  # a class attribute: a list of class names
}

_NOT_BUILT = {
    "xla": "fsdp_lite shards on torch devices, not through torch_xla",
    "activation_checkpointing": "not built; TrainingArguments(activation_checkpointing=True) "
    "checkpoints the layers the model's own way",
    "cpu_ram_efficient_loading": "not built: every rank loads the weights (it is a loading-time "
    "option of torch FSDP)",
}

# Trainer's FSDP1 reshard_after_forward names (Accelerate's) -> fsdp_lite's strategies.
_STRATEGIES = {
    "full_shard": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
    "hybrid_shard": ShardingStrategy.HYBRID_SHARD,
    "hybrid_shard_zero2": ShardingStrategy._HYBRID_SHARD_ZERO2,
}
_PREFETCH = {
    "BACKWARD_PRE": BackwardPrefetch.BACKWARD_PRE,
    "BACKWARD_POST": BackwardPrefetch.BACKWARD_POST,
    "NO_PREFETCH": None,
}
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How ``FSDPLiteTrainer`` shards a model, read from ``TrainingArguments.fsdp_config`` (keys as
    Trainer documents them, Trainer's defaults); ``fsdp`` unset gives the defaults."""

    version: int = 2
    reshard_after_forward: bool = True  # version 1: the strategy below
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    layer_classes: tuple[str, ...] | None = None  # None: the model's _no_split_modules
    min_num_params: int = 0
    cpu_offload: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    backward_prefetch: BackwardPrefetch | None = None
    forward_prefetch: bool = False
    sync_module_states: bool = True

    @classmethod
    def from_args(cls, args: TrainingArguments) -> ShardingPlan:
        """The plan ``args`` asks for.

        Raises:
            ValueError: an option that is not built here, or a value Trainer would not take.
        """
        config = dict(args.fsdp_config or {}) if args.fsdp else {}
        for key, why in _NOT_BUILT.items():
            if config.get(key) and str(config[key]).lower() not in ("false", "0", "no"):
                raise ValueError(f"FSDPLiteTrainer: fsdp_config[{key!r}] is refused: {why}")
        plugin = args.fsdp_plugin_args or {}
        version = int(plugin.get("fsdp_version", config.get("version", 2)))
        if version not in (1, 2):
            raise ValueError(
                f"FSDPLiteTrainer: fsdp_config['version'] must be 1 or 2, got {version}"
            )
        plan: dict[str, Any] = {"version": version}
        raf = plugin.get("reshard_after_forward", True if version == 2 else "full_shard")
        if version == 2:
            plan["reshard_after_forward"] = bool(raf)
        else:
            name = str(raf).lower()
            if name not in _STRATEGIES:
                raise ValueError(
                    f"FSDPLiteTrainer: fsdp_config['reshard_after_forward'] {raf!r} is not one "
                    f"of {sorted(_STRATEGIES)}"
                )
            plan["strategy"] = _STRATEGIES[name]
            prefetch = str(plugin.get("backward_prefetch", "NO_PREFETCH")).upper()
            if prefetch not in _PREFETCH:
                raise ValueError(
                    f"FSDPLiteTrainer: fsdp_config['backward_prefetch'] {prefetch!r} is not one "
                    f"of {sorted(_PREFETCH)}"
                )
            plan["backward_prefetch"] = _PREFETCH[prefetch]
            plan["forward_prefetch"] = bool(plugin.get("forward_prefetch", False))
            plan["sync_module_states"] = bool(plugin.get("sync_module_states", True))
        policy = str(plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"))
        if policy not in _WRAP_POLICIES:
            raise ValueError(
                f"FSDPLiteTrainer: fsdp_config['auto_wrap_policy'] {policy!r} is not one of "
                f"{list(_WRAP_POLICIES)}"
            )
        plan["auto_wrap_policy"] = policy
        plan["min_num_params"] = int(plugin.get("min_num_params", 0))
        names = plugin.get("transformer_cls_names_to_wrap")
        if names:
            plan["layer_classes"] = tuple(n.strip() for n in names.split(",") if n.strip())
        plan["cpu_offload"] = bool(plugin.get("cpu_offload", False))
        state_dict_type = str(plugin.get("state_dict_type", "FULL_STATE_DICT"))
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ValueError(
                f"FSDPLiteTrainer: fsdp_config['state_dict_type'] {state_dict_type!r} is not one "
                f"of {list(_STATE_DICT_TYPES)}"
            )
        if state_dict_type == "SHARDED_STATE_DICT" and args.save_only_model:
            raise ValueError(  # Trainer's own FSDP refuses it too
                "FSDPLiteTrainer: save_only_model=True with SHARDED_STATE_DICT would checkpoint "
                "no weights at all"
            )
        plan["state_dict_type"] = state_dict_type
        return cls(**plan)

    def shard(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``model`` sharded by this plan: itself for version 2 (sharded in place), its
        ``FullyShardedDataParallel`` wrapper for version 1. Collectives: every rank calls it."""
        classes = self._layer_classes(model)
        if self.version == 2:
            offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
            for module in self._fsdp2_units(model, classes):
                fully_shard(
                    module, reshard_after_forward=self.reshard_after_forward, offload_policy=offload
                )
            # None: the root keeps its parameters from forward to backward, as torch's default.
            root_raf = None if self.reshard_after_forward else False
            return fully_shard(model, reshard_after_forward=root_raf, offload_policy=offload)
        if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and classes:
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        elif self.auto_wrap_policy == "SIZE_BASED_WRAP" and self.min_num_params > 0:
            policy = functools.partial(
                size_based_auto_wrap_policy, min_num_params=self.min_num_params
            )
        else:
            policy = None
        return FullyShardedModule(
            model,
            sharding_strategy=self.strategy,
            cpu_offload=CPUOffload(offload_params=True) if self.cpu_offload else None,
            auto_wrap_policy=policy,
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
            sync_module_states=self.sync_module_states,
            use_orig_params=True,
            device_id=None if device.type == "cpu" else device,
        )

    def _layer_classes(self, model: nn.Module) -> set[type]:
        if self.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
            return set()
        present = {type(m).__name__: type(m) for m in model.modules()}
        if self.layer_classes is not None:
            missing = [n for n in self.layer_classes if n not in present]
            if missing:
                raise ValueError(
                    f"FSDPLiteTrainer: fsdp_config['transformer_layer_cls_to_wrap'] names "
                    f"{missing}, which {type(model).__name__} does not have"
                )
            return {present[n] for n in self.layer_classes}
        # TRANSFORMERS_PRIVATE_API: the layers the model never splits across devices.
        names = getattr(model, "_no_split_modules", None) or []
        classes = {present[n] for n in names if n in present}
        if not classes:
            log.warning(
                "FSDPLiteTrainer: %s names no layer classes (set fsdp_config"
                "['transformer_layer_cls_to_wrap']): the whole model is one unit",
                type(model).__name__,
            )
        return classes

    def _fsdp2_units(self, model: nn.Module, classes: set[type]) -> Iterator[nn.Module]:
        """The submodules that get their own ``fully_shard``, children before parents."""
        if self.auto_wrap_policy == "NO_WRAP":
            return
        taken: set[int] = set()  # parameters in a unit already
        for module in _post_order(model):
            if module is model or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                continue
            if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
                chosen = isinstance(module, tuple(classes))
            else:
                numel = sum(p.numel() for p in module.parameters() if id(p) not in taken)
                chosen = self.min_num_params > 0 and numel >= self.min_num_params
            if chosen:
                taken |= {id(p) for p in module.parameters()}
                yield module


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights save_pretrained wrote in ``folder`` (one safetensors file, or an index of
    them), on CPU."""
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / SAFE_WEIGHTS_NAME).is_file():
        names = [SAFE_WEIGHTS_NAME]
    else:
        raise ValueError(
            f"{folder} holds neither an fsdp_lite checkpoint ({CHECKPOINT_DIR}) nor safetensors "
            "weights: FSDPLiteTrainer resumes from the checkpoints it writes"
        )
    state: dict[str, torch.Tensor] = {}
    for name in names:
        state.update(safetensors.torch.load_file(str(folder / name)))
    return state


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return [] if optimizer is None else [optimizer]


class FSDPLiteTrainer(Trainer):
    """``transformers.Trainer`` on fsdp_lite: takes Trainer's arguments; shards the model as
    ``args.fsdp_config`` says (``ShardingPlan``) unless fsdp_lite sharded it already.

    Raises:
        ValueError: an ``fsdp_config`` option that is not built, ``optimizers=`` with a model
            that is not sharded yet, or a run without torch.distributed (launch with torchrun).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *rest: Any,
        **kwargs: Any,
    ) -> None:
        self._lite_plan = ShardingPlan.from_args(args) if args is not None else ShardingPlan()
        self._lite_ready = False  # call_model_init shards only once __init__ is done
        super().__init__(model, args, *rest, **kwargs)
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "FSDPLiteTrainer shards over torch.distributed ranks, and this run has no process "
                "group: launch it with torchrun (or accelerate launch)"
            )
        if self.optimizer is not None and sharded_root(self.model) is None:
            raise ValueError(
                "FSDPLiteTrainer: optimizers= holds the parameters of a model that fsdp_lite has "
                "not sharded yet; sharding replaces them. Shard the model before building the "
                "optimizer, or pass optimizer_cls_and_kwargs=, or no optimizer"
            )
        self._lite_adopt(self.model)
        self._lite_ready = True

    # ---- the model ----------------------------------------------------------------------------

    def _lite_adopt(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` (unless fsdp_lite did) and make it Trainer's model."""
        root = sharded_root(model)
        if root is not None:
            if self.args.fsdp:
                log.info("FSDPLiteTrainer: the model is sharded already; fsdp_config is not used")
            if isinstance(root, FullyShardedModule):
                self._lite_inspect(root.module)
            return model
        self._lite_inspect(model)
        sharded = self._lite_plan.shard(model, self.args.device)
        log.info(
            "FSDPLiteTrainer: %s sharded by fsdp_lite, %d units (%s)",
            type(model).__name__,
            len(unit_owners(sharded)),
            "fully_shard" if self._lite_plan.version == 2 else "FullyShardedDataParallel",
        )
        self.model = self.model_wrapped = sharded
        self.callback_handler.model = sharded
        return sharded

    def _lite_inspect(self, inner: nn.Module) -> None:
        """What Trainer reads off the model's class and forward signature, read off the module
        a FullyShardedDataParallel wrapper holds: the wrapper's forward takes (*args, **kwargs),
        so Trainer would find no labels and drop every dataset column."""
        if self.args.label_names is None:
            self.label_names = find_labels(type(inner))
        self.can_return_loss = can_return_loss(type(inner))
        if self.args.remove_unused_columns and self._signature_columns is None:
            outer, self.model = self.model, inner
            try:
                self._set_signature_columns_if_needed()  # computed once, kept by Trainer
            finally:
                self.model = outer

    def call_model_init(self, trial: Any = None) -> nn.Module:
        model = super().call_model_init(trial)
        return self._lite_adopt(model) if self._lite_ready else model

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's Accelerator without Accelerate's FSDP plugin, as an FSDPLiteAccelerator."""
        plugin_args = self.args.fsdp_plugin_args
        self.args.fsdp_plugin_args = None  # fsdp_lite shards: Accelerate must not
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.fsdp_plugin_args = plugin_args
        as_fsdp_lite_accelerator(self.accelerator)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        # A forward with grad and no backward leaves the root holding its unsharded parameters
        # (engine/runtime.py, to_rest); the optimizer must get the shards.
        for owner in unit_owners(self.model if model is None else model):
            to_rest(owner)
        return super().create_optimizer(model)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        # Trainer names parameters by walking children, through FullyShardedDataParallel's
        # _fsdp_wrapped_module; named_parameters() leaves that out.
        return [clean_name(name) for name in super().get_decay_parameter_names(model)]

    # ---- saving -------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Full weights, gathered a parameter at a time and written by the main process: every
        rank must call it."""
        if _internal_call and self._lite_plan.state_dict_type == "SHARDED_STATE_DICT":
            return  # checkpoints keep the weights sharded only, as Trainer's FSDP does
        super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and sharded_root(self.model) is not None:
            # A collective: every rank gathers, the writers keep the tensors.
            state_dict = full_state_dict(self.model, rank0_only=not self.args.save_on_each_node)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(self.model, _optimizers(self.optimizer), Path(output_dir) / CHECKPOINT_DIR)
        if self.args.should_save:  # the scheduler as Trainer saves it, but never half-written
            path = os.path.join(output_dir, SCHEDULER_NAME)
            with warnings.catch_warnings():
                # torch asks to save the optimizer with the scheduler: it is, in CHECKPOINT_DIR
                warnings.simplefilter("ignore", UserWarning)
                torch.save(self.lr_scheduler.state_dict(), path + ".tmp")
            os.replace(path + ".tmp", path)

    # ---- resuming -----------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None):
        model = self.model if model is None else model
        path = Path(resume_from_checkpoint) / CHECKPOINT_DIR
        if path.is_dir():
            checkpoint.load(model, None, path)
        else:  # a save_only_model checkpoint: its full weights, each rank keeping its shards
            state = _full_weights(Path(resume_from_checkpoint))
            options = StateDictOptions(full_state_dict=True, strict=False)  # strict: as Trainer
            set_model_state_dict(sharded_root(model), state, options=options)

    def _load_optimizer_and_scheduler(self, checkpoint_folder: str | None) -> None:
        if checkpoint_folder is None:
            return
        path = Path(checkpoint_folder) / CHECKPOINT_DIR
        if not path.is_dir():
            if any(
                (Path(checkpoint_folder) / n).exists() for n in (OPTIMIZER_NAME, OPTIMIZER_NAME_BIN)
            ):
                raise ValueError(
                    f"{checkpoint_folder} was written by another Trainer: its optimizer file "
                    "holds one rank's whole-parameter state, which does not load into "
                    "fsdp_lite's shards; resume from a checkpoint FSDPLiteTrainer wrote"
                )
            return super()._load_optimizer_and_scheduler(checkpoint_folder)  # none saved
        checkpoint.load(self.model, _optimizers(self.optimizer), path)
        scheduler = os.path.join(checkpoint_folder, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        path = Path(self.state.best_model_checkpoint) / CHECKPOINT_DIR
        if not path.is_dir():
            return super()._load_best_model()
        log.info("loading the best model from %s", path)
        checkpoint.load(self.model, None, path)
