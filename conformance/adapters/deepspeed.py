"""The adapter for DeepSpeed ZeRO (``deepspeed.initialize``): stages 0-3, CPU and NVMe offload.

The suite's strategies map onto ZeRO stages (``STAGE_OF``: NO_SHARD 0, SHARD_OPTIM 1, SHARD_GRAD_OP
2, FULL_SHARD 3) and its features onto a DeepSpeed config (``ds_config``); what DeepSpeed has no
equivalent for is declined by ``deepspeed_unsupported_reason``, decided from the case alone. The
engine owns the step (``engine.backward`` / ``engine.step``); full tensors come from
``deepspeed.utils.safe_get_full_*``, and the state-dict round trip goes through
``engine.save_checkpoint`` / ``load_checkpoint``. This is the only file that imports deepspeed, and
only inside methods, so listing cases and the unit tests need no deepspeed. docs/deepspeed.md has
the results.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conformance.adapters.base import Adapter, Unsupported, WrapRequest, clean_name
from conformance.matrix import FEATURES, Case
from conformance.zoo import BATCH_SIZE

__all__ = [
    "STAGE_OF",
    "DeepSpeedAdapter",
    "DeepSpeedConfigOptimizerAdapter",
    "DeepSpeedModel",
    "DeepSpeedTorchLinearAdapter",
    "deepspeed_unsupported_reason",
    "ds_config",
]

# ZeRO (arXiv 1910.02054): stage 1 partitions optimizer state, 2 also gradients, 3 also params.
log = logging.getLogger("conformance")

STAGE_OF = {"NO_SHARD": 0, "SHARD_OPTIM": 1, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3}
CHECKPOINT_TAG = "conformance"

_NO_PREFETCH_SWITCH = (
    "DeepSpeed has no per-module prefetch setting: ZeRO-3 prefetches by bucket size "
    "(stage3_prefetch_bucket_size) in forward and backward alike, and stages 0-2 gather nothing"
)
# Why each feature DeepSpeed has no equivalent for is declined, whatever the stage.
_FEATURE_REASONS = {
    "clip_grad_norm": (
        "DeepSpeed clips inside engine.step() (config gradient_clipping), after the point where "
        "the suite reads the clipped gradients and the norm clip_grad_norm_ returned"
    ),
    "clip_grad_norm_inf": (
        "DeepSpeed clips inside engine.step() (config gradient_clipping, a 2-norm), after the "
        "point where the suite reads the clipped gradients and the norm clip_grad_norm_ returned"
    ),
    "accumulate": (
        "DeepSpeed accumulates by its config (gradient_accumulation_steps): engine.step() "
        "between micro-batches is no step, and the suite's loop steps once per step"
    ),
    "sharded_checkpoint": (
        "DeepSpeed saves with engine.save_checkpoint (its own per-rank files), not "
        "torch.distributed.checkpoint: the adapter's round trip already goes through it"
    ),
    "checkpoint_outside_unit": (
        "DeepSpeed's ZeRO-3 hooks fetch parameters per submodule; a checkpoint_wrapper around "
        "a block is not mapped yet"
    ),
    "backward_prefetch_pre": _NO_PREFETCH_SWITCH,
    "backward_prefetch_post": _NO_PREFETCH_SWITCH,
    "backward_prefetch_none": _NO_PREFETCH_SWITCH,
    "forward_prefetch": _NO_PREFETCH_SWITCH,
}


def deepspeed_unsupported_reason(case: Case) -> str | None:
    """Why DeepSpeed has no equivalent of ``case``, or None: decided from the case alone."""
    if case.strategy not in STAGE_OF:
        return f"DeepSpeed ZeRO has no {case.strategy}: stages map to {sorted(STAGE_OF)}"
    if case.precision == "fp16":
        return (
            "DeepSpeed's fp16 scales the loss inside engine.backward with its own dynamic scaler; "
            "the suite's fp16 loop drives a GradScaler (make_grad_scaler), which DeepSpeed has not"
        )
    if case.precision == "bf16r32":
        return (
            "the adapter maps only reduce dtype = param dtype (data_types.grad_accum_dtype bf16); "
            "bf16 params with fp32 reduction is not judged yet"
        )
    if case.feature in _FEATURE_REASONS:
        return _FEATURE_REASONS[case.feature]
    stage, feature = STAGE_OF[case.strategy], FEATURES[case.feature]
    if feature.micro_batches > 1 and stage >= 2:
        # engine.no_sync() asserts "no_sync context manager is incompatible with gradient
        # partitioning logic of ZeRO stage 2/3": those stages reduce every micro-batch.
        return f"DeepSpeed's engine.no_sync() is incompatible with ZeRO stage {stage}"
    if (feature.cpu_offload or feature.disk_offload) and stage != 3:
        return f"DeepSpeed offloads parameters (offload_param) under ZeRO-3 only, not stage {stage}"
    if feature.optimizer_offload is not None and stage == 0:
        # With stage 0 the client optimizer runs unwrapped: offload_optimizer would be ignored.
        return "DeepSpeed's offload_optimizer needs a ZeRO optimizer (stage 1 or above)"
    if feature.optimizer_offload == "disk" and stage != 3:
        # stage_1_and_2.py: cpu_offload = (offload_optimizer.device != none), so "nvme" runs the
        # CPU path and the state never reaches the disk; NVMe swapping is ZeRO-3's (stage3.py).
        return (
            f"DeepSpeed's ZeRO stage {stage} treats offload_optimizer device nvme as cpu (no "
            "swapping to disk); NVMe optimizer offload is ZeRO-3's"
        )
    return None


def ds_config(
    case: Case,
    scratch_dir: str,
    optimizer: tuple[str, dict[str, Any]] | None = None,
    memory_efficient_linear: bool | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for ``case``.

    Args:
        case: a case ``deepspeed_unsupported_reason`` accepts.
        scratch_dir: the case's directory; NVMe offload swaps into subdirectories of it.
        optimizer: None to pass the suite's torch optimizer as DeepSpeed's client optimizer (no
            JIT-built op); or (type, params) for DeepSpeed to build from its config.
        memory_efficient_linear: ZeRO-3's setting; None keeps DeepSpeed's default (True), under
            which ZeRO-3 replaces torch.nn.functional.linear by matmul + add.

    Returns:
        A dict for ``deepspeed.initialize(config=...)``.
    """
    stage, feature = STAGE_OF[case.strategy], FEATURES[case.feature]
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # By default ZeRO-3 keeps every parameter under 1e5 elements whole on every rank (and off
        # the offload device): all of the suite's small models. 0 partitions and offloads them all.
        zero["stage3_param_persistence_threshold"] = 0
        if memory_efficient_linear is not None:
            zero["memory_efficient_linear"] = memory_efficient_linear
    if feature.cpu_offload:
        zero["offload_param"] = {"device": "cpu"}
    if feature.disk_offload:
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": os.path.join(scratch_dir, "offload_param"),
            # Swap buffers of 2^21 elements (the largest zoo parameter has 1,049,344): DeepSpeed's
            # default, 5 x 1e8, pins 2 GB per engine, and a run builds two engines per case.
            "buffer_size": 2**21,
        }
    if feature.optimizer_offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif feature.optimizer_offload == "disk":
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": os.path.join(scratch_dir, "offload_optimizer"),
        }
    config: dict[str, Any] = {
        # Bookkeeping only: every rank's batch is what the suite feeds it.
        "train_micro_batch_size_per_gpu": BATCH_SIZE,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # DeepSpeed clips at norm 1.0 unless told (constants.py GRADIENT_CLIPPING_DEFAULT); the
        # suite's loop clips only in clip_grad_norm. Found by this suite: see docs/deepspeed.md.
        "gradient_clipping": 0.0,
        # torch's SGD is not on DeepSpeed's list of ZeRO-tested optimizers.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # no progress lines between the suite's
    }
    if case.precision == "bf16":
        config["bf16"] = {"enabled": True}
        # The suite's bf16 is MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=bf16): reduce
        # and accumulate gradients in bf16 (DeepSpeed's ZeRO default is fp32) and cast buffers.
        config["data_types"] = {"grad_accum_dtype": "bf16", "buffer_dtype": "bf16"}
    if optimizer is None:
        # With offload DeepSpeed refuses a client optimizer other than its JIT-built CPUAdam unless
        # told; the suite's SGD is the point, and building CPUAdam costs minutes.
        config["zero_force_ds_cpu_optimizer"] = False
    else:
        config["optimizer"] = {"type": optimizer[0], "params": optimizer[1]}
    return config


def _optimizer_spec(make_optimizer) -> tuple[str, dict[str, Any]]:
    """(type name, defaults) of the suite's optimizer, for DeepSpeed to build it by name."""
    probe = make_optimizer([nn.Parameter(torch.zeros(1))])
    return type(probe).__name__, dict(probe.defaults)


class DeepSpeedModel(nn.Module):
    """One DeepSpeed engine as one case drives it; lives as long as the suite's model does.

    Calling it casts floating-point inputs to the engine's dtype under bf16 (DeepSpeed leaves that
    to the user) and runs the engine with the ``torch.nn.functional.linear`` DeepSpeed chose: ZeRO-3
    replaces that function for the whole process (memory_efficient_linear), so the adapter puts
    torch's back after ``initialize`` and swaps DeepSpeed's in only while its engine runs, lest it
    change the references and every later case.
    """

    def __init__(
        self, engine: nn.Module, stage: int, checkpoint_dir: str, ds_linear, input_dtype
    ) -> None:
        super().__init__()
        self.engine = engine
        self.stage = stage
        self.checkpoint_dir = checkpoint_dir
        self.ds_linear = ds_linear
        self.input_dtype = input_dtype  # None under fp32

    @contextlib.contextmanager
    def deepspeed_linear(self) -> Iterator[None]:
        torch_linear = F.linear
        F.linear = self.ds_linear
        try:
            yield
        finally:
            F.linear = torch_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_dtype is not None and x.is_floating_point():
            x = x.to(self.input_dtype)
        with self.deepspeed_linear():
            return self.engine(x)


class DeepSpeedAdapter(Adapter):
    """DeepSpeed as its users get it, with the suite's torch SGD as the client optimizer."""

    name = "deepspeed"
    description = "deepspeed.initialize, ZeRO stages 0-3, torch SGD as the client optimizer"
    # True: DeepSpeed builds the optimizer from its config ("optimizer": {"type": "SGD", ...}) and
    # keeps zero_force_ds_cpu_optimizer at its default, which with offload wants a JIT-built op.
    optimizer_from_config: ClassVar[bool] = False
    memory_efficient_linear: ClassVar[bool | None] = None  # None: DeepSpeed's default (True)

    def strategies(self) -> list[str]:
        return list(STAGE_OF)

    def features(self) -> list[str]:
        return ["offload_optimizer", "disk_offload", "disk_offload_optimizer"]

    def optimizers(self) -> list[str]:
        # The engine builds the client optimizer from bare parameters (no names for Muon's
        # split), and AdamW has not been run against DeepSpeed here.
        return ["sgd"]

    def unsupported_reason(self, case: Case) -> str | None:
        return deepspeed_unsupported_reason(case)

    def wrap(self, model: nn.Module, request: WrapRequest) -> nn.Module:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed logs every engine's setup at INFO on rank 0: hundreds of lines per run.
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        accelerator = get_accelerator().device_name()
        if accelerator != request.device.type:
            raise Unsupported(
                f"DeepSpeed's accelerator is {accelerator!r} but the suite runs on "
                f"{request.device.type!r} (set DS_ACCELERATOR)"
            )
        if request.disk_offload or request.optimizer_offload == "disk":
            reason = _async_io_unavailable()
            if reason is not None:
                raise Unsupported(reason)
        if request.make_optimizer is None or request.scratch_dir is None:
            raise ValueError("the DeepSpeed adapter needs request.make_optimizer and scratch_dir")
        case = request.case
        optimizer = _optimizer_spec(request.make_optimizer) if self.optimizer_from_config else None
        config = ds_config(case, request.scratch_dir, optimizer, self.memory_efficient_linear)
        # DeepSpeed insists on LOCAL_RANK, which torchrun sets; ranks spawned otherwise (the
        # tests' run_ranks) are on one host, where it is the rank.
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        # The suite's process group is initialized already; deepspeed.comm wraps the default one.
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        torch_linear = F.linear
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=list(model.parameters()),
                optimizer=None if optimizer else request.make_optimizer,
                config=config,
                dist_init_required=False,
            )
            ds_linear = F.linear
            log.debug("DeepSpeed's F.linear for %s: %r", case.name, ds_linear)
        finally:
            F.linear = torch_linear  # see DeepSpeedModel
        return DeepSpeedModel(
            engine,
            STAGE_OF[case.strategy],
            os.path.join(request.scratch_dir, "checkpoint"),
            ds_linear,
            request.param_dtype,
        )

    def make_optimizer(self, model: nn.Module, make) -> torch.optim.Optimizer:
        return model.engine.optimizer  # the engine built it in wrap

    # ---- the training loop's hooks -----------------------------------------------------------

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.engine.no_sync()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        with model.deepspeed_linear():  # activation checkpointing recomputes in backward
            model.engine.backward(loss)

    def step(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        model.engine.step()  # steps and zeroes the gradients

    # ---- full tensors ----------------------------------------------------------------------------

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        masters = _unsharded_masters(model.engine)
        out = {}
        for name, p in model.engine.module.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is None:
                full = masters.get(id(p)) if p.requires_grad else None
            out[clean_name(name)] = (_module_param(p) if full is None else full).detach().clone()
        return out

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        from deepspeed.utils import safe_get_full_grad

        out: dict[str, torch.Tensor | None] = {}
        for name, p in model.engine.module.named_parameters():
            grad = safe_get_full_grad(p) if p.requires_grad else None
            out[clean_name(name)] = None if grad is None else grad.detach().float().clone()
        return out

    def full_optim_state(
        self, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, dict[str, torch.Tensor]]:
        from deepspeed.utils import safe_get_full_optimizer_state

        engine = model.engine
        basic = engine.basic_optimizer  # the torch optimizer, over DeepSpeed's partitions if any
        keys = sorted(
            {
                k
                for per_param in basic.state.values()
                for k, v in per_param.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0  # not the scalar "step"
            }
        )
        masters = _unsharded_masters(engine)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            per: dict[str, torch.Tensor] = {}
            for key in keys:
                full = safe_get_full_optimizer_state(p, key)
                if full is None:  # stage 0: the torch optimizer's own state, by its parameter
                    full = basic.state.get(masters.get(id(p), p), {}).get(key)
                if full is not None:
                    per[key] = full.detach().clone()
            if per:
                out[clean_name(name)] = per
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Saved with ``engine.save_checkpoint`` and read back from its files (fp32 weights)."""
        engine = model.engine
        engine.save_checkpoint(model.checkpoint_dir, tag=CHECKPOINT_TAG)
        dist.barrier()  # rank 0's files are written before any rank reads them
        if model.stage == 0:
            # No ZeRO files: the module's own state is the checkpoint's.
            path = os.path.join(model.checkpoint_dir, CHECKPOINT_TAG, "mp_rank_00_model_states.pt")
            # weights_only: no load in conformance/ may run code from a file (issue 24); stage 0's
            # file holds tensors and plain values only (fp32 and bf16 checked with 0.19.8).
            state_dict = torch.load(path, map_location="cpu", weights_only=True)["module"]
            if model.input_dtype is not None:
                # Under bf16 the module holds bf16 weights; the fp32 master is in BF16_Optimizer's
                # files, which zero_to_fp32 cannot parse (it wants ZeRO's param_shapes): read the
                # master through safe_get_full_fp32_param instead.
                state_dict.update(self.full_params(model))
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            # It prints its progress (print and tqdm) on every rank.
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                state_dict = get_fp32_state_dict_from_zero_checkpoint(
                    model.checkpoint_dir, tag=CHECKPOINT_TAG
                )
        return {
            clean_name(k): v.detach().clone()
            for k, v in state_dict.items()
            if isinstance(v, torch.Tensor)
        }

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads the checkpoint ``full_state_dict`` saved (``state_dict`` is what was read from it),
        without its optimizer state: the suite's references step with a fresh optimizer."""
        load_path, _ = model.engine.load_checkpoint(
            model.checkpoint_dir,
            tag=CHECKPOINT_TAG,
            load_optimizer_states=False,
            load_lr_scheduler_states=False,
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {model.checkpoint_dir}")


class DeepSpeedTorchLinearAdapter(DeepSpeedAdapter):
    """ZeRO-3 with ``memory_efficient_linear: false``: torch's own F.linear (stages 0-2 as above)."""

    name = "deepspeed_torch_linear"
    description = "deepspeed, ZeRO-3 with memory_efficient_linear false"
    memory_efficient_linear = False


class DeepSpeedConfigOptimizerAdapter(DeepSpeedAdapter):
    """The optimizer built by DeepSpeed from its config, offload checks at DeepSpeed's defaults."""

    name = "deepspeed_config_optimizer"
    description = "deepspeed, optimizer from the DeepSpeed config, zero_force_ds_cpu_optimizer on"
    optimizer_from_config = True


def _unsharded_masters(engine: nn.Module) -> dict[int, torch.Tensor]:
    """Stage 0 under bf16: id(module param) -> its fp32 master in DeepSpeed's FP16_UnfusedOptimizer
    (``fp16_groups`` / ``fp32_groups``), which the safe_get_full_* helpers do not reach."""
    optimizer = engine.optimizer
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not (isinstance(low, list) and isinstance(high, list)):
        return {}
    return {
        id(lp): hp
        for lp_group, hp_group in zip(low, high)
        if isinstance(lp_group, list) and isinstance(hp_group, list)
        for lp, hp in zip(lp_group, hp_group)
    }


def _module_param(p: nn.Parameter) -> torch.Tensor:
    """The module's own copy of ``p``, gathered whole under ZeRO-3 (frozen params have no fp32
    master there; under bf16 this is the bf16 copy, widened)."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().float().clone()
    return p.detach().float()


@functools.cache  # compiling the probe takes a second; the answer is the machine's
def _async_io_unavailable() -> str | None:
    """Why DeepSpeed's async_io op (NVMe offload) cannot build here, or None."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None:
        return "DeepSpeed has no async_io op (NVMe offload) for this accelerator"
    if not builder.is_compatible():
        return (
            "DeepSpeed's async_io op (NVMe offload) cannot build here: it needs libaio's headers "
            "and library (apt-get install libaio-dev)"
        )
    return None
