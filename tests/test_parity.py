"""Whole training steps against DDP and against one process fed the global batch.

After every step each rank compares its loss, every gradient shard and every parameter shard with
the references' rows for that rank. SGD with momentum, because Adam would hide a wrong grad scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import BackwardPrefetch, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from tests.parity import (
    POLICIES,
    assert_close,
    build_model,
    global_batch,
    local,
    loss_fn,
    rank_batch,
    shard_of,
)
from tests.ranks import run_ranks

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIM"]
MODELS = ["mlp", "lm", "nested"]
STEPS = 3

# Against DDP, (rtol, atol) by world size. At 2 ranks the arithmetic is the same (multiply by 1/2,
# then a + b in either order), so equality is exact. At 3 ranks gloo's reduce-scatter adds the three
# contributions in a different order than its all-reduce does, so a gradient may differ in its last
# bit; momentum SGD carries that into params. Bound measured over these models and steps.
VS_DDP = {2: (0.0, 0.0), 3: (1e-6, 1e-7)}
# Against one process on the global batch: a mean over 4N samples versus N means over 4 samples,
# averaged; the sums run in different orders. Bound measured over these models and steps.
VS_SINGLE = (1e-5, 1e-6)


def _parity_rank(
    rank: int, world_size: int, strategy_name: str, model_name: str, options: dict | None = None
) -> dict:
    strategy = ShardingStrategy[strategy_name]
    ddp = DDP(build_model(model_name))
    fsdp = FSDP(
        build_model(model_name),
        sharding_strategy=strategy,
        auto_wrap_policy=POLICIES[model_name],
        **(options or {}),
    )
    single = build_model(model_name)
    models = {"ddp": ddp, "fsdp": fsdp, "single": single}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    ddp_params = dict(ddp.module.named_parameters())
    single_params = dict(single.named_parameters())
    fsdp_params = dict(fsdp.named_parameters())
    assert sorted(fsdp_params) == sorted(ddp_params), "parameter names differ from the module's"
    exact = dict(zip(("rtol", "atol"), VS_DDP[world_size]))
    loose = dict(zip(("rtol", "atol"), VS_SINGLE))
    worst = {"vs_ddp": 0.0, "vs_single": 0.0}

    def check(actual, name, step, stage, ref_full_ddp, ref_full_single):
        is_sharded = hasattr(actual, "to_local")
        want_ddp = shard_of(ref_full_ddp, rank, world_size) if is_sharded else ref_full_ddp
        want_single = shard_of(ref_full_single, rank, world_size) if is_sharded else ref_full_single
        got = local(actual).detach()
        what = f"rank {rank} step {step} {stage} of {name!r} ({strategy_name}, {model_name})"
        assert_close(got, want_ddp.detach(), what=f"{what} vs DDP", **exact)
        assert_close(got, want_single.detach(), what=f"{what} vs single process", **loose)
        if got.numel():
            worst["vs_ddp"] = max(worst["vs_ddp"], (got - want_ddp).abs().max().item())
            worst["vs_single"] = max(worst["vs_single"], (got - want_single).abs().max().item())

    for step in range(STEPS):
        x, y = rank_batch(model_name, step, rank, world_size)
        losses = {}
        for key in ("ddp", "fsdp"):
            losses[key] = loss_fn(model_name, models[key](x), y)
            losses[key].backward()
        gx, gy = global_batch(model_name, step, world_size)
        losses["single"] = loss_fn(model_name, single(gx), gy)
        losses["single"].backward()

        assert_close(losses["fsdp"], losses["ddp"], what=f"step {step} loss vs DDP", **exact)
        mean_loss = losses["fsdp"].detach().clone()
        dist.all_reduce(mean_loss)
        assert_close(
            mean_loss / world_size,
            losses["single"].detach(),
            what=f"step {step} mean loss",
            **loose,
        )
        for name, p in fsdp_params.items():
            assert p.grad is not None, f"step {step}: {name!r} has no gradient"
            check(p.grad, name, step, "grad", ddp_params[name].grad, single_params[name].grad)
        for key in models:
            optims[key].step()
            optims[key].zero_grad()
        for name, p in fsdp_params.items():
            check(p, name, step, "param", ddp_params[name], single_params[name])
    return worst


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_training_steps_match_ddp_and_single_process(
    tmp_path, strategy_name, model_name, world_size
):
    worst = run_ranks(
        _parity_rank, world_size, tmp_path, args=(strategy_name, model_name), timeout=180
    )
    if world_size == 2:
        assert all(w["vs_ddp"] == 0.0 for w in worst), f"not bitwise equal to DDP: {worst}"


@pytest.mark.parametrize(
    "options",
    [
        {"forward_prefetch": True},
        {"backward_prefetch": BackwardPrefetch.BACKWARD_POST},
        {"backward_prefetch": None},
    ],
    ids=["forward_prefetch", "backward_post", "no_prefetch"],
)
def test_prefetch_modes_change_timing_not_numbers(tmp_path, options):
    worst = run_ranks(_parity_rank, 2, tmp_path, args=("FULL_SHARD", "lm", options), timeout=180)
    assert all(w["vs_ddp"] == 0.0 for w in worst), f"not bitwise equal to DDP: {worst}"
