"""ZeRO-1 (``ShardingStrategy.SHARD_OPTIM``): whole params and grads, 1/N optimizer state.

One 2-rank job checks, on the transformer zoo model with one unit per block:
- AdamW steps equal DDP's bitwise (the math is the same: all-reduce, then the same update per row);
- the collectives: one all-reduce per unit per backward, never an all-gather in backward, and an
  all-gather in forward only after the shards changed (an optimizer step, a loaded state dict);
- optimizer-state bytes per rank = DDP's / N, up to the padding of the last rows.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from fsdp_lite.trace import record_collectives
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks

STEPS = 3


def _optim_state_nbytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (shards count their local part)."""
    return sum(
        local(v).numel() * v.element_size()
        for state in optim.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # AdamW's scalar step is not per-param
    )


def _zero1_rank(rank: int, world_size: int) -> dict:
    ddp = DDP(build_model("lm"))
    zero1 = FSDP(
        build_model("lm"),
        sharding_strategy=ShardingStrategy.SHARD_OPTIM,
        auto_wrap_policy=POLICIES["lm"],
    )
    units = len(FSDP.fsdp_modules(zero1))
    optims = {
        "ddp": torch.optim.AdamW(ddp.parameters(), lr=1e-2),
        "zero1": torch.optim.AdamW(zero1.parameters(), lr=1e-2),
    }
    ddp_params = dict(ddp.module.named_parameters())
    counts = []
    for step in range(STEPS):
        x, y = rank_batch("lm", step, rank, world_size)
        with record_collectives(zero1) as trace:
            loss = loss_fn("lm", zero1(x), y)
            forward_gathers = trace.count("all_gather", "forward")
            loss.backward()
        counts.append(
            (forward_gathers, trace.count("all_gather", "backward"), trace.count("all_reduce"))
        )
        ddp_loss = loss_fn("lm", ddp(x), y)
        ddp_loss.backward()
        assert_close(loss, ddp_loss, what=f"step {step} loss", rtol=0, atol=0)
        for key in optims:
            optims[key].step()
            optims[key].zero_grad()
        for name, p in zero1.named_parameters():
            want = shard_of(ddp_params[name].detach(), rank, world_size)
            assert_close(local(p).detach(), want, what=f"step {step} {name}", rtol=0, atol=0)

    # Every unit gathers in the first forward and after each step; backward never gathers.
    assert counts == [(units, 0, units)] * STEPS, counts

    # No step since the last gather: forward and eval run on the params already there.
    x, _ = rank_batch("lm", 0, rank, world_size)
    with record_collectives(zero1) as trace, torch.no_grad():
        zero1(x)
        zero1(x)
    assert trace.count("all_gather") == units, "stepped shards must be gathered once, then reused"
    with record_collectives(zero1) as trace, torch.no_grad():
        out = zero1(x)
    assert trace.count("all_gather") == 0

    # Loading a state dict changes the shards without the optimizer: the next forward sees it.
    # The zeroed shards are gathered first, so stale params would give another output.
    state = zero1.state_dict()
    with torch.no_grad():
        for p in zero1.parameters():
            p.zero_()
        zero1(x)
    zero1.load_state_dict(state)
    with record_collectives(zero1) as trace, torch.no_grad():
        assert torch.equal(zero1(x), out), "forward after load_state_dict used stale params"
    assert trace.count("all_gather") == units, "loaded shards must be gathered again"

    return {
        "units": units,
        "ddp_optim_bytes": _optim_state_nbytes(optims["ddp"]),
        "zero1_optim_bytes": _optim_state_nbytes(optims["zero1"]),
        # AdamW keeps two fp32 tensors per param; rank 0 holds the most rows (ceil chunks).
        "bound_bytes": sum(2 * 4 * shard_of(p, 0, world_size).numel() for p in ddp.parameters()),
    }


def test_zero1_matches_ddp_and_keeps_one_nth_of_the_optimizer_state(tmp_path):
    results = run_ranks(_zero1_rank, 2, tmp_path, timeout=180)
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: AdamW state {r['zero1_optim_bytes']} B under SHARD_OPTIM vs "
            f"{r['ddp_optim_bytes']} B under DDP ({r['zero1_optim_bytes'] / r['ddp_optim_bytes']:.4f})"
        )
    ddp_bytes = results[0]["ddp_optim_bytes"]
    assert sum(r["zero1_optim_bytes"] for r in results) == ddp_bytes, "shards must tile the state"
    for r in results:  # 1/N of DDP's, up to the padding of uneven dim 0s
        assert r["zero1_optim_bytes"] <= r["bound_bytes"] < ddp_bytes / 2 * 1.01, r
