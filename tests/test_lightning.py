"""Lightning's Trainer on fsdp_lite, against Lightning's DDP on the same LightningModule.

Two routes (docs/integrations.md): Lightning's own ``ModelParallelStrategy`` with
``fsdp_lite.fully_shard`` in ``configure_model`` (FSDP2), and ``FSDPLiteStrategy`` /
``strategy="fsdp_lite"`` (fsdp_lite.integrations.lightning, the FSDP1 front). One 2-rank launch
trains every run (4 optimizer steps: 2 epochs of 2 steps, each accumulating 2 micro-batches,
gradients clipped) and then checks them: losses and weights against DDP, bitwise where the
arithmetic is DDP's; a resume from the checkpoint written after epoch 1 against the uninterrupted
run; Lightning's consolidation of a sharded checkpoint against the trained weights; a checkpoint
of Lightning's own FSDPStrategy (torch's FSDP1) resumed under fsdp_lite.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")  # declared in the test extra

from lightning_fabric.utilities.load import _load_distributed_checkpoint  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.strategies import (  # noqa: E402
    FSDPStrategy,
    ModelParallelStrategy,
    StrategyRegistry,
)
from pytorch_lightning.utilities.consolidate_checkpoint import _format_checkpoint  # noqa: E402
from pytorch_lightning.utilities.exceptions import MisconfigurationException  # noqa: E402

from fsdp_lite import FullStateDictConfig, MixedPrecision, StateDictType, fully_shard  # noqa: E402
from fsdp_lite import FullyShardedDataParallel as FSDP  # noqa: E402
from fsdp_lite.integrations import lightning as lite  # noqa: E402
from fsdp_lite.optim.grad_scaler import ShardedGradScaler  # noqa: E402
from fsdp_lite.wrap import wrap  # noqa: E402
from tests.ranks import run_checks, run_ranks  # noqa: E402

STEPS_PER_EPOCH = 2  # 32 samples, batches of 4, 2 ranks, 2 micro-batches per step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.lin(x)))


class Net(pl.LightningModule):
    """8 -> 16 -> two blocks -> 1 (the head's one row leaves a rank with padding only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, ModelParallelStrategy):  # the FSDP2 recipe
            mesh = self.device_mesh["data_parallel"]
            for block in self.net[1:3]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _weights(model: Net) -> dict[str, torch.Tensor]:
    """The LightningModule's full weights, on every rank."""
    strategy = model.trainer.strategy
    if isinstance(strategy, lite.FSDPLiteStrategy):
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        with FSDP.state_dict_type(strategy.model, StateDictType.FULL_STATE_DICT, config):
            state = strategy.model.state_dict()
    elif isinstance(strategy, FSDPStrategy):  # torch's FSDP1, the reference
        import torch.distributed.fsdp as native

        # offload_to_cpu=True, params on the CPU: a segfault in its param_hook (torch 2.13).
        config = native.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        kind = native.StateDictType.FULL_STATE_DICT
        with native.FullyShardedDataParallel.state_dict_type(strategy.model, kind, config):
            state = strategy.model.state_dict()
    else:
        state = model.state_dict()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in state.items()
    }


def _fit(
    strategy,
    precision: str,
    ckpt_dir: Path | None = None,
    resume: Path | None = None,
    clip: str = "value",
):
    """Train a new Net for 2 epochs (from ``resume``: its second epoch); save after each epoch
    into ``ckpt_dir``. Returns the model and its trainer.

    Gradients are clipped at 0.5, by ``clip``: "value" clamps each element, the same arithmetic
    on shards as on whole gradients; "norm" takes one norm over every gradient, which fsdp_lite
    sums in another order than torch.nn.utils.clip_grad_norm_ (a few ulps apart).
    """
    model = Net()
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        gradient_clip_algorithm=clip,
        callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _data(), ckpt_path=resume)
    return model, trainer


def _mp() -> ModelParallelStrategy:
    return ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )


# ---- the runs: each stores its losses and weights -------------------------------------------


def _record(results: dict, name: str, model: Net) -> None:
    results[name] = {"losses": model.losses, "weights": _weights(model)}


def train_ddp_fp32(results, tmp):
    model, trainer = _fit("ddp", "32-true", ckpt_dir=tmp / "ddp")
    _record(results, "ddp_fp32", model)
    results["ddp_fp32"]["val"] = trainer.validate(model, _data(), verbose=False)


def train_ddp_bf16(results, tmp):
    _record(results, "ddp_bf16", _fit("ddp", "bf16-mixed")[0])
    _record(results, "ddp_bf16_norm", _fit("ddp", "bf16-mixed", clip="norm")[0])


def train_mp_fp32(results, tmp):
    _record(results, "mp_fp32", _fit(_mp(), "32-true")[0])


def train_mp_bf16(results, tmp):
    _record(results, "mp_bf16", _fit(_mp(), "bf16-mixed", ckpt_dir=tmp / "mp")[0])
    resumed = _fit(_mp(), "bf16-mixed", resume=tmp / "mp" / "epoch=0.ckpt")[0]
    _record(results, "mp_bf16_resumed", resumed)


def train_lite_fp32(results, tmp):
    """Auto-wrapped blocks, activation checkpointing, a sharded checkpoint."""

    def strategy():
        return lite.FSDPLiteStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block},
            state_dict_type="sharded",
        )

    model, trainer = _fit(strategy(), "32-true", ckpt_dir=tmp / "lite")
    _record(results, "lite_fp32", model)
    checkpointed = [m for m in trainer.strategy.model.modules() if isinstance(m, CheckpointWrapper)]
    checkpointed = [type(m._checkpoint_wrapped_module).__name__ for m in checkpointed]
    results["lite_fp32"]["checkpointed"] = checkpointed
    units = [type(m.module).__name__ for m in FSDP.fsdp_modules(trainer.strategy.model)]
    results["lite_fp32"]["units"] = units
    results["lite_fp32"]["val"] = trainer.validate(model, _data(), verbose=False)
    resumed = _fit(strategy(), "32-true", resume=tmp / "lite" / "epoch=0.ckpt")[0]
    _record(results, "lite_fp32_resumed", resumed)


def train_lite_from_ddp(results, tmp):
    """DDP's full checkpoint (optimizer state keyed by position) resumed under fsdp_lite."""
    resumed = _fit(lite.FSDPLiteStrategy(), "32-true", resume=tmp / "ddp" / "epoch=0.ckpt")[0]
    _record(results, "lite_from_ddp", resumed)


class _TorchFSDP1(FSDPStrategy):
    """Lightning's FSDPStrategy on torch's FSDP1, as a reference: the Trainer refuses a CPU
    only to FSDPStrategy itself (fsdp_lite/integrations/lightning.py, Note [What this takes
    from Lightning 2.6.6])."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        # FSDPStrategy's, with the device torch's FSDP1 needs on a CPU (it passes index None).
        from torch.distributed.fsdp import FullyShardedDataParallel as NativeFSDP

        return NativeFSDP(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def train_torch_fsdp1(results, tmp):
    """A sharded checkpoint of Lightning's own FSDPStrategy, resumed under fsdp_lite."""
    policy = {Block}
    native = _fit(_TorchFSDP1(auto_wrap_policy=policy, state_dict_type="sharded"), "32-true",
                  ckpt_dir=tmp / "torch_fsdp1")[0]  # fmt: skip
    _record(results, "torch_fsdp1", native)
    resumed = _fit(lite.FSDPLiteStrategy(auto_wrap_policy=policy), "32-true",
                   resume=tmp / "torch_fsdp1" / "epoch=0.ckpt")[0]  # fmt: skip
    _record(results, "lite_from_torch_fsdp1", resumed)


def train_lite_bf16(results, tmp):
    """strategy="fsdp_lite", Lightning's bf16-mixed for FSDP, norm clipping, a full checkpoint."""
    model = _fit("fsdp_lite", "bf16-mixed", ckpt_dir=tmp / "lite_bf16", clip="norm")[0]
    _record(results, "lite_bf16", model)
    ckpt = tmp / "lite_bf16" / "epoch=0.ckpt"
    resumed = _fit("fsdp_lite", "bf16-mixed", resume=ckpt, clip="norm")[0]
    _record(results, "lite_bf16_resumed", resumed)


def train_lite_autocast(results, tmp):
    """bf16-mixed as autocast alone (fp32 params and reduction), as DDP's."""
    strategy = lite.FSDPLiteStrategy(mixed_precision=MixedPrecision())
    _record(results, "lite_autocast", _fit(strategy, "bf16-mixed")[0])


# In this order: a run may resume a checkpoint that one before it wrote.
RUNS = {name: f for name, f in globals().items() if name.startswith("train_")}


# ---- the checks ------------------------------------------------------------------------------


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key


def _resumed_like(uninterrupted: dict, resumed: dict) -> None:
    """The resumed run's micro-batches are the uninterrupted run's second epoch."""
    tail = {"losses": uninterrupted["losses"][2 * STEPS_PER_EPOCH :]}
    assert len(resumed["losses"]) == 2 * STEPS_PER_EPOCH
    _same({**tail, "weights": uninterrupted["weights"]}, resumed)


def check_mp_fp32_near_ddp(results, tmp):
    # Lightning's Trainer skips the gradient sync of accumulating micro-batches only on modules
    # with a no_sync() (DDP, FSDP1), not on fully_shard's: each micro-batch's gradients are
    # reduced, (a1 + b1)/2 + (a2 + b2)/2, where DDP sums locally first, ((a1 + a2) + (b1 + b2))/2.
    # Another association of the same fp32 sums: measured at most 2 ulps apart; 1e-5 is ~80.
    mp_run, ddp_run = results["mp_fp32"], results["ddp_fp32"]
    torch.testing.assert_close(mp_run["losses"], ddp_run["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(mp_run["weights"], ddp_run["weights"], rtol=1e-5, atol=1e-7)


def check_mp_bf16_is_ddp(results, tmp):
    # bf16-mixed here is autocast alone, as DDP's: the same bf16 matmuls on the same params, and
    # the micro-batches' gradients summed in another association, as above. Measured bitwise all
    # the same: most gradients come out of bf16 matmuls (8 significant bits), and fp32 sums of
    # a few such values are exact in any order.
    _same(results["mp_bf16"], results["ddp_bf16"])


def check_mp_resume(results, tmp):
    _resumed_like(results["mp_bf16"], results["mp_bf16_resumed"])


def check_mp_consolidated(results, tmp):
    # What `python -m lightning_fabric.utilities.consolidate_checkpoint` runs, in one process.
    if dist.get_rank() == 0:
        full = _load_distributed_checkpoint(tmp / "mp" / "epoch=1.ckpt")
        _plain_net_holds(full["state_dict"], results["mp_bf16"]["weights"])


def check_lite_fp32_is_ddp(results, tmp):
    # A unit per block (auto_wrap_policy), each block checkpointed inside its unit.
    assert results["lite_fp32"]["units"] == ["Net", "CheckpointWrapper", "CheckpointWrapper"]
    assert results["lite_fp32"]["checkpointed"] == ["Block", "Block"]
    _same(results["lite_fp32"], results["ddp_fp32"])
    assert results["lite_fp32"]["val"] == results["ddp_fp32"]["val"]


def check_lite_sharded_resume(results, tmp):
    _resumed_like(results["lite_fp32"], results["lite_fp32_resumed"])


def check_lite_consolidated(results, tmp):
    # What `python -m pytorch_lightning.utilities.consolidate_checkpoint` runs, in one process:
    # a full checkpoint as DDP would write it, optimizer state keyed by name.
    if dist.get_rank() == 0:
        full = _format_checkpoint(_load_distributed_checkpoint(tmp / "lite" / "epoch=1.ckpt"))
        _plain_net_holds(full["state_dict"], results["lite_fp32"]["weights"])
        (optim,) = full["optimizer_states"]
        assert sorted(optim["state"]) == sorted(results["lite_fp32"]["weights"])


def check_lite_resumes_ddp_checkpoint(results, tmp):
    _resumed_like(results["ddp_fp32"], results["lite_from_ddp"])


def check_torch_fsdp1_is_ddp(results, tmp):
    _same(results["torch_fsdp1"], results["ddp_fp32"])


def check_lite_resumes_torch_fsdp1_checkpoint(results, tmp):
    _resumed_like(results["torch_fsdp1"], results["lite_from_torch_fsdp1"])


def check_lite_bf16_near_ddp(results, tmp):
    # Lightning's bf16-mixed for FSDP also keeps params, buffers, the root's float inputs (the
    # targets too) and the gradient reduction in bf16, where DDP's autocast computes matmuls
    # only in bf16: inputs, targets and reduced gradients differ by bf16 roundings (relative
    # spacing 2**-8 = 0.4%). Measured: at most 0.7% apart over the 8 losses; 2% is 5 such steps.
    lite_run, ddp_run = results["lite_bf16"], results["ddp_bf16_norm"]
    assert lite_run["losses"] != ddp_run["losses"]  # the bf16 reduction is on
    torch.testing.assert_close(
        torch.tensor(lite_run["losses"]), torch.tensor(ddp_run["losses"]), rtol=2e-2, atol=0
    )


def check_lite_full_resume(results, tmp):
    _resumed_like(results["lite_bf16"], results["lite_bf16_resumed"])


def check_lite_autocast_is_ddp(results, tmp):
    _same(results["lite_autocast"], results["ddp_bf16"])


def check_enable_wrap_is_fsdp_lites(results, tmp):
    """``wrap`` in configure_model (Lightning's model_sharded_context) makes fsdp_lite wrappers."""
    strategy = lite.FSDPLiteStrategy(parallel_devices=[torch.device("cpu")] * 2)
    torch.manual_seed(0)
    with strategy.model_sharded_context():
        wrapped = wrap(nn.Linear(4, 4))
    assert isinstance(wrapped, FSDP)
    outer = nn.Sequential(wrapped)
    assert strategy._setup_model(outer) is outer  # wrapped by hand: kept as it is
    assert strategy._root is None


def _plain_net_holds(state_dict: dict, trained: dict) -> None:
    plain = Net()
    plain.load_state_dict(state_dict)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, trained[key]), key


CHECKS = {name: f for name, f in globals().items() if name.startswith("check_")}


def _lightning_rank(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    # Lightning joins the process group the launcher made: LOCAL_RANK tells it that the
    # processes are started outside it.
    os.environ["LOCAL_RANK"] = str(rank)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="pytorch_lightning|lightning_fabric")
    tmp = Path(tmp)
    results: dict = {}
    failures = run_checks(RUNS, list(RUNS), results, tmp)
    failures.update(run_checks(CHECKS, list(CHECKS), results, tmp))
    return failures


@pytest.mark.slow
def test_lightning_trains_on_fsdp_lite_like_ddp(tmp_path):
    failures = run_ranks(_lightning_rank, 2, tmp_path, args=(str(tmp_path),), timeout=240)
    report = {f"rank {r}: {name}": tb for r, f in enumerate(failures) for name, tb in f.items()}
    assert not report, "\n".join(f"{k}\n{v}" for k, v in report.items())


# ---- one process -----------------------------------------------------------------------------


def test_fsdp_lite_is_a_registered_strategy_that_runs_on_cpu():
    assert {"fsdp_lite", "fsdp_lite_cpu_offload"} <= set(StrategyRegistry.available_strategies())
    # Lightning refuses its FSDP names without CUDA: fsdp_lite's must not be among them.
    assert "fsdp_lite" not in FSDPStrategy.get_registered_strategies()
    with pytest.raises(ValueError, match="requires a GPU"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="fsdp_lite_cpu_offload", logger=False
    )
    assert isinstance(trainer.strategy, lite.FSDPLiteStrategy)
    assert trainer.strategy.cpu_offload.offload_params
    # The Trainer hands every FSDPStrategy a plain FSDPPrecision: ours takes its place.
    assert isinstance(trainer.strategy.precision_plugin, lite.FSDPLitePrecision)
    lite.register()  # again: no error


def test_bad_arguments_fail_when_the_strategy_is_made():
    with pytest.raises(ValueError, match="state_dict_type"):
        lite.FSDPLiteStrategy(state_dict_type="local")
    with pytest.raises(ValueError, match="sharding_strategy"):
        lite.FSDPLiteStrategy(sharding_strategy="ZERO_SHARD")
    with pytest.raises(TypeError, match="forward_prefetchh"):
        lite.FSDPLiteStrategy(forward_prefetchh=True)
    with pytest.raises(TypeError, match="device_id"):
        lite.FSDPLiteStrategy(device_id=0)
    with pytest.raises(TypeError, match="FSDPLitePrecision"):
        lite.FSDPLiteStrategy(precision_plugin=pl.plugins.precision.Precision())
    with pytest.raises(ValueError, match="precision"):
        lite.FSDPLitePrecision("64-true")
    with pytest.raises(ValueError, match="world size 1"):  # checked before the process group
        lite.FSDPLiteStrategy(
            sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)
        ).setup_environment()


class FullyShardedDataParallel(nn.Module):
    """Stands for torch's FSDP1 wrapper, known by its name (fsdp_lite imports nothing of it)."""


def test_a_model_sharded_by_another_fsdp_is_refused_before_wrapping():
    with pytest.raises(TypeError, match="'0' is sharded by torch's FullyShardedDataParallel"):
        lite.FSDPLiteStrategy()._setup_model(nn.Sequential(FullyShardedDataParallel()))


def test_precision_plugin_uses_fsdp_lites_configs_on_the_strategys_device():
    bf16 = lite.FSDPLitePrecision("bf16-mixed")
    assert bf16.mixed_precision_config == MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
    )
    bf16._attach(None, "cpu")
    with bf16.forward_context():
        assert torch.is_autocast_enabled("cpu")
    assert lite.FSDPLitePrecision("32-true").mixed_precision_config is None
    fp16 = lite.FSDPLitePrecision("16-mixed")
    fp16._attach(None, "cpu")
    assert isinstance(fp16.scaler, ShardedGradScaler) and fp16.scaler.is_enabled()  # on CPU
    with pytest.raises(MisconfigurationException, match="wrap the LightningModule"):
        bf16.clip_grad_by_norm(None, 1.0)  # no root wrapper: configure_model wrapped parts


def test_lightning_internals_are_the_ones_checked():
    """Note [What this takes from Lightning 2.6.6] in fsdp_lite/integrations/lightning.py: if a
    new release changes one of these, this fails first (pyproject.toml pins 2.6.6)."""
    from lightning_fabric.utilities.load import _METADATA_FILENAME
    from pytorch_lightning.plugins.precision import FSDPPrecision

    assert pl.__version__ == "2.6.6"
    # 1. FSDPStrategy.setup wraps through the hook FSDPLiteStrategy overrides.
    assert "self._setup_model(self.model)" in inspect.getsource(FSDPStrategy.setup)
    # 2. A subclass of FSDPStrategy runs on a CPU (also _TorchFSDP1 in the 2-rank test) and gets
    #    a plain FSDPPrecision (test_fsdp_lite_is_a_registered_strategy_that_runs_on_cpu), which
    #    for 16-mixed converts inputs as for 32-true (FSDPLitePrecision is made as the latter).
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=_TorchFSDP1(), logger=False)
    assert type(trainer.precision_plugin) is FSDPPrecision
    with warnings.catch_warnings():  # its torch scaler warns that there is no CUDA
        warnings.simplefilter("ignore")
        theirs = FSDPPrecision("16-mixed")
    ours, double = lite.FSDPLitePrecision("16-mixed"), torch.ones(1, dtype=torch.float64)
    assert ours.convert_input(double).dtype == theirs.convert_input(double).dtype
    with ours.tensor_init_context():
        dtype = torch.get_default_dtype()
    with theirs.tensor_init_context():
        assert dtype == torch.get_default_dtype()
    # 3. The name of a sharded checkpoint's metadata file.
    assert lite.METADATA_FILENAME == _METADATA_FILENAME
