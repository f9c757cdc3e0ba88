"""Shapes and parameter uses that sharding gets wrong first, and optimizers other than SGD.

The quirky model has: dim 0 sizes that don't divide by the world size, a 1-element parameter
(fewer elements than ranks), a frozen weight beside a trainable bias in one unit, a layer called
twice in one forward, a layer never called, and an embedding tied to the output projection.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from fsdp_lite.wrap import lambda_auto_wrap_policy
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks


class Quirky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.weight.requires_grad_(False)
        self.twice = nn.Linear(7, 7)
        self.unused = nn.Linear(3, 3)
        self.tiny = nn.Parameter(torch.randn(1))
        self.emb = nn.Embedding(11, 7)
        self.out = nn.Linear(7, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.emb(idx)
        h = self.twice(torch.tanh(self.twice(h)))
        h = self.frozen(h) * self.tiny
        return self.out(h)


def _own_unit(module: nn.Module) -> bool:
    # Tied emb/out and the 1-element param stay in the root unit.
    return isinstance(module, nn.Linear) and module.out_features != 11


def _quirky_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (
        torch.randint(0, 11, (6,), generator=g),
        torch.randn(6, 5, generator=g),
        torch.randint(0, 11, (6,), generator=g),
    )


# At 3 ranks gloo sums reduce-scatter and all-reduce contributions in different orders (see
# test_parity.py); the bound is measured.
TOLERANCE = {2: dict(rtol=0.0, atol=0.0), 3: dict(rtol=1e-6, atol=1e-7)}


def _quirky_rank(rank: int, world_size: int, strategy_name: str) -> None:
    import functools

    ddp = DDP(Quirky(), find_unused_parameters=True)
    fsdp = FSDP(
        Quirky(),
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=_own_unit),
    )
    assert len(FSDP.fsdp_modules(fsdp)) == 5, "root + a, frozen, twice, unused"
    ref = dict(ddp.module.named_parameters())
    names = [n for n, _ in fsdp.named_parameters()]
    assert names == list(ref), (names, list(ref))
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    tol = TOLERANCE[world_size]
    for step in range(3):
        idx, x, target = _quirky_batch(rank, step)
        for model in (ddp, fsdp):
            nn.functional.cross_entropy(model(idx, x), target).backward()
        for name, p in fsdp.named_parameters():
            want = ref[name].grad
            what = f"rank {rank} step {step} grad {name} ({strategy_name})"
            if want is None:
                assert p.grad is None, f"{what}: DDP has no grad, fsdp_lite has one"
                continue
            assert p.grad is not None, f"{what}: missing"
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p.grad), want, what=what, **tol)
        for optim in (opt_ref, opt):
            optim.step()
            optim.zero_grad()
        for name, p in fsdp.named_parameters():
            want = ref[name].detach()
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            what = f"rank {rank} step {step} param {name} ({strategy_name})"
            assert_close(local(p).detach(), want, what=what, **tol)
    assert fsdp.unused.weight.grad is None and ref["unused.weight"].grad is None
    assert ref["frozen.weight"].grad is None and fsdp.frozen.weight.grad is None


@pytest.mark.parametrize(
    "strategy_name, world_size",
    [(s, 2) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")] + [("FULL_SHARD", 3)],
    ids=lambda v: str(v),
)
def test_uneven_frozen_reused_unused_and_tied_params_train_like_ddp(
    tmp_path, strategy_name, world_size
):
    run_ranks(_quirky_rank, world_size, tmp_path, args=(strategy_name,), timeout=120)


def test_shared_parameter_across_units_is_rejected(tmp_path):
    run_ranks(_tied_across_units_rank, 2, tmp_path, timeout=60)


def _tied_across_units_rank(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="is shared with a nested unit"):
        FSDP(
            model,
            auto_wrap_policy=lambda module, recurse, **kw: recurse or isinstance(module, nn.Linear),
        )


OPTIMIZERS = {
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
}


def _optimizers_rank(rank: int, world_size: int) -> None:
    for opt_name, make in OPTIMIZERS.items():
        ddp = DDP(build_model("lm"))
        fsdp = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"])
        opts = [make(ddp.parameters()), make(fsdp.parameters())]
        ref = dict(ddp.module.named_parameters())
        for step in range(2):
            x, y = rank_batch("lm", step, rank, world_size)
            for model, opt in zip((ddp, fsdp), opts):
                loss_fn("lm", model(x), y).backward()
                opt.step()
                opt.zero_grad()
            for name, p in fsdp.named_parameters():
                what = f"{opt_name} step {step} param {name}"
                assert_close(
                    local(p).detach(),
                    shard_of(ref[name].detach(), rank, world_size),
                    what=what,
                    rtol=0.0,
                    atol=0.0,
                )


def test_unmodified_torch_optimizers_step_shards_like_ddp(tmp_path):
    run_ranks(_optimizers_rank, 2, tmp_path, timeout=180)


class RankDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


def _rank_dependent_rank(rank: int, world_size: int) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        ddp = DDP(RankDependent(), find_unused_parameters=True)
        fsdp = FSDP(RankDependent(), sharding_strategy=ShardingStrategy[strategy])
        ref = dict(ddp.module.named_parameters())
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        for model in (ddp, fsdp):
            model(x, use_b=rank == 1).sum().backward()
        for name, p in fsdp.named_parameters():
            what = f"rank {rank} {strategy} grad {name}"
            assert p.grad is not None, f"{what}: another rank used it, so it has a gradient"
            want = ref[name].grad
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p.grad), want, what=what, rtol=0.0, atol=0.0)


def test_parameter_used_on_some_ranks_only_gets_the_average_on_all(tmp_path):
    run_ranks(_rank_dependent_rank, 2, tmp_path, timeout=60)
