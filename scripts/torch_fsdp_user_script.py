"""A training script written for torch.distributed.fsdp, as a user would write it.

tests/test_swap_in.py runs it as it is and with only its imports switched to fsdp_lite, and compares
the losses. Run it yourself: torchrun --nproc_per_node 2 scripts/torch_fsdp_user_script.py OUT.json
"""

import functools
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from conformance.models import Block, GPTConfig, TinyLM
from fsdp_lite.tools.launch import leave_together

ACCUMULATION = 2


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM(GPTConfig())
    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(4):
        for micro in range(ACCUMULATION):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            tokens = torch.randint(0, 61, (4, 17), generator=g)
            sync = micro == ACCUMULATION - 1
            context = model.no_sync() if not sync else torch.enable_grad()
            with context:
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)
                )
                (loss / ACCUMULATION).backward()
        norm = model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        losses.append([loss.item(), norm.item()])
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)
    leave_together()  # every rank, then gloo's threads at rest (launch.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
