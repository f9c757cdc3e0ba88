"""The adapter interface: how the suite drives one FSDP implementation.

The runner owns the training loop and the references; an adapter only translates. It wraps a model
as a ``WrapRequest`` asks, and hands back full (unsharded) gradients, parameters, optimizer state
and state dicts under the unwrapped module's parameter names. The defaults here work for any
implementation whose sharded tensors are DTensors (fsdp_lite, torch FSDP2); override what differs.
See docs/conformance.md, "Adding an adapter for your own FSDP".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from conformance.matrix import Case

__all__ = [
    "FSDP1_VARIANTS",
    "FSDP2_VARIANTS",
    "Adapter",
    "Fsdp1ApiAdapter",
    "Unsupported",
    "WrapRequest",
    "clean_name",
    "full_tensor",
    "materialize",
    "to_meta",
    "wrap_variant",
]

# Wrapper attributes that appear in parameter names but not in the user's module.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class Unsupported(Exception):
    """Raised by an adapter (anywhere in a case) for a combination its implementation lacks.

    The case is reported ``unsupported`` with this message, never ``passed``. A
    ``NotImplementedError`` raised while wrapping counts the same.
    """


@dataclass
class WrapRequest:
    """Everything an adapter needs to wrap one model for one case, decided by the runner.

    Attributes:
        case: the case being run (strategy, precision, feature, model, world size).
        units: submodules that must become units of their own, children before parents. The root
            module is wrapped too, so its remaining parameters form the root unit.
        group: the process group to shard over (all ranks of the run).
        device: this rank's compute device (cpu, or cuda:LOCAL_RANK under NCCL).
        param_dtype: None for fp32; otherwise param and buffer dtype, and reduce dtype unless
            ``reduce_dtype`` says otherwise (FSDP1's MixedPrecision(param_dtype=d,
            reduce_dtype=reduce_dtype or d, buffer_dtype=d)).
        reduce_dtype: None (reduce in ``param_dtype``), or the dtype gradients are reduced in.
        backward_prefetch: "default" (the implementation's own default), "BACKWARD_PRE",
            "BACKWARD_POST" or "NONE".
        forward_prefetch: prefetch the next unit's all-gather in forward.
        cpu_offload: keep sharded parameters on the CPU (CPUOffload(offload_params=True)).
        mesh: a 1-D DeviceMesh over ``group``.
        mesh_2d: ``mesh_2d(replicate, shard)`` builds (once per run) a 2-D mesh over all ranks
            with dims ("replicate", "shard"); ``hybrid_mesh()`` picks the shape for HYBRID_SHARD.
        disk_offload: keep parameters in files under ``scratch_dir`` (fsdp_lite's
            CPUOffload(offload_params=True, offload_dir=...)).
        optimizer_offload: None, or where the optimizer's state lives and steps: "cpu" or "disk"
            (DeepSpeed's offload_optimizer).
        scratch_dir: a directory for this case, the same path on every rank, removed when the
            case ends: offload files and checkpoints go here.
        make_optimizer: the suite's optimizer factory, ``make_optimizer(params, muon=None)``, for an
            implementation that must own the optimizer when it wraps (DeepSpeed).
    """

    case: Case
    units: list[nn.Module]
    group: dist.ProcessGroup
    device: torch.device
    param_dtype: torch.dtype | None
    backward_prefetch: str
    forward_prefetch: bool
    cpu_offload: bool
    mesh: DeviceMesh
    mesh_2d: Callable[[int, int], DeviceMesh]
    disk_offload: bool = False
    optimizer_offload: str | None = None
    scratch_dir: str | None = None
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    reduce_dtype: torch.dtype | None = None

    @property
    def grad_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in under mixed precision (None without it)."""
        return self.reduce_dtype or self.param_dtype

    @property
    def strategy(self) -> str:
        return self.case.strategy

    def hybrid_mesh(self) -> DeviceMesh:
        """The HYBRID_SHARD mesh: 2 replicas when the world size is even (2 ranks: 2 replicas of
        1 shard, so the replicate all-reduce is what runs), else 1 replica of all ranks."""
        world_size = self.case.world_size
        replicate = 2 if world_size % 2 == 0 else 1
        return self.mesh_2d(replicate, world_size // replicate)

    def unit_policy(self) -> Callable[[nn.Module], bool]:
        """``lambda_fn`` for a lambda auto-wrap policy that wraps exactly ``units``."""
        unit_ids = {id(m) for m in self.units}
        return lambda module: id(module) in unit_ids


# The features' construction paths and setters (matrix.Feature.wrap_variant) each API family has.
FSDP1_VARIANTS = ("sync_module_states", "meta_init", "apply", "summon_writeback", "policy_override")
FSDP2_VARIANTS = ("meta_init", "shard_dim1", "keep_after_backward", "mixed_reshard", "hpz")
# policy_override: the units' sharding strategy, overridden per unit by a CustomPolicy; the same
# reduction at every world size the matrix runs (only when parameters are gathered changes).
OVERRIDDEN_STRATEGY = {
    "FULL_SHARD": "SHARD_GRAD_OP",
    "SHARD_GRAD_OP": "FULL_SHARD",
    "NO_SHARD": "FULL_SHARD",
}


def wrap_variant(case: Case) -> str | None:
    """The construction path or setter ``case``'s feature asks for, if any."""
    from conformance.matrix import FEATURES

    return FEATURES[case.feature].wrap_variant


def to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Move every parameter and buffer of ``model`` to the meta device (one parameter object per
    tied group, as before); returns clones of their values, by name, to materialize with."""
    values = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    metas: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    if id(p) not in metas:
                        metas[id(p)] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
                    module._parameters[name] = metas[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = b.to("meta")
    return values


def materialize(module: nn.Module, prefix: str, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` (``to_meta``'s) into ``module``'s own parameters and buffers, whose names
    in the unwrapped model start with ``prefix``; DTensors get their local shard of the value."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        own = list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False)
        )
        for name, t in own:
            value = values[clean_name(prefix + name)]
            if isinstance(t, DTensor):
                value = distribute_tensor(
                    value.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None
                ).to_local()
                t = t.to_local()
            t.copy_(value)


def perturb(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """Add 1 to every floating-point parameter of ``model`` (not yet wrapped); returns the values
    before, by name, and each module's name prefix, for ``restore`` to put them back through
    the API under test: if that path loses the write, the case trains from other values."""
    values = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    prefixes = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.add_(1.0)
    return values, prefixes


def restore(values: dict[str, torch.Tensor], prefixes: dict[int, str]) -> Callable:
    """``fn(module)`` putting ``perturb``'s values back into ``module``'s own tensors (modules
    of the unwrapped model only: wrappers are skipped), for ``apply`` or a summon's writeback."""

    def fn(module: nn.Module) -> None:
        if id(module) in prefixes:
            materialize(module, prefixes[id(module)], values)

    return fn


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole logical tensor on every rank: DTensor shards are all-gathered, others returned."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def clean_name(name: str) -> str:
    """A parameter or state-dict key as in the unwrapped module (wrapper prefixes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class Adapter:
    """Maps the suite's cases onto one FSDP implementation's API. Subclass it for your own FSDP.

    One instance serves a whole run; keep per-case state on the wrapped model, not on the adapter.
    Every method runs on every rank, in the same order, so collectives inside them line up.
    Tensors handed back are full (unsharded), detached, and keyed by the parameter names of the
    unwrapped module (``clean_name``); the runner compares them with DDP and a single process.
    State dicts are the exception: their keys are compared as the implementation saves them,
    since a checkpoint is loaded by key.
    """

    name: ClassVar[str] = "unnamed"  # what --impl selects and reports show
    description: ClassVar[str] = ""
    # Where backwards without gradient sync sum their gradients when the reduce dtype differs from
    # the param dtype: in the param dtype (torch FSDP1's no_sync(), False) or in the reduce dtype
    # (torch FSDP2's set_requires_gradient_sync(False), True). The references do the same.
    unsynced_grads_in_reduce_dtype: ClassVar[bool] = False
    # The implementation claims the same bits at every world size (``--world-sizes``: any
    # difference across world sizes fails the case; for the others it is information).
    world_size_invariant: ClassVar[bool] = False
    # Set by a ``--world-sizes`` run before any case: V, the number of equal micro-batches the
    # global batch is cut into, for an implementation with a canonical mode (``canonical``).
    virtual_batches: int | None = None

    # ---- what this implementation has ---------------------------------------------------------

    def strategies(self) -> list[str]:
        """Names of the sharding strategies this implementation has (its ShardingStrategy members).

        Extra strategies (HYBRID_SHARD, SHARD_OPTIM) are only put in the matrix when listed here.
        """
        return ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]

    def features(self) -> list[str]:
        """The ``matrix.EXTRA_FEATURES`` this implementation has; only those are put in its matrix."""
        return []

    def wrap_variants(self) -> list[str]:
        """The construction paths and setters (``matrix.Feature.wrap_variant``) ``wrap`` builds;
        a case asking for another is reported unsupported."""
        return []

    def unsupported_reason(self, case: Case) -> str | None:
        """Why ``case`` cannot run on this implementation, or None. No collectives here."""
        return None

    @contextlib.contextmanager
    def case_context(self, case: Case) -> Iterator[None]:
        """Entered around each case on every rank (the planted-bug tests patch in here)."""
        yield

    # ---- building ----------------------------------------------------------------------------

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        """Shard ``model`` (already on ``request.device``) as ``request`` says; return the model to
        call. Raise ``Unsupported`` (or NotImplementedError) for what the implementation lacks."""
        raise NotImplementedError(f"{type(self).__name__}.wrap")

    def optimizers(self) -> list[str]:
        """The ``matrix.OPTIMIZERS`` this implementation can be trained with (``--optimizers``);
        a case with another one is reported unsupported."""
        return ["sgd", "adamw", "muon"]

    def muon(self) -> type:
        """The Muon class for the matrices of a "muon" case (default ``torch.optim.Muon``)."""
        return torch.optim.Muon

    def make_optimizer(
        self, model: nn.Module, make: Callable[..., torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model's parameters; ``make(params, muon=cls)`` builds
        the suite's (``params`` named, as "muon" splits them by name; ``cls`` from ``muon``)."""
        return make(model.named_parameters(), muon=self.muon())

    def make_grad_scaler(self, model: nn.Module, request: WrapRequest, init_scale: float) -> Any:
        """A gradient scaler for fp16 (scale / unscale_ / step / update, like torch's GradScaler)."""
        raise Unsupported(f"{self.name} has no gradient scaler for fp16")

    # ---- the training loop's hooks -----------------------------------------------------------

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """Backward from ``loss`` (already scaled under fp16)."""
        loss.backward()

    def step(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        """The optimizer step, then drop the gradients (not used under fp16's grad scaler)."""
        optim.step()
        optim.zero_grad(set_to_none=True)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward accumulates gradients without communicating."""
        return model.no_sync()

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip all gradients to a global ``norm_type``-norm of ``max_norm``; return the norm
        before clipping. The suite passes ``norm_type`` only when it is not 2."""
        return model.clip_grad_norm_(max_norm, norm_type)

    def canonical(self, model: nn.Module) -> Any | None:
        """The wrapped model's world-size-invariant mode, or None (the default: a plain loop).

        ``--world-sizes`` runs drive an object returned here instead of cutting the global batch
        into one local batch per rank: ``micro_batches(x, y)`` (this rank's (input, target) parts
        of the global batch, each one backward with gradient sync), ``mean(losses)`` (the global
        batch's loss from this rank's micro-batch losses) and ``clip_grad_norm_(max_norm,
        norm_type)``: ``fsdp_lite.Canonical``'s methods.
        """
        return None

    # ---- full tensors, for comparison ----------------------------------------------------------

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by name."""
        return {clean_name(n): full_tensor(p.detach()).clone() for n, p in model.named_parameters()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, whole, by name (None where it has none)."""
        return {
            clean_name(n): None if p.grad is None else full_tensor(p.grad.detach()).clone()
            for n, p in model.named_parameters()
        }

    def full_optim_state(
        self, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's per-parameter tensors (e.g. momentum_buffer), whole, by parameter name."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in model.named_parameters():
            tensors = {
                k: full_tensor(v.detach()).clone()
                for k, v in optim.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.dim() > 0  # not the scalar "step"
            }
            if tensors:
                state[clean_name(n)] = tensors
        return state

    def full_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, dict[str, torch.Tensor]] | None:
        """The optimizer state dict the implementation saves, keyed by parameter name as saved,
        full tensors; None (the default) when it has none to judge. Unlike ``full_optim_state``
        this goes through the implementation's own naming code."""
        return None

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's full state dict (parameters and buffers, unsharded), keys as saved: a
        wrapper prefix left in a key is the implementation's bug, not cleaned away here."""
        return {
            k: full_tensor(v.detach()).clone()
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a state dict as ``full_state_dict`` returns it into a freshly wrapped model."""
        model.load_state_dict(state_dict)

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The state dict ``torch.distributed.checkpoint`` saves and loads in place: each rank's
        shards (DTensors for a DTensor-based implementation, as ``model.state_dict()`` gives)."""
        return model.state_dict()

    def load_sharded_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        """Load what ``torch.distributed.checkpoint.load`` filled into ``sharded_state_dict``."""
        model.load_state_dict(state_dict)


class Fsdp1ApiAdapter(Adapter):
    """An implementation with torch FSDP1's constructor, under the module named ``api``.

    torch.distributed.fsdp and fsdp_lite have the same names (the point of a swap-in), so one
    recipe wraps both: a lambda auto-wrap policy picking the case's units, ``device_id``,
    ``process_group`` (or a 2-D ``device_mesh`` for HYBRID_SHARD), ``use_orig_params=True``.
    """

    api: ClassVar[str]  # holds FullyShardedDataParallel, ShardingStrategy, MixedPrecision, ...
    # SHARDED_STATE_DICT values as DTensors (True) or the API's default (ShardedTensor in torch)
    sharded_use_dtensor: ClassVar[bool] = True

    def strategies(self) -> list[str]:
        strategy = importlib.import_module(self.api).ShardingStrategy
        return [s.name for s in strategy if not s.name.startswith("_")]

    def unsupported_reason(self, case: Case) -> str | None:
        if case.strategy not in self.strategies():
            return f"{self.api}.ShardingStrategy has no {case.strategy}"
        return None

    def wrap_variants(self) -> list[str]:
        return list(FSDP1_VARIANTS)

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        api = importlib.import_module(self.api)
        policy = importlib.import_module(f"{self.api}.wrap").lambda_auto_wrap_policy
        kwargs: dict[str, Any] = {}
        if request.param_dtype is not None:
            dtype = request.param_dtype
            kwargs["mixed_precision"] = api.MixedPrecision(
                param_dtype=dtype, reduce_dtype=request.grad_reduce_dtype, buffer_dtype=dtype
            )
        if request.optimizer_offload is not None:
            raise Unsupported(f"{self.api}.CPUOffload has no optimizer-only offload")
        if request.disk_offload:
            if "offload_dir" not in {f.name for f in dataclasses.fields(api.CPUOffload)}:
                raise Unsupported(f"{self.api}.CPUOffload has no offload_dir (disk offload)")
            kwargs["cpu_offload"] = api.CPUOffload(
                offload_params=True, offload_dir=request.scratch_dir
            )
        elif request.cpu_offload:
            kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
        if request.backward_prefetch != "default":
            kwargs["backward_prefetch"] = (
                None
                if request.backward_prefetch == "NONE"
                else api.BackwardPrefetch[request.backward_prefetch]
            )
        if request.strategy.startswith("HYBRID"):
            kwargs["device_mesh"] = request.hybrid_mesh()
        else:
            kwargs["process_group"] = request.group
        variant = wrap_variant(request.case)
        if variant == "sync_module_states":
            if dist.get_rank() != 0:  # rank 0's values must reach every rank
                with torch.no_grad():
                    for t in list(model.parameters()) + list(model.buffers()):
                        if t.is_floating_point():
                            t.add_(1.0)
            kwargs["sync_module_states"] = True
        elif variant == "meta_init":
            prefixes = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
            values = to_meta(model)
            device = request.device

            def param_init_fn(module: nn.Module) -> None:
                module.to_empty(device=device, recurse=False)
                materialize(module, prefixes[id(module)], values)

            kwargs["param_init_fn"] = param_init_fn
        elif variant in ("apply", "summon_writeback"):
            fn = restore(*perturb(model))
        auto_wrap_policy = functools.partial(policy, lambda_fn=request.unit_policy())
        if variant == "policy_override":
            is_unit = request.unit_policy()
            other = {
                "sharding_strategy": api.ShardingStrategy[OVERRIDDEN_STRATEGY[request.strategy]]
            }
            custom = importlib.import_module(f"{self.api}.wrap").CustomPolicy
            auto_wrap_policy = custom(lambda module: other if is_unit(module) else False)
        wrapped = api.FullyShardedDataParallel(
            model,
            sharding_strategy=api.ShardingStrategy[request.strategy],
            auto_wrap_policy=auto_wrap_policy,
            device_id=request.device,
            forward_prefetch=request.forward_prefetch,
            use_orig_params=True,
            **kwargs,
        )
        if variant == "apply":  # FSDP1's apply runs fn on full parameters and writes them back
            wrapped.apply(fn)
        elif variant == "summon_writeback":
            with api.FullyShardedDataParallel.summon_full_params(wrapped, writeback=True):
                for module in wrapped.modules():
                    fn(module)
        return wrapped

    def make_grad_scaler(self, model: nn.Module, request: WrapRequest, init_scale: float) -> Any:
        scaler = importlib.import_module(f"{self.api}.sharded_grad_scaler").ShardedGradScaler
        return scaler(
            device=request.device.type, init_scale=init_scale, process_group=request.group
        )

    def _sharded(self, model: nn.Module) -> contextlib.AbstractContextManager:
        api = importlib.import_module(self.api)
        return api.FullyShardedDataParallel.state_dict_type(
            model,
            api.StateDictType.SHARDED_STATE_DICT,
            api.ShardedStateDictConfig(_use_dtensor=self.sharded_use_dtensor),
            api.ShardedOptimStateDictConfig(_use_dtensor=self.sharded_use_dtensor),
        )

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        with self._sharded(model):
            return model.state_dict()

    def load_sharded_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        with self._sharded(model):
            model.load_state_dict(state_dict)

    def full_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, dict[str, torch.Tensor]] | None:
        # FSDP1's optim_state_dict under the default FULL_STATE_DICT: full tensors on every rank.
        osd = importlib.import_module(self.api).FullyShardedDataParallel.optim_state_dict(
            model, optim
        )
        return _named_tensors(osd)


def _named_tensors(osd: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """An optimizer state dict's per-parameter tensors (not scalars such as ``step``), by name."""
    return {
        name: {
            k: full_tensor(v.detach()).clone()
            for k, v in per.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
        for name, per in osd["state"].items()
    }
