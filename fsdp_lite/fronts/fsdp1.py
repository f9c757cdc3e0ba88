"""The public wrapper, ``FullyShardedModule`` (alias ``FullyShardedDataParallel``).

It takes torch FSDP1's constructor arguments, has construct.py check them and turn them into one
``UnitConfig``, wraps submodules chosen by the auto-wrap policy, and has construct.py build this
wrapper's ``ShardedUnit``. At run time its ``forward`` hands each stage to runtime.py. The everyday methods users call on an FSDP model
(``no_sync``, ``clip_grad_norm_``, ``summon_full_params``, ``state_dict`` ...) live here too.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_lite import wrap
from fsdp_lite.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from fsdp_lite.engine.mixed_precision import (
    cast_floating,
    keep_in_full_precision,
)
from fsdp_lite.engine.runtime import (
    StepRuntime,
    lazy_init,
    prepare_apply,
    register_grad_hooks,
    take_back_after_apply,
    to_rest,
)
from fsdp_lite.engine.unit import ShardedUnit, TrainingState
from fsdp_lite.fronts.construct import (
    UnitConfig,
    _broadcast_module_states,
    _build_unit,
    _check_same_model_across_ranks,
    _has_meta,
    _make_config,
    _move_to_device,
    _nested_config,
    _resolve_configs,
    check_tensor_parallel_params,
    check_unit_params,
    on_every_rank,
    open_disk_store,
)
from fsdp_lite.names import WRAPPED, WRAPPED_PREFIX, clean_name

__all__ = ["FullyShardedDataParallel", "FullyShardedModule", "UnitConfig"]


class FullyShardedModule(nn.Module):
    """A module whose parameters are sharded across ranks (torch FSDP1's API).

    Args:
        module: the module to wrap; its parameters are replaced by 1/N shards.
        process_group: the ranks to shard over (default: the default process group); an
            object with ``rank()`` and ``size()`` only builds a wrapper that cannot run
            (construct.py Note [Stand-in process groups]).
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP or NO_SHARD.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps sharded params, their grads and
            the optimizer step in CPU memory; with ``offload_dir`` set (not with NO_SHARD), in
            memory-mapped files under that directory (docs/disk_offload.md).
        auto_wrap_policy: chooses submodules that become units of their own (see fsdp_lite.wrap).
        backward_prefetch: when to start the next unit's all-gather in backward (default BACKWARD_PRE).
        mixed_precision: dtypes for the unsharded params, gradient reduction and buffers
            (torch FSDP1 semantics).
        ignored_modules: submodules whose parameters are left alone (not sharded, not reduced).
        param_init_fn: for a module on the meta device: called, one unit at a time, on each
            submodule that holds meta tensors while it does, as torch FSDP1 calls it (it may
            allocate them, with ``to_empty``); one it leaves on meta is allocated and passed
            again (default: their ``reset_parameters()``).
        device_id: the compute device; the module is moved there first.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: start the next unit's all-gather at the start of this unit's forward.
            Default None: on. On CPU, waiting for a collective blocks the host, and the prefetch
            hides it. On an accelerator, a gather queued on the compute stream waits for every
            kernel queued before it, so only a prefetch, queued on the all-gather stream before
            this unit's kernels (streams.py), overlaps this unit's compute. False turns it off,
            as torch FSDP1's default does.
        limit_all_gathers: accepted; at most one prefetched unit is ever in flight here.
        use_orig_params: accepted either way; parameters are always the original ones, sharded.
        ignored_states: parameters or modules to leave alone (like ``ignored_modules``).
        device_mesh: the mesh to shard over, instead of ``process_group``: 1-D, or 2-D
            (replicate, shard) for HYBRID_SHARD.
    """

    _unit: ShardedUnit  # its runtime (unit.runtime) is shared with the root, from the first forward

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable | wrap.Policy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | str | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool | None = None,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        _nesting: _Nesting | None = None,  # set for wrappers made by auto-wrap
    ) -> None:
        super().__init__()
        kwargs = {
            "process_group": process_group,
            "sharding_strategy": sharding_strategy,
            "cpu_offload": cpu_offload,
            "auto_wrap_policy": auto_wrap_policy,
            "backward_prefetch": backward_prefetch,
            "mixed_precision": mixed_precision,
            "ignored_modules": ignored_modules,
            "param_init_fn": param_init_fn,
            "device_id": device_id,
            "sync_module_states": sync_module_states,
            "forward_prefetch": forward_prefetch,
            "limit_all_gathers": limit_all_gathers,
            "use_orig_params": use_orig_params,
            "ignored_states": ignored_states,
            "device_mesh": device_mesh,
        }
        if _nesting is None:
            _config = self._init_root(module, _resolve_configs(kwargs))
        else:
            _config = _nesting.config_for(module, kwargs)
        self._config = _config
        # torch FSDP1's mixed_precision attribute is the argument as given (reduce_dtype None
        # stays None), which the unit's resolved dtypes no longer say.
        self._mixed_precision = _resolve_configs(kwargs)["mixed_precision"] or MixedPrecision()
        self._fsdp_wrapped_module = module
        # Auto-wrapped units are known only now, after the model comparison across ranks.
        check_unit_params(module, _config, "FullyShardedDataParallel")
        if _nesting is None:  # disk offload: a full disk on one rank fails every rank here
            self._unit = on_every_rank(_config, lambda: _build_unit(module, _config))
        else:  # the root's on_every_rank around auto-wrap hears of a nested unit's failure
            self._unit = _build_unit(module, _config)
        register_grad_hooks(self._unit, self._unit.params)
        for p in self._unit.params:
            p.point_modules_to(p.sharded_param)
        self._register_state_dict_hook(_strip_wrapper_prefix)
        self._register_load_state_dict_pre_hook(_add_wrapper_prefix)
        self._state_dict_settings = None  # None: FULL_STATE_DICT defaults; see state_dict.py

    def _init_root(self, module: nn.Module, kwargs: dict[str, Any]) -> UnitConfig:
        """Check the arguments, move and compare the model across ranks, and auto-wrap."""
        config = _make_config(module, kwargs)
        _move_to_device(module, config)
        check_tensor_parallel_params(module, config, "FullyShardedDataParallel")
        if kwargs["auto_wrap_policy"] is None:  # the unit is known: check it before any collective
            check_unit_params(module, config, "FullyShardedDataParallel")
        # Collectives start here; everything above fails locally, before any rank can hang.
        # The first, with disk offload: whether every rank could make its directory.
        config = open_disk_store(config, module)
        _check_same_model_across_ranks(module, config)
        if config.sync_module_states and not _has_meta(list(module.modules())):
            _broadcast_module_states(module, config)  # meta modules: per unit, see _materialize
        policy, mixed_precision = kwargs["auto_wrap_policy"], kwargs["mixed_precision"]
        if policy is None:
            return config
        if mixed_precision is not None:
            kept = {}  # the classes met, in order, for the warning
            for m in module.modules():
                if isinstance(m, tuple(mixed_precision._module_classes_to_ignore)):
                    keep_in_full_precision(m)
                    kept[type(m)] = None
            if kept:  # torch FSDP1's warning, whose words its test_mp_batchnorm matches
                warnings.warn(
                    "Both mixed precision and an auto_wrap_policy were specified to FSDP, "
                    f"where the wrapped module has submodules of type:\n{set(kept)}\n"
                    "These modules will be wrapped as separate FSDP instances with mixed "
                    "precision disabled.",
                    stacklevel=3,
                )
        # Nested wrappers get the root's arguments explicitly, so that a policy's override (e.g.
        # mixed_precision=None for BatchNorm) replaces them; _Nesting tells overrides apart.
        root_kwargs = {**kwargs, "sharding_strategy": config.strategy}
        root_kwargs["_nesting"] = _Nesting(config, root_kwargs, module)
        on_every_rank(
            config,
            lambda: wrap.auto_wrap(
                module,
                policy,
                FullyShardedModule,
                set(config.ignored_modules),
                set(config.ignored_params),
                root_kwargs,
            ),
        )
        return config

    # ---- torch FSDP1's public attributes, which client code reads (this unit's) ---------------

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._config.strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._config.cpu_offload or CPUOffload()

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        """Whether forward prefetches: True by default here, unlike torch's (see ``__init__``)."""
        return self._config.forward_prefetch

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._mixed_precision

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The shard group (HYBRID_SHARD: within a replica), as torch's."""
        return self._config.group

    @property
    def rank(self) -> int:
        return self._unit.rank

    @property
    def world_size(self) -> int:
        return self._unit.world_size

    @property
    def compute_device(self) -> torch.device:
        return self._config.device

    @property
    def params(self) -> list[nn.Parameter]:
        """This unit's parameters as the optimizer sees them (torch: its one FlatParameter)."""
        return [p.sharded_param for p in self._unit.params]

    # ---- running -----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._lazy_init()
        args, kwargs = runtime.pre_forward(self._unit, args, kwargs)
        precision = self._unit.precision
        if precision.cast_forward_inputs or (
            self._unit.is_root and precision.cast_root_forward_inputs
        ):
            args, kwargs = cast_floating(precision.param_dtype, (args, kwargs))
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self._unit, output)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        """``nn.Module._apply`` (``to``, ``cpu``, ``cuda``, ``float``, ``double``, ``half``,
        ``bfloat16``, ``type``, ``to_empty``...) on a wrapped model.

        Shards change dtype in place of the old ones and stay on their device; the optimizer's
        tensors, the all-gather input and state dicts remain one tensor, so training goes on (in
        the new dtype), as in torch FSDP2, which overrides ``_apply`` too.

        Raises:
            RuntimeError: inside forward or backward, or a call that would move shards to another
                device (or to disk offload in another dtype), before anything changes.
        """
        prepare_apply(self, fn)
        result = super()._apply(fn, recurse)  # nested wrappers take theirs back in their _apply
        take_back_after_apply(self._unit, fn)
        return result

    def _lazy_init(self) -> StepRuntime:
        """The first wrapper to run becomes the root: it builds the runtime for all below it."""
        return lazy_init(self)

    def check_is_root(self) -> bool:
        self._lazy_init()
        return self._unit.is_root

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedModule]:
        """Every wrapper in ``module``'s tree (pre-order), or only the outermost ones."""
        if not root_only:
            return [m for m in module.modules() if isinstance(m, FullyShardedModule)]
        roots: list[FullyShardedModule] = []
        for m in module.modules():
            if isinstance(m, FullyShardedModule) and not any(m in r.modules() for r in roots):
                roots.append(m)
        return roots

    # ---- gradients ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate local gradients without communicating; the first backward after syncs them."""
        runtime = self._lazy_init()
        if not self._unit.is_root:
            raise RuntimeError(  # torch FSDP1's words, which its tests match
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module."
            )
        previous = {unit: unit.settings.requires_gradient_sync for unit in runtime.units}
        for unit in runtime.units:
            unit.settings.requires_gradient_sync = False
        try:
            yield
        finally:
            for unit, flag in previous.items():
                unit.settings.requires_gradient_sync = flag

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so that their global ``norm_type`` norm is at most ``max_norm``.

        The norm is over the whole model, not this rank's shards: shard norms are combined with
        one all-reduce, replicated (NO_SHARD, ignored) gradients are counted once.

        Returns:
            The total norm before clipping (a scalar tensor), in the gradients' widest dtype as
            torch's; float32, with torch's warning, on a rank that has no gradients.
        """
        self._lazy_init()
        if not self._unit.is_root:
            raise RuntimeError(  # torch FSDP1's words, which its test_non_root matches
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        norm_type = float(norm_type)
        sharded, replicated = [], []
        sharded_ids = set()
        for w in self.fsdp_modules(self):
            for p in w._unit.params:
                if p.is_sharded and p.sharded_param.grad is not None:
                    sharded.append(p.sharded_param.grad.to_local())
                    sharded_ids.add(id(p.sharded_param))
        for param in self.parameters():
            if param.grad is not None and id(param) not in sharded_ids:
                replicated.append(param.grad)
        device = self._config.device
        local = _partial_norm(sharded, norm_type, device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=self._config.group)
        rest = _partial_norm(replicated, norm_type, device)
        if math.isinf(norm_type):
            total = torch.maximum(local, rest)
        else:
            total = (local + rest) ** (1.0 / norm_type)
        # Same formula as torch.nn.utils.clip_grad_norm_, so a clip lands where torch's would.
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = sharded + replicated
        for g in grads:
            g.mul_(clip_coef.to(g.dtype))
        if not grads:  # torch FSDP1's warning and dtype: no gradient here says no dtype
            warnings.warn(
                f"Called FSDP.clip_grad_norm_() on rank {self._unit.rank} with no gradients -- "
                f"returning the total norm in the default dtype {total.dtype}",
                stacklevel=2,
            )
            return total
        # torch FSDP1 returns the norm in the gradients' widest dtype (fp16 gradients: fp16).
        return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))

    # ---- full parameters ---------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Show full, unsharded parameters in ``module``'s tree inside the block.

        Args:
            recurse: also nested wrappers (default True).
            writeback: copy changes made to the full parameters back into the shards (default True).
            rank0_only: only rank 0 sees full parameters; needs ``writeback=False``.
            offload_to_cpu: the full parameters are CPU copies (a no-op when computing on CPU).
            with_grads: also show full gradients as ``.grad`` (read-only).
        """
        if rank0_only and writeback:
            raise ValueError("summon_full_params: rank0_only=True needs writeback=False")
        wrappers = FullyShardedModule.fsdp_modules(module, root_only=not recurse)
        for w in wrappers:
            w._lazy_init()
            _check_summon_allowed(w._unit)
        with contextlib.ExitStack() as stack:
            for w in wrappers:
                _summon_unit(w._unit, stack, writeback, rank0_only, offload_to_cpu, with_grads)
            yield

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedModule:
        """``nn.Module.apply`` on full parameters, so initializers see whole tensors."""
        _check_apply_allowed(self._unit)
        with FullyShardedModule.summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    # ---- names and state dicts -----------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_name(name), param

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_name(name), buf

    def state_dict(
        self, *, destination: dict | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """This wrapper's state dict, of the type ``state_dict_type`` set (default FULL_STATE_DICT).

        Keys are those of the unwrapped module. FULL: full tensors, gathered one unit at a time
        (``offload_to_cpu``, ``rank0_only``: other ranks get ``{}``). SHARDED: ``sharded_param``
        DTensors, for ``torch.distributed.checkpoint``. LOCAL: this rank's rows, plain tensors.
        See fsdp_lite/state/state_dict.py.
        """
        from fsdp_lite.state import state_dict as impl

        self._lazy_init()  # the outermost wrapper becomes the root, as in forward
        to_rest(self)
        raw = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return impl.after_state_dict(self, raw, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full, sharded (DTensor) or local state dict into the shards.

        A DTensor value is a shard, a plain tensor a full parameter (each rank keeps its rows, no
        communication), except under LOCAL_STATE_DICT (this rank's rows). Reported key names
        are the unwrapped module's. See fsdp_lite/state/state_dict.py.
        """
        from fsdp_lite.state import state_dict as impl

        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported")
        self._lazy_init()
        try:
            result = super().load_state_dict(state_dict, strict)
        except RuntimeError as e:
            raise RuntimeError(clean_name(str(e))) from None
        return impl.clean_load_result(result)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        from fsdp_lite.state import state_dict as impl

        impl.before_load(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict: our keys skip ``_fsdp_wrapped_module``."""
        inner = self._fsdp_wrapped_module
        names = [*inner._modules, *inner._parameters, *inner._buffers]
        return dict.fromkeys(names, WRAPPED)

    # State dict settings and optimizer state: torch FSDP1's static methods, which delegate to
    # fsdp_lite/state/state_dict.py and fsdp_lite/state/optim_state.py (see their docstrings).

    @staticmethod
    def state_dict_type(
        module, state_dict_type, state_dict_config=None, optim_state_dict_config=None
    ):
        """Context manager: ``set_state_dict_type`` for the block, then the previous settings."""
        from fsdp_lite.state import state_dict as impl

        return impl.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def set_state_dict_type(
        module, state_dict_type, state_dict_config=None, optim_state_dict_config=None
    ):
        """Set the state dict type and configs of every wrapper under ``module``; returns the old."""
        from fsdp_lite.state import state_dict as impl

        return impl.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module):
        """The ``StateDictSettings`` of the wrappers under ``module`` (they must agree)."""
        from fsdp_lite.state import state_dict as impl

        return impl.get_state_dict_type(module)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        """``optim``'s state keyed by parameter name, full or sharded as ``state_dict_type`` says."""
        from fsdp_lite.state import optim_state as impl

        return impl.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None
    ):
        """A name-keyed optimizer state dict (any world size) made loadable by ``optim``."""
        from fsdp_lite.state import optim_state as impl

        return impl.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    @staticmethod
    def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
        """Full optimizer state keyed by parameter name (only on rank 0 by default)."""
        from fsdp_lite.state import optim_state as impl

        return impl.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(model, optim, group=None):
        """Optimizer state keyed by parameter name, each tensor this rank's DTensor shard."""
        from fsdp_lite.state import optim_state as impl

        return impl.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
        """This rank's part of a full optimizer state dict that every rank holds."""
        from fsdp_lite.state import optim_state as impl

        return impl.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict, model, optim_input=None, optim=None, group=None
    ):
        """This rank's part of a full optimizer state dict that only rank 0 holds."""
        from fsdp_lite.state import optim_state as impl

        return impl.scatter_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict, optim_state_key_type, model, optim_input=None, optim=None
    ):
        """Re-key an optimizer state dict by parameter name or id (wrapped model or not)."""
        from fsdp_lite.state import optim_state as impl

        return impl.rekey_optim_state_dict(
            optim_state_dict, optim_state_key_type, model, optim_input, optim
        )

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing to the wrapped module (e.g. an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)


FullyShardedDataParallel = FullyShardedModule


def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + WRAPPED_PREFIX
    for key in list(state_dict):
        if key.startswith(inner):
            state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_wrapper_prefix(state_dict, prefix, *args) -> None:
    inner = prefix + WRAPPED_PREFIX
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(inner):
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


# ---- summon_full_params / clip_grad_norm_ helpers ----------------------------------------------


# torch FSDP1's names for a unit's training state, as its ValueError prints them.
_TORCH_STATE_NAMES = {
    TrainingState.FORWARD: "FORWARD_BACKWARD",
    TrainingState.BACKWARD: "FORWARD_BACKWARD",
    TrainingState.SUMMON: "SUMMON_FULL_PARAMS",
}


def _check_summon_allowed(unit: ShardedUnit) -> None:
    """summon_full_params in forward, backward or another summon: torch FSDP1's errors and words
    (``_unshard_params_for_summon``), where the engine's check said it otherwise."""
    if unit.training_state in (TrainingState.FORWARD, TrainingState.BACKWARD):
        raise AssertionError("Cannot manually unshard parameters during forward/backward")
    if unit.training_state is TrainingState.SUMMON:
        raise AssertionError(
            "Cannot manually unshard parameters when already unsharding parameters"
        )
    unit.assert_state(TrainingState.IDLE)


def _check_apply_allowed(unit: ShardedUnit) -> None:
    """``apply`` out of the idle state: torch FSDP1's ``ValueError`` and words (its
    ``_assert_state``; torch's test_fsdp_apply matches "expected to be in states")."""
    if unit.training_state is not TrainingState.IDLE:
        name = _TORCH_STATE_NAMES.get(unit.training_state, unit.training_state.name)
        raise ValueError(
            "expected to be in states [<TrainingState.IDLE: 1>] but current state is "
            f"TrainingState.{name} (unit {unit.name or '<root>'!r})"
        )


def _summon_unit(
    unit: ShardedUnit,
    stack: contextlib.ExitStack,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """Show full-precision, full-shape copies of one unit's params until ``stack`` closes.

    The copies are gathered fresh (not the step's unsharded params, which may be in param_dtype
    or still in use), and every module attribute is put back as it was on exit.
    """
    if not unit.rules.shard_params or not unit.params:
        return  # NO_SHARD: the modules already hold the full parameters themselves
    keep = not rank0_only or unit.rank == 0
    device = torch.device("cpu") if offload_to_cpu else None
    full = unit.gather_full([p.sharded_flat for p in unit.params], "summon", keep, device)
    grads: list[torch.Tensor | None] = [None] * len(unit.params)
    if with_grads and any(p.sharded_param.grad is not None for p in unit.params):
        grad_flats = []
        for p in unit.params:
            flat = p.sharded_flat.new_zeros(p.shard_numel)
            if p.sharded_param.grad is not None:
                flat[: p.local_numel].copy_(p.sharded_param.grad.to_local().reshape(-1))
            grad_flats.append(flat)
        gathered = unit.gather_full(grad_flats, "summon", keep, device)
        grads = [
            g if p.sharded_param.grad is not None else None for g, p in zip(gathered, unit.params)
        ]
    if not keep:
        return
    shown = []
    for p, tensor, grad in zip(unit.params, full, grads):
        param = nn.Parameter(tensor, requires_grad=p.requires_grad)
        param.grad = grad
        shown.append(param)
    previous = [[m._parameters[n] for m, n in p.locations] for p in unit.params]
    for p, param in zip(unit.params, shown):
        p.point_modules_to(param)
    unit.enter(TrainingState.SUMMON)

    def restore() -> None:
        for p, holders in zip(unit.params, previous):
            for (m, n), holder in zip(p.locations, holders):
                m._parameters[n] = holder
        unit.enter(TrainingState.IDLE)

    stack.callback(restore)
    if writeback:  # registered last, so it runs first: before the modules are restored

        def write_shards() -> None:
            with torch.no_grad():
                for p, param in zip(unit.params, shown):
                    p.writeback(param)

        stack.callback(write_shards)


def _partial_norm(
    grads: list[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """sum(|g|^p) over ``grads`` (max |g| for the inf-norm), as a float32 scalar on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(
        [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    )
    if math.isinf(norm_type):
        return norms.max().to(device)
    return (norms**norm_type).sum().to(device)


class _Nesting:
    """What the root hands the wrappers auto-wrap makes: its config and its own arguments."""

    def __init__(self, config: UnitConfig, root_kwargs: dict[str, Any], root: nn.Module) -> None:
        self.config = config
        self.root_kwargs = root_kwargs
        self.names = {m: name for name, m in root.named_modules()}  # for error messages

    def config_for(self, module: nn.Module, kwargs: dict[str, Any]) -> UnitConfig:
        """The nested unit's config from the arguments that differ from the root's."""
        overrides = {
            k: v
            for k, v in kwargs.items()
            if v is not self.root_kwargs[k] and v != self.root_kwargs[k]
        }
        if overrides.get("auto_wrap_policy", False) is None:
            del overrides["auto_wrap_policy"]  # auto-wrap drops the root's policy, as torch does
        name = self.names.get(module, type(module).__name__)
        config = _nested_config(self.config, module, name, overrides)
        if overrides.get("sync_module_states") and not _has_meta(list(module.modules())):
            _broadcast_module_states(module, config)  # the root did not (meta: per unit)
        return config
