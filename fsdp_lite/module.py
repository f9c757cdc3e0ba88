"""The public wrapper, ``FullyShardedModule`` (alias ``FullyShardedDataParallel``).

It takes torch FSDP1's constructor arguments, checks them, turns them into one ``UnitConfig``,
wraps submodules chosen by the auto-wrap policy, and builds this wrapper's ``ShardedUnit``. At run
time its ``forward`` hands each stage to runtime.py. The everyday methods users call on an FSDP model
(``no_sync``, ``clip_grad_norm_``, ``summon_full_params``, ``state_dict`` ...) live here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_lite import collectives, offload, wrap
from fsdp_lite.api import (
    STRATEGY_RULES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    Rules,
    ShardingStrategy,
)
from fsdp_lite.mixed_precision import (
    Precision,
    cast_buffers,
    cast_floating,
    keep_in_full_precision,
    resolve,
)
from fsdp_lite.param import ShardedParam, padded_numel
from fsdp_lite.runtime import StepRuntime
from fsdp_lite.unit import ShardedUnit, TrainingState

__all__ = ["FullyShardedDataParallel", "FullyShardedModule", "UnitConfig"]

WRAPPED = "_fsdp_wrapped_module"  # torch's attribute name, so checkpoints' raw keys look the same
_PREFIX = WRAPPED + "."


@dataclass(frozen=True)
class UnitConfig:
    """Everything a wrapper needs from the constructor's arguments, checked once."""

    strategy: ShardingStrategy
    rules: Rules
    group: dist.ProcessGroup  # the shard group: parameters are cut into its size
    mesh: DeviceMesh  # 1-D (shard) or, for HYBRID_SHARD, 2-D (replicate, shard)
    replicate_group: dist.ProcessGroup | None  # HYBRID_SHARD: the same shard on other groups
    storage_device: torch.device  # where shards, grads and optimizer state live (offload.py)
    disk: offload.DiskStore | None  # their files under CPUOffload(offload_dir=...); one per rank
    param_init_fn: Callable[[nn.Module], None] | None  # for meta-device modules
    sync_module_states: bool
    device: torch.device
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    ignored_params: frozenset[nn.Parameter]
    ignored_modules: frozenset[nn.Module]
    precision: Precision


class FullyShardedModule(nn.Module):
    """A module whose parameters are sharded across ranks (torch FSDP1's API).

    Args:
        module: the module to wrap; its parameters are replaced by 1/N shards.
        process_group: the ranks to shard over (default: the default process group).
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP or NO_SHARD.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps sharded params, their grads and
            the optimizer step in CPU memory (not with NO_SHARD); with ``offload_dir`` set, in
            memory-mapped files under that directory (docs/disk_offload.md).
        auto_wrap_policy: chooses submodules that become units of their own (see fsdp_lite.wrap).
        backward_prefetch: when to start the next unit's all-gather in backward (default BACKWARD_PRE).
        mixed_precision: dtypes for the unsharded params, gradient reduction and buffers
            (torch FSDP1 semantics).
        ignored_modules: submodules whose parameters are left alone (not sharded, not reduced).
        param_init_fn: not built yet; must be None.
        device_id: the compute device; the module is moved there first.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: start the next unit's all-gather at the start of this unit's forward.
            Default None: on where waiting for a collective blocks the host (a CPU compute device,
            gloo), where it hides the forward all-gathers; off on accelerators, whose host runs
            ahead of the device anyway (as torch FSDP's default False assumes).
        limit_all_gathers: accepted; at most one prefetched unit is ever in flight here.
        use_orig_params: accepted either way; parameters are always the original ones, sharded.
        ignored_states: parameters or modules to leave alone (like ``ignored_modules``).
        device_mesh: a 1-D mesh to shard over, instead of ``process_group``.
    """

    _unit: ShardedUnit
    _runtime: StepRuntime | None  # shared with the root; None until the first forward

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
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool | None = None,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        _config: UnitConfig | None = None,  # set for wrappers made by auto-wrap: already checked
    ) -> None:
        super().__init__()
        if _config is None:
            _config = _make_config(
                module,
                process_group=process_group,
                sharding_strategy=sharding_strategy,
                cpu_offload=cpu_offload,
                auto_wrap_policy=auto_wrap_policy,
                backward_prefetch=backward_prefetch,
                mixed_precision=mixed_precision,
                ignored_modules=ignored_modules,
                param_init_fn=param_init_fn,
                device_id=device_id,
                sync_module_states=sync_module_states,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                use_orig_params=use_orig_params,
                ignored_states=ignored_states,
                device_mesh=device_mesh,
            )
            _move_to_device(module, _config)
            # Collectives start here; everything above fails locally, before any rank can hang.
            _check_same_model_across_ranks(module, _config)
            if sync_module_states and not _has_meta(list(module.modules())):
                _broadcast_module_states(
                    module, _config
                )  # meta modules: per unit, see _materialize
            if auto_wrap_policy is not None:
                if mixed_precision is not None:
                    for m in module.modules():
                        if isinstance(m, tuple(mixed_precision._module_classes_to_ignore)):
                            keep_in_full_precision(m)
                # Nested wrappers get the root's arguments explicitly, so that a policy's
                # override (e.g. mixed_precision=None for BatchNorm) replaces them.
                root_kwargs = {
                    "_config": _config,
                    "sharding_strategy": _config.strategy,
                    "mixed_precision": mixed_precision,
                    "cpu_offload": cpu_offload,
                }
                wrap.auto_wrap(
                    module,
                    auto_wrap_policy,
                    FullyShardedModule,
                    set(_config.ignored_modules),
                    set(_config.ignored_params),
                    root_kwargs,
                )
        else:
            _config = _apply_overrides(_config, sharding_strategy, mixed_precision, cpu_offload)
        self._config = _config
        self._runtime = None
        self._is_root: bool | None = None
        self._fsdp_wrapped_module = module
        self._unit = _build_unit(module, _config)
        for p in self._unit.params:
            grad_holder = p.unsharded_param if p.unsharded_param is not None else p.sharded_param
            if p.requires_grad:
                grad_holder.register_post_accumulate_grad_hook(self._on_grad_ready)
        for p in self._unit.params:
            p.point_modules_to(p.sharded_param)
        self._register_state_dict_hook(_strip_wrapper_prefix)
        self._register_load_state_dict_pre_hook(_add_wrapper_prefix)
        self._state_dict_settings = None  # None: FULL_STATE_DICT defaults; see state_dict.py

    # ---- running -----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._lazy_init()
        runtime.pre_forward(self._unit)
        precision = self._unit.precision
        if precision.cast_forward_inputs or (self._is_root and precision.cast_root_forward_inputs):
            args, kwargs = cast_floating(precision.param_dtype, (args, kwargs))
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self._unit, output)

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        if self._runtime is not None:
            self._runtime.on_grad_ready(self._unit)

    def _lazy_init(self) -> StepRuntime:
        """The first wrapper to run becomes the root: it builds the runtime for all below it."""
        if self._runtime is not None:
            return self._runtime
        wrappers = [(n, m) for n, m in self.named_modules() if isinstance(m, FullyShardedModule)]
        for name, w in wrappers:
            w._is_root = w is self
            w._unit.is_root = w is self
            w._unit.name = _clean_name(name)
        units = [w._unit for _, w in reversed(wrappers)]  # children before parents
        runtime = StepRuntime(units, self._config.backward_prefetch, self._config.forward_prefetch)
        for _, w in wrappers:
            w._runtime = runtime
        return runtime

    def check_is_root(self) -> bool:
        self._lazy_init()
        return bool(self._is_root)

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
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedModule")
        previous, runtime.sync_grads = runtime.sync_grads, False
        try:
            yield
        finally:
            runtime.sync_grads = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so that their global ``norm_type`` norm is at most ``max_norm``.

        The norm is over the whole model, not this rank's shards: shard norms are combined with
        one all-reduce, replicated (NO_SHARD, ignored) gradients are counted once.

        Returns:
            The total norm before clipping (a scalar tensor).
        """
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("clip_grad_norm_() must be called on the root FullyShardedModule")
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
        for g in sharded + replicated:
            g.mul_(clip_coef.to(g.dtype))
        return total

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
            w._unit.assert_state(TrainingState.IDLE)
        with contextlib.ExitStack() as stack:
            for w in wrappers:
                _summon_unit(w._unit, stack, writeback, rank0_only, offload_to_cpu, with_grads)
            yield

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedModule:
        """``nn.Module.apply`` on full parameters, so initializers see whole tensors."""
        with FullyShardedModule.summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    # ---- names and state dicts -----------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield _clean_name(name), param

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield _clean_name(name), buf

    def state_dict(
        self, *, destination: dict | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """This wrapper's state dict, of the type ``state_dict_type`` set (default FULL_STATE_DICT).

        Keys are those of the unwrapped module. FULL: full tensors, gathered one unit at a time
        (``offload_to_cpu``, ``rank0_only``: other ranks get ``{}``). SHARDED: ``sharded_param``
        DTensors, for ``torch.distributed.checkpoint``. LOCAL: this rank's rows, plain tensors.
        See fsdp_lite/state_dict.py.
        """
        from fsdp_lite import state_dict as impl

        self._lazy_init()  # the outermost wrapper becomes the root, as in forward
        impl.to_rest(self)
        raw = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return impl.after_state_dict(self, raw, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full, sharded (DTensor) or local state dict into the shards.

        A DTensor value is a shard, a plain tensor a full parameter (each rank keeps its rows, no
        communication), except under LOCAL_STATE_DICT (this rank's rows). Reported key names
        are the unwrapped module's. See fsdp_lite/state_dict.py.
        """
        from fsdp_lite import state_dict as impl

        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported")
        self._lazy_init()
        try:
            result = super().load_state_dict(state_dict, strict)
        except RuntimeError as e:
            raise RuntimeError(_clean_name(str(e))) from None
        return impl.clean_load_result(result)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        from fsdp_lite import state_dict as impl

        impl.before_load(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict: our keys skip ``_fsdp_wrapped_module``."""
        inner = self._fsdp_wrapped_module
        names = [*inner._modules, *inner._parameters, *inner._buffers]
        return dict.fromkeys(names, WRAPPED)

    # State dict settings and optimizer state: torch FSDP1's static methods, which delegate to
    # fsdp_lite/state_dict.py and fsdp_lite/optim_state.py (see their docstrings).

    @staticmethod
    def state_dict_type(
        module, state_dict_type, state_dict_config=None, optim_state_dict_config=None
    ):
        """Context manager: ``set_state_dict_type`` for the block, then the previous settings."""
        from fsdp_lite import state_dict as impl

        return impl.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def set_state_dict_type(
        module, state_dict_type, state_dict_config=None, optim_state_dict_config=None
    ):
        """Set the state dict type and configs of every wrapper under ``module``; returns the old."""
        from fsdp_lite import state_dict as impl

        return impl.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module):
        """The ``StateDictSettings`` of the wrappers under ``module`` (they must agree)."""
        from fsdp_lite import state_dict as impl

        return impl.get_state_dict_type(module)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        """``optim``'s state keyed by parameter name, full or sharded as ``state_dict_type`` says."""
        from fsdp_lite import optim_state as impl

        return impl.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None
    ):
        """A name-keyed optimizer state dict (any world size) made loadable by ``optim``."""
        from fsdp_lite import optim_state as impl

        return impl.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    @staticmethod
    def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
        """Full optimizer state keyed by parameter name (only on rank 0 by default)."""
        from fsdp_lite import optim_state as impl

        return impl.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(model, optim, group=None):
        """Optimizer state keyed by parameter name, each tensor this rank's DTensor shard."""
        from fsdp_lite import optim_state as impl

        return impl.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
        """This rank's part of a full optimizer state dict that every rank holds."""
        from fsdp_lite import optim_state as impl

        return impl.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict, model, optim_input=None, optim=None, group=None
    ):
        """This rank's part of a full optimizer state dict that only rank 0 holds."""
        from fsdp_lite import optim_state as impl

        return impl.scatter_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict, optim_state_key_type, model, optim_input=None, optim=None
    ):
        """Re-key an optimizer state dict by parameter name or id (wrapped model or not)."""
        from fsdp_lite import optim_state as impl

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


# ---- construction helpers ----------------------------------------------------------------------


def _check_type(name: str, value: Any, types: type | tuple, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, types):
        expected = " or ".join(
            t.__name__ for t in (types if isinstance(types, tuple) else (types,))
        )
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}: {value!r}")


def _make_config(module: nn.Module, **kw: Any) -> UnitConfig:
    """Check every constructor argument and resolve defaults; no collective runs here."""
    _check_type("module", module, nn.Module, allow_none=False)
    if isinstance(module, FullyShardedModule):
        raise ValueError("module is already a FullyShardedModule")
    strategy = kw["sharding_strategy"] or ShardingStrategy.FULL_SHARD
    _check_type("sharding_strategy", strategy, ShardingStrategy)
    _check_type("cpu_offload", kw["cpu_offload"], CPUOffload)
    offload_params = _check_offload(kw["cpu_offload"], strategy)
    _check_type("mixed_precision", kw["mixed_precision"], MixedPrecision)
    precision = resolve(kw["mixed_precision"])
    if kw["param_init_fn"] is not None and not callable(kw["param_init_fn"]):
        raise TypeError(f"param_init_fn must be callable, got {type(kw['param_init_fn']).__name__}")
    policy = kw["auto_wrap_policy"]
    if policy is not None and not (callable(policy) or isinstance(policy, wrap.Policy)):
        raise TypeError(
            "auto_wrap_policy must be a callable or a Policy (ModuleWrapPolicy, CustomPolicy), "
            f"got {type(policy).__name__}"
        )
    _check_type("backward_prefetch", kw["backward_prefetch"], BackwardPrefetch)
    for flag in ("sync_module_states", "limit_all_gathers", "use_orig_params"):
        _check_type(flag, kw[flag], bool, allow_none=False)
    _check_type("forward_prefetch", kw["forward_prefetch"], bool)

    group, mesh_given = kw["process_group"], kw["device_mesh"]
    hybrid = STRATEGY_RULES[strategy].replicate
    if isinstance(group, tuple):
        if not hybrid:
            raise ValueError(
                f"a (shard, replicate) process_group tuple needs HYBRID_SHARD, not {strategy.name}"
            )
        if len(group) != 2:
            raise ValueError("process_group tuple must be (shard_group, replicate_group)")
        for g in group:
            _check_type("process_group[i]", g, dist.ProcessGroup, allow_none=False)
    else:
        _check_type("process_group", group, dist.ProcessGroup)
    _check_type("device_mesh", mesh_given, DeviceMesh)
    if group is not None and mesh_given is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if mesh_given is not None and mesh_given.ndim != (2 if hybrid else 1):
        raise ValueError(
            f"{strategy.name} needs a {2 if hybrid else 1}-D device_mesh, got {mesh_given.ndim}-D"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedModule needs torch.distributed initialized first: "
            "call torch.distributed.init_process_group (torchrun sets up the environment)"
        )

    device = _resolve_device(module, kw["device_id"])
    replicate_group = None
    if hybrid:
        mesh = mesh_given if mesh_given is not None else _hybrid_mesh(group, device)
        replicate_group, group = mesh.get_group(0), mesh.get_group(1)
    elif mesh_given is not None:
        mesh, group = mesh_given, mesh_given.get_group()
    else:
        group = group or dist.group.WORLD
        mesh = DeviceMesh.from_group(group, device.type)

    ignored_modules, ignored_params = _resolve_ignored(
        module, kw["ignored_modules"], kw["ignored_states"]
    )
    return UnitConfig(
        strategy=strategy,
        rules=STRATEGY_RULES[strategy],
        group=group,
        mesh=mesh,
        replicate_group=replicate_group,
        storage_device=offload.storage_device(device, offload_params),
        disk=offload.disk_store(kw["cpu_offload"], dist.get_rank()),
        param_init_fn=kw["param_init_fn"],
        sync_module_states=kw["sync_module_states"],
        device=device,
        backward_prefetch=kw["backward_prefetch"],
        forward_prefetch=(
            device.type == "cpu" if kw["forward_prefetch"] is None else kw["forward_prefetch"]
        ),
        ignored_params=frozenset(ignored_params),
        ignored_modules=frozenset(ignored_modules),
        precision=precision,
    )


def _apply_overrides(
    config: UnitConfig,
    sharding_strategy: ShardingStrategy | None,
    mixed_precision: MixedPrecision | None,
    cpu_offload: CPUOffload | None,
) -> UnitConfig:
    """A nested wrapper's config: the root's, with the strategy and precision it was given.

    auto-wrap passes the root's values explicitly, so ``mixed_precision=None`` here means a
    policy asked for full precision (as for BatchNorm), not "unset".
    """
    strategy = sharding_strategy or config.strategy
    _check_type("sharding_strategy", strategy, ShardingStrategy)
    if STRATEGY_RULES[strategy].replicate != config.rules.replicate:
        raise NotImplementedError(
            f"a unit with {strategy.name} under a root with {config.strategy.name}: mixing hybrid "
            "and non-hybrid units needs another process group layout (not built)"
        )
    _check_type("mixed_precision", mixed_precision, MixedPrecision)
    _check_type("cpu_offload", cpu_offload, CPUOffload)
    offload_params = _check_offload(cpu_offload, strategy)
    return dataclasses.replace(
        config,
        strategy=strategy,
        rules=STRATEGY_RULES[strategy],
        precision=resolve(mixed_precision),
        storage_device=offload.storage_device(config.device, offload_params),
        # Nested units share the root's directory; a policy can turn disk offload off for one.
        disk=config.disk if offload_params and cpu_offload.offload_dir is not None else None,
    )


def _check_offload(cpu_offload: CPUOffload | None, strategy: ShardingStrategy) -> bool:
    offload_params = cpu_offload is not None and cpu_offload.offload_params
    if offload_params and not STRATEGY_RULES[strategy].shard_params:
        raise NotImplementedError("cpu_offload with NO_SHARD is not built (shard the params)")
    return offload_params


def _hybrid_mesh(groups: tuple | None, device: torch.device) -> DeviceMesh:
    """The (replicate, shard) mesh for HYBRID_SHARD from a group tuple, or by default one shard
    group per node (LOCAL_WORLD_SIZE ranks, as torch FSDP1 shards within a node)."""
    world_size = dist.get_world_size()
    if groups is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % local:
            raise ValueError(f"world size {world_size} is not a multiple of {local} ranks per node")
        return init_device_mesh(
            device.type, (world_size // local, local), mesh_dim_names=("replicate", "shard")
        )
    shard_group, replicate_group = groups
    # Every rank says where it sits; the mesh tensor is the same on all ranks.
    me = (dist.get_rank(replicate_group), dist.get_rank(shard_group), dist.get_rank())
    seats = collectives.all_gather_objects(me)
    layout = torch.empty(
        dist.get_world_size(replicate_group), dist.get_world_size(shard_group), dtype=torch.int
    )
    for replica, shard, global_rank in seats:
        layout[replica, shard] = global_rank
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device.type,
        mesh=layout,
        mesh_dim_names=("replicate", "shard"),
    )


def _resolve_device(module: nn.Module, device_id: int | torch.device | None) -> torch.device:
    if device_id is None:
        devices = {p.device for p in module.parameters() if not p.is_meta}
        if len(devices) > 1:
            raise ValueError(f"module has parameters on several devices {devices}; pass device_id")
        if devices:
            return devices.pop()
        # Nothing materialized (or no params): the current accelerator if there is one.
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        raise TypeError(f"device_id must be an int or torch.device, got {type(device_id).__name__}")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if device_id.type == "cuda" and device_id.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device_id


def _resolve_ignored(
    module: nn.Module, ignored_modules: Iterable | None, ignored_states: Iterable | None
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass ignored_modules or ignored_states, not both")
    submodules = set(module.modules())
    mods: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for item in list(ignored_modules or []) + list(ignored_states or []):
        if isinstance(item, nn.Parameter):
            params.add(item)
        elif isinstance(item, nn.Module):
            if item not in submodules:
                raise ValueError(
                    f"ignored module {type(item).__name__} is not a submodule of the wrapped module"
                )
            if isinstance(item, FullyShardedModule):
                raise ValueError("an ignored module cannot be a FullyShardedModule")
            mods.add(item)
        else:
            raise TypeError(
                f"ignored_modules/ignored_states hold nn.Module or nn.Parameter, "
                f"got {type(item).__name__}"
            )
    for m in mods:
        params.update(m.parameters())
    return mods, params


def _move_to_device(module: nn.Module, config: UnitConfig) -> None:
    if _has_meta(list(module.modules())):
        return  # materialized on config.device unit by unit (_materialize)
    if config.storage_device != config.device:
        # CPU offload: params stay where they are and are sharded straight into CPU memory;
        # only buffers, which forward uses whole, go to the compute device.
        for m in module.modules():
            for name, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[name] = buf.to(config.device)
        return
    if any(p.device != config.device for p in module.parameters()):
        module.to(config.device)


def _check_same_model_across_ranks(module: nn.Module, config: UnitConfig) -> None:
    """Fail with a message naming the difference if ranks built different models.

    Mismatched models would otherwise give collectives of different sizes, which hang or corrupt.
    """
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    for group in _data_parallel_groups(config):
        _compare_across(mine, group)


def _data_parallel_groups(config: UnitConfig) -> list[dist.ProcessGroup]:
    # Shard group first, then replicas: after both, every rank agrees with global rank 0.
    return [config.group] + ([config.replicate_group] if config.replicate_group else [])


def _compare_across(mine: list, group: dist.ProcessGroup) -> None:
    everyone = collectives.all_gather_objects(mine, group=group)
    reference, first = everyone[0], dist.get_global_rank(group, 0)
    for rank, theirs in enumerate(everyone[1:], start=1):
        rank = dist.get_global_rank(group, rank)
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            raise ValueError(
                f"ranks built different models: rank {first} has {len(reference)} parameters, "
                f"rank {rank} has {len(theirs)}"
            )
        for ref, other in zip(reference, theirs):
            if ref != other:
                raise ValueError(
                    "ranks built different models: parameter "
                    f"{ref[0]!r} is {ref[1]} {ref[2]} on rank {first} but {other[0]!r} is "
                    f"{other[1]} {other[2]} on rank {rank}"
                )


def _broadcast_module_states(module: nn.Module, config: UnitConfig) -> None:
    _broadcast_from_rank0([*module.parameters(), *module.buffers()], config)


def _broadcast_from_rank0(tensors: list[torch.Tensor], config: UnitConfig) -> None:
    """Give every rank rank 0's values (shard group first, then across replicas)."""
    with torch.no_grad():
        for group in _data_parallel_groups(config):
            source = dist.get_global_rank(group, 0)
            for tensor in tensors:
                dist.broadcast(tensor.data, src=source, group=group)


def _build_unit(module: nn.Module, config: UnitConfig) -> ShardedUnit:
    """Collect the parameters this wrapper owns (not nested wrappers', not ignored) and shard them."""
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    names: dict[nn.Parameter, str] = {}
    nested_params: dict[int, ShardedParam] = {}
    own_modules: list[nn.Module] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        path, m = stack.pop()
        if isinstance(m, FullyShardedModule):
            for p in m._unit.params:
                orig = p.orig_param_ref()
                if orig is not None:
                    nested_params[id(orig)] = p
            continue
        if m in config.ignored_modules:
            continue
        own_modules.append(m)
        for attr, param in m._parameters.items():
            if param is None or param in config.ignored_params:
                continue
            locations.setdefault(param, []).append((m, attr))
            names.setdefault(param, f"{path}{attr}")
        for child_name, child in reversed(list(m._modules.items())):
            if child is not None:
                stack.append((f"{path}{child_name}.", child))
    for param, name in names.items():
        if id(param) in nested_params:
            raise ValueError(
                f"parameter {_clean_name(name)!r} is shared with a nested unit "
                f"({nested_params[id(param)].fqn!r}); put the modules sharing it in one unit"
            )
    buffers: dict[nn.Parameter, torch.Tensor] = {}  # param -> the unsharded buffer it lives in
    if _has_meta(own_modules):
        locations, names, buffers = _materialize(own_modules, locations, names, config)
    # ``names`` is in registration (pre-order) order, so the flat layout is the same on every rank.
    ordered = list(names)
    rank = dist.get_rank(config.group)
    world_size = dist.get_world_size(config.group)
    params = [
        ShardedParam(
            p,
            locations[p],
            _clean_name(names[p]),
            config.mesh,
            rank,
            world_size,
            shard=config.rules.shard_params,
            compute_dtype=config.precision.param_dtype,
            storage_device=config.storage_device,
            compute_device=config.device,
            unsharded_buffer=buffers.get(p),
            disk=config.disk,
        )
        for p in ordered
    ]
    unit = ShardedUnit(params, config.group, config.rules, config.precision, config.replicate_group)
    # Buffers live whole on every rank; under mixed precision they compute in buffer_dtype.
    # The original dtypes are kept so that state dicts can hand them back in full precision.
    unit.buffer_dtypes = {
        (m, name): buf.dtype
        for m in own_modules
        for name, buf in m._buffers.items()
        if buf is not None
    }
    for m in own_modules:
        cast_buffers(m, config.precision.buffer_dtype, skip=(FullyShardedModule,), recurse=False)
    return unit


def _has_meta(modules: list[nn.Module]) -> bool:
    return any(
        t is not None and t.is_meta
        for m in modules
        for t in (*m._parameters.values(), *m._buffers.values())
    )


def _materialize(
    own_modules: list[nn.Module],
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]],
    names: dict[nn.Parameter, str],
    config: UnitConfig,
) -> tuple[dict, dict, dict]:
    """Allocate and initialize this unit's meta-device params and buffers, just before sharding.

    Units are built children first, so only one unit is ever unsharded in memory: the model is
    never whole on one rank. Each param is allocated inside the padded unsharded buffer its
    ShardedParam will use (returned, param -> buffer), so the unit exists once, not twice. A tied
    parameter gets one tensor for all its places (``to_empty`` would untie it).
    ``param_init_fn(module)`` initializes, else ``module.reset_parameters()``; with
    ``sync_module_states`` rank 0's values are then broadcast.
    """
    touched = [m for m in own_modules if _has_meta([m])]
    real_locations: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    real_names: dict[nn.Parameter, str] = {}
    buffers: dict[nn.Parameter, torch.Tensor] = {}
    world_size = dist.get_world_size(config.group)
    for param, where in locations.items():
        real = param
        if param.is_meta:
            if config.rules.shard_params and param.dim() > 0:
                buffer = torch.empty(
                    padded_numel(param.shape, world_size), dtype=param.dtype, device=config.device
                )
                data = buffer[: param.numel()].view(param.shape)
            else:
                buffer, data = None, torch.empty_like(param, device=config.device)
            real = nn.Parameter(data, requires_grad=param.requires_grad)
            if buffer is not None:
                buffers[real] = buffer
            for m, attr in where:
                m._parameters[attr] = real
        real_locations[real], real_names[real] = where, names[param]
    for m in touched:
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                m._buffers[name] = torch.empty_like(buf, device=config.device)
    with torch.no_grad():
        for m in touched:
            if config.param_init_fn is not None:
                config.param_init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
    if config.sync_module_states:
        tensors = [t for m in touched for t in (*m._parameters.values(), *m._buffers.values())]
        # dict.fromkeys: a tied parameter is in two modules but is sent once
        _broadcast_from_rank0([t for t in dict.fromkeys(tensors) if t is not None], config)
    return real_locations, real_names, buffers


def _clean_name(name: str) -> str:
    return name.replace(_PREFIX, "").replace(WRAPPED, "")


def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + _PREFIX
    for key in list(state_dict):
        if key.startswith(inner):
            state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_wrapper_prefix(state_dict, prefix, *args) -> None:
    inner = prefix + _PREFIX
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(inner):
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


# ---- summon_full_params / clip_grad_norm_ helpers ----------------------------------------------


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
    unit.training_state = TrainingState.SUMMON

    def restore() -> None:
        for p, holders in zip(unit.params, previous):
            for (m, n), holder in zip(p.locations, holders):
                m._parameters[n] = holder
        unit.training_state = TrainingState.IDLE

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
