"""A plain Lightning script, run as a user runs it (docs/integrations.md, the Lightning table):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \
        scripts/lightning_user_script.py {ddp|mp|fsdp_lite|fsdp_lite_sharded} {32-true|bf16-mixed} \
        [CHECKPOINT_OUT [RESUME_FROM [MAX_STEPS]]]

It prints the loss of each optimizer step (the last micro-batch's, mean of the ranks).
"""

import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fsdp_lite.integrations.lightning  # noqa: F401  registers strategy="fsdp_lite"
from fsdp_lite import fully_shard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, x):
        return x + torch.relu(self.norm(self.lin(x)))


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), *[Block() for _ in range(4)], nn.Linear(64, 1))

    def configure_model(self):
        if isinstance(self.trainer.strategy, ModelParallelStrategy):  # the FSDP2 recipe
            mesh = self.device_mesh["data_parallel"]
            for block in self.net[1:5]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero and (batch_idx + 1) % 2 == 0:  # one line per optimizer step
            print(
                f"step {trainer.global_step:2d} loss {trainer.callback_metrics['loss'].item():.7f}"
            )


name, precision = sys.argv[1], sys.argv[2]
strategy = {
    "ddp": "ddp",
    "mp": ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    ),
    "fsdp_lite": "fsdp_lite",
    "fsdp_lite_sharded": fsdp_lite.integrations.lightning.FSDPLiteStrategy(
        state_dict_type="sharded"
    ),
}[name]
trainer = pl.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=strategy,
    precision=precision,
    max_steps=int(sys.argv[5]) if len(sys.argv) > 5 else 8,
    accumulate_grad_batches=2,
    gradient_clip_val=1.0,
    callbacks=[PrintLoss()],
    enable_checkpointing=False,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Model()
trainer.fit(model, data(), ckpt_path=(sys.argv[4] or None) if len(sys.argv) > 4 else None)
if len(sys.argv) > 3:
    trainer.save_checkpoint(sys.argv[3])
    weights = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }
    if trainer.is_global_zero and name == "mp":
        torch.save(weights, sys.argv[3] + ".weights")
