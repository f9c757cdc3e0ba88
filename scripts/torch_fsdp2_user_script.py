"""A training script written for torch's FSDP2 (``fully_shard``), as a user would write it.

It does what pytorch/examples' FSDP2 example and torchtitan do: build the model on the meta device,
``fully_shard`` each block then the root with a bf16 ``MixedPrecisionPolicy``, prefetch two blocks
ahead explicitly, ``to_empty`` and initialize the shards, train with ``clip_grad_norm_`` and Adam,
save full state dicts (DCP's helpers, rank 0), then build a fresh meta model, load them back (the
model with ``distribute_tensor`` and ``load_state_dict(assign=True)``, the optimizer with
``set_optimizer_state_dict(broadcast_from_rank0=True)``) and train on. tests/test_swap_in.py runs
it as it is and with only its ``torch.distributed.fsdp`` import switched to fsdp_lite.

    torchrun --nproc_per_node 2 scripts/torch_fsdp2_user_script.py OUT.json CHECKPOINT_DIR
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from conformance.models import GPTConfig, TinyLM
from fsdp_lite.tools.launch import leave_together

# Untied: torch 2.13's set_optimizer_state_dict finds no state under the tied head's second name.
CONFIG = GPTConfig(
    vocab_size=61, seq_len=16, d_model=32, n_heads=2, n_layers=4, d_ff=64, tie_embeddings=False
)


def sharded_meta_model() -> TinyLM:
    with torch.device("meta"):
        model = TinyLM(CONFIG)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    assert isinstance(model, FSDPModule)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0) : i][::-1])
    return model


def initialize(model: TinyLM, seed: int) -> None:
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with torch.no_grad():
        model.pos.normal_(std=0.02)


def train(model: TinyLM, optim: torch.optim.Optimizer, steps: range, rank: int) -> list:
    losses = []
    for step in steps:
        model.unshard()  # the root's params now, as the example does before each forward
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append([loss.item(), norm.full_tensor().item()])
    return losses


def main(out_path: str, checkpoint_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = sharded_meta_model()
    initialize(model, seed=rank)  # each rank initializes its own shards
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = train(model, optim, range(3), rank)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optim, options=options)
    if rank == 0:
        torch.save(model_sd, os.path.join(checkpoint_dir, "model.pt"))
        torch.save(optim_sd, os.path.join(checkpoint_dir, "optim.pt"))
    dist.barrier()

    resumed = sharded_meta_model()
    full = torch.load(os.path.join(checkpoint_dir, "model.pt"), weights_only=True)
    meta_sd = resumed.state_dict()
    sharded = {
        name: nn.Parameter(
            distribute_tensor(value, meta_sd[name].device_mesh, meta_sd[name].placements)
        )
        for name, value in full.items()
    }
    resumed.load_state_dict(sharded, strict=False, assign=True)
    optim = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    full_optim = (
        torch.load(os.path.join(checkpoint_dir, "optim.pt"), weights_only=True) if rank == 0 else {}
    )
    set_optimizer_state_dict(
        resumed,
        optim,
        full_optim,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    losses += train(resumed, optim, range(3, 5), rank)

    final = get_model_state_dict(resumed, options=options)
    if rank == 0:
        sums = {k: v.double().sum().item() for k, v in final.items()}
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "state_sums": sums}, f)
    leave_together()  # every rank, then gloo's threads at rest (launch.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
