"""Lightning's Trainer on fsdp_lite's FSDP1 front: ``FSDPLiteStrategy``, ``strategy="fsdp_lite"``.

``FSDPLiteStrategy`` is Lightning's ``FSDPStrategy`` (same arguments, same checkpoint layout) with
fsdp_lite's ``FullyShardedDataParallel`` in place of torch's: every call Lightning makes through
torch's FSDP1 (wrapping, ``enable_wrap``, state dict types, optimizer state, checkpoints, norm
clipping, mixed precision) is made here through fsdp_lite's, on any device, CPU included.
Importing this module names it "fsdp_lite" (and "fsdp_lite_cpu_offload") in Lightning's
``StrategyRegistry``. The FSDP2 route needs nothing from here: Lightning's own
``ModelParallelStrategy`` with ``fsdp_lite.fully_shard`` in ``configure_model`` (docs/integrations.md).
Checked with pytorch-lightning 2.6.6 (tests/test_lightning.py).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.plugins.precision import FSDPPrecision, Precision
from pytorch_lightning.strategies import FSDPStrategy, ParallelStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer
from torchmetrics import Metric  # a dependency of pytorch_lightning

from fsdp_lite import wrap
from fsdp_lite.api import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
    as_ours,
)
from fsdp_lite.fronts.construct import ARGUMENTS
from fsdp_lite.fronts.fsdp1 import FullyShardedDataParallel as FSDP
from fsdp_lite.fronts.interop import TorchFSDPModule
from fsdp_lite.optim.grad_scaler import ShardedGradScaler
from fsdp_lite.state.checkpoint import _init_optim_state

__all__ = ["FSDPLitePrecision", "FSDPLiteStrategy", "register"]

# Note [What this takes from Lightning 2.6.6]: beyond its public API, this module relies on
#   1. FSDPStrategy.setup wrapping the model by calling self._setup_model (a private hook,
#      overridden here);
#   2. the Trainer's accelerator connector refusing a CPU only to FSDPStrategy itself
#      (``type(strategy) is``) and to the names in FSDPStrategy.get_registered_strategies(), and
#      giving any other FSDPStrategy a plain FSDPPrecision of the precision asked for;
#   3. the file name below (lightning_fabric.utilities.load._METADATA_FILENAME).
# pyproject.toml pins pytorch-lightning==2.6.6; tests/test_lightning.py checks each of these.
#
# Lightning's name for the file of a sharded checkpoint that holds everything but the model and
# optimizer tensors: its consolidation tool and FSDPStrategy look for it.
METADATA_FILENAME = "meta.pt"
NAMES = ("fsdp_lite", "fsdp_lite_cpu_offload")

_PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")
_LOW = {"16": torch.float16, "bf16": torch.bfloat16}
# The constructor arguments the strategy passes itself; the rest of ARGUMENTS go through **kwargs.
_SET_BY_STRATEGY = {"cpu_offload", "mixed_precision", "sharding_strategy", "device_id"}


class FSDPLitePrecision(FSDPPrecision):
    """Lightning's ``FSDPPrecision`` for ``FSDPLiteStrategy``.

    The same precisions and dtypes; autocast on the strategy's device (Lightning's is CUDA only),
    fsdp_lite's ``MixedPrecision`` and ``ShardedGradScaler`` (16-mixed), and norm clipping by the
    root wrapper's ``clip_grad_norm_`` (Lightning's raises).

    Args:
        precision: "32-true", "16-true", "bf16-true", "16-mixed" or "bf16-mixed".
        scaler: for 16-mixed, a ``fsdp_lite.sharded_grad_scaler.ShardedGradScaler``; default: one
            made on the strategy's device when training starts.
    """

    def __init__(self, precision: str, scaler: ShardedGradScaler | None = None) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} uses no scaler, got {scaler!r}")
        # FSDPPrecision.__init__ would make torch's ShardedGradScaler (on CUDA) for 16-mixed; it
        # sets the same input dtype (float32) for 32-true, so 16-mixed is made as that.
        super().__init__("32-true" if precision == "16-mixed" else precision)
        self.precision = precision
        self.scaler = scaler
        self._root: FSDP | None = None
        self._device_type = "cuda"  # until attached: what FSDPPrecision autocasts on

    def _attach(self, root: FSDP | None, device_type: str) -> None:
        """The strategy's root wrapper (None: it wrapped no root) and device; makes the scaler."""
        self._root = root
        self._device_type = device_type
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = ShardedGradScaler(device=device_type)

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The dtypes of Lightning's FSDPPrecision, as fsdp_lite's config (None for 32-true)."""
        low = self.precision.split("-")[0]
        if low not in _LOW:
            return None
        dtype = _LOW[low]
        return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)

    def forward_context(self):
        if "mixed" in self.precision:
            return torch.autocast(self._device_type, dtype=_LOW[self.precision.split("-")[0]])
        return super().forward_context()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """The root wrapper's ``clip_grad_norm_``: one norm over all the model's gradients, every
        rank's shards (whichever optimizer steps them, as torch's FSDP1)."""
        if self._root is None:
            raise MisconfigurationException(
                "gradient_clip_algorithm='norm' needs FSDPLiteStrategy to wrap the LightningModule "
                "itself; it was already wrapped in parts (configure_model), so there is no root "
                "wrapper whose clip_grad_norm_ sees every parameter"
            )
        self._root.clip_grad_norm_(clip_val)


class FSDPLiteStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with fsdp_lite's ``FullyShardedDataParallel``, on any device.

    Arguments are ``FSDPStrategy``'s (torch's enums and configs or fsdp_lite's, or strings); its
    checkpoints have the same layout (``state_dict_type="full"``: one file; ``"sharded"``: a DCP
    directory with ``meta.pt``, which Lightning's consolidate_checkpoint tool turns into a full one).

    Args:
        cpu_offload: a bool or a ``CPUOffload`` (fsdp_lite's ``offload_dir`` included).
        mixed_precision: overrides the dtypes the precision plugin sets.
        auto_wrap_policy: a set of module classes, or a policy as ``FullyShardedDataParallel`` takes.
        activation_checkpointing_policy: a set of module classes, or an auto-wrap policy, choosing
            the submodules wrapped in torch's (non-reentrant) ``checkpoint_wrapper`` after sharding.
        sharding_strategy: "FULL_SHARD" (default), "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"...
        state_dict_type: "full" (default) or "sharded".
        device_mesh: a ``DeviceMesh``, or a (replicate, shard) shape for HYBRID_SHARD.
        **kwargs: other ``FullyShardedDataParallel`` arguments (``forward_prefetch``, ...).

    Raises:
        ValueError, TypeError: a bad argument, when the strategy is made.
    """

    strategy_name = "fsdp_lite"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | None = None,
        mixed_precision: MixedPrecision | None = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        device_mesh: tuple[int, int] | Any = None,
        **kwargs: Any,
    ) -> None:
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}"
            )
        bad = sorted(set(kwargs) - (set(ARGUMENTS) - _SET_BY_STRATEGY))
        if bad:
            raise TypeError(
                f"FSDPLiteStrategy got {bad}: **kwargs take FullyShardedDataParallel's "
                f"{sorted(set(ARGUMENTS) - _SET_BY_STRATEGY - {'auto_wrap_policy', 'device_mesh'})}"
            )
        if activation_checkpointing is not None and activation_checkpointing_policy is not None:
            raise ValueError(
                "pass activation_checkpointing_policy, not also the deprecated "
                "activation_checkpointing"
            )
        if activation_checkpointing is not None:
            activation_checkpointing_policy = set(
                activation_checkpointing
                if isinstance(activation_checkpointing, list)
                else [activation_checkpointing]
            )
        # Lightning would turn a set of classes, a string and a bool into torch's policy, enum and
        # config: fsdp_lite's are made here, and Lightning keeps what it is given.
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            mixed_precision=mixed_precision,
            auto_wrap_policy=_policy(auto_wrap_policy),
            sharding_strategy=_sharding_strategy(sharding_strategy),
            state_dict_type=state_dict_type,
            device_mesh=device_mesh,
            **kwargs,
        )
        self.cpu_offload = _cpu_offload(cpu_offload)
        # fsdp_lite's parameters are always the original ones, whatever use_orig_params says;
        # FSDPStrategy reads it to decide whether to look for torch's flat parameters.
        self.kwargs["use_orig_params"] = True
        self.state_dict_kind = state_dict_type
        self.checkpointing_policy = _policy(activation_checkpointing_policy)
        self._root: FSDP | None = None  # the wrapper _setup_model made

    # ---- precision -----------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> FSDPLitePrecision:
        plugin = super().precision_plugin
        # Nothing set yet (before the Trainer sets one): FSDPStrategy's default, made as ours.
        return plugin if isinstance(plugin, FSDPLitePrecision) else FSDPLitePrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer gives every FSDPStrategy a plain FSDPPrecision of the precision asked for.
        if type(plugin) is FSDPPrecision:
            plugin = FSDPLitePrecision(plugin.precision)
        if plugin is not None and not isinstance(plugin, FSDPLitePrecision):
            raise TypeError(f"FSDPLiteStrategy takes an FSDPLitePrecision plugin, got {plugin!r}")
        FSDPStrategy.precision_plugin.fset(self, plugin)

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        return self.mixed_precision or self.precision_plugin.mixed_precision_config

    # ---- setup ---------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        # FSDPStrategy builds a (replicate, shard) shape into a CUDA mesh: here, on our device.
        shape = self.kwargs.get("device_mesh")
        if isinstance(shape, tuple):
            if len(shape) != 2 or shape[0] * shape[1] != self.world_size:
                raise ValueError(
                    f"device_mesh={shape}: a (replicate, shard) shape whose product is the "
                    f"world size {self.world_size}"
                )
            del self.kwargs["device_mesh"]
        super().setup_environment()
        if isinstance(shape, tuple):
            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, shape)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.precision_plugin._attach(self._root, self.root_device.type)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self._root is not None and self._root.module is model:
            # validate/test/predict after fit: the module is sharded already, in this wrapper.
            return self._root
        _refuse_other_sharding(model)
        if any(isinstance(m, FSDP) for m in model.modules()):
            # Wrapped by hand in configure_model, as FSDPStrategy allows: kept as it is.
            if "auto_wrap_policy" in self.kwargs:
                warnings.warn(
                    "FSDPLiteStrategy: the model is already wrapped; auto_wrap_policy is ignored",
                    stacklevel=2,
                )
                del self.kwargs["auto_wrap_policy"]
        else:
            model = FSDP(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self.kwargs,
            )
            if self.checkpointing_policy is not None:
                _checkpoint_activations(model, self.checkpointing_policy)
            self._root = model
        _move_metrics(model, self.root_device)
        return model

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``fsdp_lite.wrap.wrap(module)`` in ``configure_model`` wraps with these arguments."""
        with wrap.enable_wrap(
            wrapper_cls=FSDP,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        ):
            yield

    # ---- state ---------------------------------------------------------------------------------

    def _fsdp_lite_state_dict(self, full: bool, rank0_only: bool = True):
        if full:
            return FSDP.state_dict_type(
                self.model,
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
                FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
            )
        # The live shards: DCP writes them and fills them in place.
        return FSDP.state_dict_type(
            self.model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=True),
            ShardedOptimStateDictConfig(offload_to_cpu=False, _use_dtensor=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full on rank 0 (``{}`` elsewhere), or this rank's DTensor shards."""
        with self._fsdp_lite_state_dict(full=self.state_dict_kind == "full"):
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Full and keyed by position on rank 0 (``{}`` elsewhere), or by name with DTensors."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        full = self.state_dict_kind == "full"
        with self._fsdp_lite_state_dict(full=full):
            state = FSDP.optim_state_dict(self.model, optimizer)
        if full and self.global_rank == 0:
            # Positions in the optimizer, as a plain optimizer's state_dict() has them.
            state = FSDP.rekey_optim_state_dict(
                state, OptimStateKeyType.PARAM_ID, self.model, optim=optimizer
            )
        return state

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """One file written by rank 0, or a DCP directory plus ``meta.pt``, as FSDPStrategy."""
        if storage_options is not None:
            raise TypeError("FSDPLiteStrategy.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(filepath))
        if self.state_dict_kind == "full":
            if path.is_dir() and not _is_sharded_checkpoint(path):
                raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
            if self.global_rank == 0 and _is_sharded_checkpoint(path):
                shutil.rmtree(path)
            ParallelStrategy.save_checkpoint(self, checkpoint, path)
            return
        if self.global_rank == 0:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        state = {"model": checkpoint.pop("state_dict")}
        for index, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{index}"] = optim_state
        dcp.save(state, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / METADATA_FILENAME)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Load the model and optimizer state here, from either layout (FSDPStrategy's too);
        return the rest of the checkpoint."""
        path = Path(self.broadcast(checkpoint_path))
        strict = self.lightning_module.strict_loading
        optimizers = (
            self.optimizers if self.lightning_module.trainer.state.fn == TrainerFn.FITTING else []
        )
        if _is_sharded_checkpoint(path):
            for optimizer in optimizers:
                _init_optim_state(optimizer)  # DCP fills the state tensors that exist
            with self._fsdp_lite_state_dict(full=False):
                state = {"model": self.model.state_dict()}
                for index, optimizer in enumerate(optimizers):
                    state[f"optimizer_{index}"] = FSDP.optim_state_dict(self.model, optimizer)
                dcp.load(state, checkpoint_id=path)
                self.model.load_state_dict(state["model"], strict=strict)
                for index, optimizer in enumerate(optimizers):
                    loadable = FSDP.optim_state_dict_to_load(
                        self.model, optimizer, state[f"optimizer_{index}"]
                    )
                    optimizer.load_state_dict(loadable)
            return torch.load(path / METADATA_FILENAME, weights_only=weights_only)
        if not path.is_file():
            raise ValueError(
                f"{str(path)!r} is not a checkpoint: neither a file nor a directory with "
                f"{METADATA_FILENAME}"
            )
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        saved = checkpoint.get("optimizer_states")
        if optimizers and saved is not None and len(saved) != len(optimizers):
            raise RuntimeError(
                f"{len(optimizers)} optimizers are configured, but the checkpoint holds "
                f"{len(saved)}: resume with the same optimizers"
            )
        with self._fsdp_lite_state_dict(full=True, rank0_only=False):
            self.model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
            if not optimizers or saved is None:
                return checkpoint
            for optimizer, optim_state in zip(optimizers, saved):
                optim_state = FSDP.rekey_optim_state_dict(
                    optim_state, OptimStateKeyType.PARAM_NAME, self.model, optim=optimizer
                )
                optimizer.load_state_dict(
                    FSDP.optim_state_dict_to_load(self.model, optimizer, optim_state)
                )
        return checkpoint

    # ---- registry ------------------------------------------------------------------------------

    @classmethod
    def get_registered_strategies(cls) -> list[str]:
        # Not FSDPStrategy's list: the Trainer refuses the names in that one without CUDA.
        return list(NAMES)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            NAMES[0],
            cls,
            description="Fully Sharded Data Parallel by fsdp_lite, on any device",
            override=True,
        )
        strategy_registry.register(
            NAMES[1],
            cls,
            description="Fully Sharded Data Parallel by fsdp_lite, parameters offloaded to CPU",
            override=True,
            cpu_offload=True,
        )


def register() -> None:
    """Name ``FSDPLiteStrategy`` "fsdp_lite" and "fsdp_lite_cpu_offload" in Lightning's
    ``StrategyRegistry`` (done on import; again is harmless)."""
    FSDPLiteStrategy.register_strategies(StrategyRegistry)


# ---- argument conversions ------------------------------------------------------------------------


def _sharding_strategy(value: str | Any) -> ShardingStrategy:
    if isinstance(value, str):
        try:
            return ShardingStrategy[value.upper()]
        except KeyError:
            names = [s.name for s in ShardingStrategy]
            raise ValueError(f"sharding_strategy must be one of {names}, got {value!r}") from None
    strategy = as_ours(value, ShardingStrategy, "sharding_strategy")
    if strategy is None:
        raise ValueError("sharding_strategy must be given, got None")
    return strategy


def _cpu_offload(value: bool | Any) -> CPUOffload:
    if value is None or isinstance(value, bool):
        return CPUOffload(offload_params=bool(value))
    return as_ours(value, CPUOffload, "cpu_offload")


def _policy(value: Any) -> Any:
    """A set of module classes as fsdp_lite's ModuleWrapPolicy; any other policy as given."""
    if isinstance(value, set):
        return wrap.ModuleWrapPolicy(value)
    return value


def _checkpoint_activations(model: nn.Module, policy: Any) -> None:
    """torch's non-reentrant checkpoint wrapper around the submodules ``policy`` picks, after
    sharding, as Lightning's FSDPStrategy does (docs/compatibility.md: fsdp_lite supports it)."""
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        auto_wrap_policy=policy,
    )


def _move_metrics(model: nn.Module, device: torch.device) -> None:
    """torchmetrics' metrics hold no parameters, so wrapping does not move them."""
    for metric in (m for m in model.modules() if isinstance(m, Metric)):
        metric.to(device)


def _refuse_other_sharding(model: nn.Module) -> None:
    """A module sharded by torch's FSDP1 or by a fully_shard (torch's or fsdp_lite's)."""
    for name, m in model.named_modules():
        torch_fsdp1 = type(m).__name__ == "FullyShardedDataParallel" and not isinstance(m, FSDP)
        if torch_fsdp1 or isinstance(m, TorchFSDPModule):
            how = "torch's FullyShardedDataParallel" if torch_fsdp1 else "fully_shard"
            raise TypeError(
                f"FSDPLiteStrategy: module {name or 'the LightningModule'!r} is sharded by {how}: "
                "wrap with fsdp_lite.wrap.wrap in configure_model, or use ModelParallelStrategy "
                "for fully_shard"
            )


def _is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


register()
