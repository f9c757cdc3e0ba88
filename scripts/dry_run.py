"""Shard a 7.5B-parameter GPT for 1024 ranks in one process, and compare with the planner.

torch's fake process group stands in for 1024 ranks (its collectives move nothing), and the model is
built on the meta device; ``param_init_fn`` leaves the values unset, so no rank's memory is touched
beyond its own shard. What it reports is what the real sharding code produced for one rank.

    python scripts/dry_run.py [--world-size 1024] [--rank 3] [--layers 36] [--d-model 4096]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from conformance.models import Block, GPTConfig, TinyLM
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.tools.estimate import estimate
from fsdp_lite.tools.launch import leave_together
from fsdp_lite.wrap import transformer_auto_wrap_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world_size)
    cfg = GPTConfig(
        vocab_size=50304,
        seq_len=2048,
        d_model=args.d_model,
        n_heads=args.d_model // 128,
        n_layers=args.layers,
        d_ff=4 * args.d_model,
    )
    with torch.device("meta"):
        model = TinyLM(cfg)
    start = time.perf_counter()
    sharded = FSDP(
        model,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        device_id=torch.device("cpu"),
        param_init_fn=lambda module: None,  # shapes and bytes only: leave the values unset
    )
    seconds = time.perf_counter() - start
    numel = sum(p.numel() for p in sharded.parameters())  # global shapes: the model's size
    local_numel = sum(p.to_local().numel() for p in sharded.parameters())
    plan = estimate(numel, args.world_size)["FULL_SHARD"]  # fp32 params, as built here
    result = {
        "params": numel,
        "world_size": args.world_size,
        "rank": args.rank,
        "units": len(FSDP.fsdp_modules(sharded)),
        "shard_nbytes": local_numel * 4,
        "planner_param_nbytes": plan.param_nbytes,
        "wrap_seconds": round(seconds, 2),
    }
    leave_together()
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(result))
        return
    print(f"{numel / 1e9:.2f}B params, {result['units']} units, world size {args.world_size}")
    print(f"rank {args.rank} shard bytes: {result['shard_nbytes']:,} (sharding code)")
    print(f"planner param bytes:   {plan.param_nbytes:,.0f} (Ψ·4/N)")
    print(f"wrapped in {seconds:.1f} s")


if __name__ == "__main__":
    main()
