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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_lite import collectives, wrap
from fsdp_lite.api import (
    STRATEGY_RULES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    Rules,
    ShardingStrategy,
)
from fsdp_lite.param import ShardedParam
from fsdp_lite.runtime import StepRuntime
from fsdp_lite.unit import ShardedState, ShardedUnit, TrainingState

__all__ = ["FullyShardedDataParallel", "FullyShardedModule", "UnitConfig"]

WRAPPED = "_fsdp_wrapped_module"  # torch's attribute name, so checkpoints' raw keys look the same
_PREFIX = WRAPPED + "."


@dataclass(frozen=True)
class UnitConfig:
    """Everything a wrapper needs from the constructor's arguments, checked once."""

    strategy: ShardingStrategy
    rules: Rules
    group: dist.ProcessGroup
    mesh: DeviceMesh
    device: torch.device
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    ignored_params: frozenset[nn.Parameter]
    ignored_modules: frozenset[nn.Module]


class FullyShardedModule(nn.Module):
    """A module whose parameters are sharded across ranks (torch FSDP1's API).

    Args:
        module: the module to wrap; its parameters are replaced by 1/N shards.
        process_group: the ranks to shard over (default: the default process group).
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP or NO_SHARD.
        cpu_offload: only ``CPUOffload(offload_params=False)`` for now.
        auto_wrap_policy: chooses submodules that become units of their own (see fsdp_lite.wrap).
        backward_prefetch: when to start the next unit's all-gather in backward (default BACKWARD_PRE).
        mixed_precision: not built yet; must be None.
        ignored_modules: submodules whose parameters are left alone (not sharded, not reduced).
        param_init_fn: not built yet; must be None.
        device_id: the compute device; the module is moved there first.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: start the next unit's all-gather at the start of this unit's forward.
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
        forward_prefetch: bool = False,
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
            if sync_module_states:
                _broadcast_module_states(module, _config)
            if auto_wrap_policy is not None:
                wrap.auto_wrap(
                    module,
                    auto_wrap_policy,
                    FullyShardedModule,
                    set(_config.ignored_modules),
                    set(_config.ignored_params),
                    {"_config": _config},
                )
        else:
            _config = _apply_overrides(_config, sharding_strategy, mixed_precision, cpu_offload)
        self._config = _config
        self._runtime = None
        self._is_root: bool | None = None
        self._fsdp_wrapped_module = module
        self._unit = _build_unit(module, _config)
        for p in self._unit.params:
            grad_holder = p.unsharded_param if p.is_sharded else p.sharded_param
            if p.requires_grad:
                grad_holder.register_post_accumulate_grad_hook(self._on_grad_ready)
        for p in self._unit.params:
            p.point_modules_to(p.sharded_param)
        self._register_state_dict_hook(_strip_wrapper_prefix)
        self._register_load_state_dict_pre_hook(_add_wrapper_prefix)

    # ---- running -----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._lazy_init()
        runtime.pre_forward(self._unit)
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
        if not recurse:
            wrappers = [w for w in wrappers if w is module] or wrappers
        for w in wrappers:
            w._lazy_init()
            w._unit.assert_state(TrainingState.IDLE)
        units = [w._unit for w in wrappers]
        was_unsharded = [u.state == ShardedState.UNSHARDED for u in units]
        with contextlib.ExitStack() as stack:
            # Exit callbacks run last-registered first: copy CPU copies back, write the shards,
            # reshard, and only then leave the SUMMON state.
            for u, before in zip(units, was_unsharded):
                u.unshard("summon")
                u.wait_for_unshard()
                u.training_state = TrainingState.SUMMON
                stack.callback(_end_summon, u)
                if not before:
                    stack.callback(u.reshard)
            if with_grads:
                for u in units:
                    _gather_grads(u)
            if rank0_only and any(u.rank != 0 for u in units):
                for u, before in zip(units, was_unsharded):
                    if not before:
                        u.reshard()
            else:
                if writeback:
                    for u in units:
                        stack.callback(_writeback, u)
                if offload_to_cpu:
                    _offload_full_params(units, stack)
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

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A full state dict: unsharded tensors, keys as in the unwrapped module."""
        if self._runtime is not None and not self._is_root:
            return super().state_dict(*args, **kwargs)  # the root's call already gathered
        self._lazy_init()
        with FullyShardedModule.summon_full_params(self, writeback=False):
            gathered = {
                p.unsharded_flat.untyped_storage().data_ptr()
                for w in self.fsdp_modules(self)
                for p in w._unit.params
                if p.is_sharded
            }
            full = super().state_dict(*args, **kwargs)
            for key, value in full.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.untyped_storage().data_ptr() in gathered
                ):
                    full[key] = value.detach().clone()  # the unsharded storage is freed on exit
        return full

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (keys as in the unwrapped module) into the shards."""
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported")
        if self._runtime is not None and not self._is_root:
            return super().load_state_dict(state_dict, strict)
        self._lazy_init()
        with FullyShardedModule.summon_full_params(self, writeback=True):
            return super().load_state_dict(state_dict, strict)

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
    if strategy not in STRATEGY_RULES:
        raise NotImplementedError(
            f"sharding_strategy={strategy.name} is not built yet (issue #5); "
            f"supported: {', '.join(s.name for s in STRATEGY_RULES)}"
        )
    _check_type("cpu_offload", kw["cpu_offload"], CPUOffload)
    if kw["cpu_offload"] is not None and kw["cpu_offload"].offload_params:
        raise NotImplementedError(
            "cpu_offload=CPUOffload(offload_params=True) is not built yet (#5)"
        )
    _check_type("mixed_precision", kw["mixed_precision"], MixedPrecision)
    if kw["mixed_precision"] is not None:
        raise NotImplementedError("mixed_precision is not built yet (issue #4)")
    if kw["param_init_fn"] is not None:
        raise NotImplementedError("param_init_fn is not built yet (issue #5)")
    policy = kw["auto_wrap_policy"]
    if policy is not None and not (callable(policy) or isinstance(policy, wrap.Policy)):
        raise TypeError(
            "auto_wrap_policy must be a callable or a Policy (ModuleWrapPolicy, CustomPolicy), "
            f"got {type(policy).__name__}"
        )
    _check_type("backward_prefetch", kw["backward_prefetch"], BackwardPrefetch)
    for flag in ("sync_module_states", "forward_prefetch", "limit_all_gathers", "use_orig_params"):
        _check_type(flag, kw[flag], bool, allow_none=False)
    if any(p.is_meta for p in module.parameters()):
        raise NotImplementedError(
            "modules with parameters on the meta device are not built yet (#5)"
        )

    group, mesh_given = kw["process_group"], kw["device_mesh"]
    if isinstance(group, tuple):
        raise NotImplementedError(
            "process_group=(shard, replicate) for HYBRID_SHARD is not built yet (#5)"
        )
    _check_type("process_group", group, dist.ProcessGroup)
    _check_type("device_mesh", mesh_given, DeviceMesh)
    if group is not None and mesh_given is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if mesh_given is not None and mesh_given.ndim != 1:
        raise NotImplementedError("a 2-D device_mesh (HYBRID_SHARD) is not built yet (issue #5)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedModule needs torch.distributed initialized first: "
            "call torch.distributed.init_process_group (torchrun sets up the environment)"
        )

    device = _resolve_device(module, kw["device_id"])
    if mesh_given is not None:
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
        device=device,
        backward_prefetch=kw["backward_prefetch"],
        forward_prefetch=kw["forward_prefetch"],
        ignored_params=frozenset(ignored_params),
        ignored_modules=frozenset(ignored_modules),
    )


def _apply_overrides(
    config: UnitConfig,
    sharding_strategy: ShardingStrategy | None,
    mixed_precision: MixedPrecision | None,
    cpu_offload: CPUOffload | None,
) -> UnitConfig:
    """A nested wrapper's config: the root's, with what a CustomPolicy asked to change."""
    if mixed_precision is not None or (cpu_offload is not None and cpu_offload.offload_params):
        raise NotImplementedError(
            "per-unit mixed_precision / cpu_offload are not built yet (#4, #5)"
        )
    if sharding_strategy is None or sharding_strategy == config.strategy:
        return config
    _check_type("sharding_strategy", sharding_strategy, ShardingStrategy)
    if sharding_strategy not in STRATEGY_RULES:
        raise NotImplementedError(
            f"sharding_strategy={sharding_strategy.name} is not built yet (#5)"
        )
    return dataclasses.replace(
        config, strategy=sharding_strategy, rules=STRATEGY_RULES[sharding_strategy]
    )


def _resolve_device(module: nn.Module, device_id: int | torch.device | None) -> torch.device:
    if device_id is None:
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError(f"module has parameters on several devices {devices}; pass device_id")
        return devices.pop() if devices else torch.device("cpu")
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
    if any(p.device != config.device for p in module.parameters()):
        module.to(config.device)


def _check_same_model_across_ranks(module: nn.Module, config: UnitConfig) -> None:
    """Fail with a message naming the difference if ranks built different models.

    Mismatched models would otherwise give collectives of different sizes, which hang or corrupt.
    """
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    world_size = dist.get_world_size(config.group)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=config.group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            raise ValueError(
                f"ranks built different models: rank 0 has {len(reference)} parameters, "
                f"rank {rank} has {len(theirs)}"
            )
        for ref, other in zip(reference, theirs):
            if ref != other:
                raise ValueError(
                    "ranks built different models: parameter "
                    f"{ref[0]!r} is {ref[1]} {ref[2]} on rank 0 but {other[0]!r} is "
                    f"{other[1]} {other[2]} on rank {rank}"
                )


def _broadcast_module_states(module: nn.Module, config: UnitConfig) -> None:
    source = dist.get_global_rank(config.group, 0)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=source, group=config.group)


def _build_unit(module: nn.Module, config: UnitConfig) -> ShardedUnit:
    """Collect the parameters this wrapper owns (not nested wrappers', not ignored) and shard them."""
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    names: dict[nn.Parameter, str] = {}
    nested_params: dict[int, ShardedParam] = {}
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
        )
        for p in ordered
    ]
    return ShardedUnit(params, config.group, config.rules)


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


def _end_summon(unit: ShardedUnit) -> None:
    unit.training_state = TrainingState.IDLE
    for p in unit.params:
        if p.is_sharded:
            p.unsharded_param.grad = None


def _writeback(unit: ShardedUnit) -> None:
    if not unit.rules.shard_params:
        return  # NO_SHARD: the module already holds the parameters themselves
    with torch.no_grad():
        for p in unit.params:
            p.writeback()


def _gather_grads(unit: ShardedUnit) -> None:
    """All-gather the grad shards into ``unsharded_param.grad`` (zeros where a grad is missing)."""
    if not unit.rules.shard_params or not unit.params:
        return
    flats = []
    for p in unit.params:
        flat = p.sharded_flat.new_zeros(p.shard_numel)
        if p.sharded_param.grad is not None:
            flat[: p.local_numel].copy_(p.sharded_param.grad.to_local().reshape(-1))
        flats.append(flat)
    all_gather_input = torch.cat(flats)  # 1D, unit_shard_numel
    result = collectives.all_gather(all_gather_input, unit.group)
    padded = [p.sharded_flat.new_empty(p.padded_numel) for p in unit.params]
    collectives.all_gather_copy_out(
        result.all_gather_output, unit.world_size, unit.shard_numels, padded
    )
    for p, full in zip(unit.params, padded):
        if p.sharded_param.grad is not None:
            p.unsharded_param.grad = full[: math.prod(p.orig_size)].view(p.orig_size)


def _offload_full_params(units: list[ShardedUnit], stack: contextlib.ExitStack) -> None:
    for u in units:
        for p in u.params:
            if not p.is_sharded or p.unsharded_param.device.type == "cpu":
                continue
            cpu_copy = nn.Parameter(p.unsharded_param.detach().cpu(), p.requires_grad)
            p.point_modules_to(cpu_copy)

            def copy_back(p=p, cpu_copy=cpu_copy):
                with torch.no_grad():
                    p.unsharded_param.copy_(cpu_copy)
                p.point_modules_to(p.unsharded_param)

            stack.callback(copy_back)


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
