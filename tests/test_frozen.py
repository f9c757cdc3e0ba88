"""Frozen parameters inside units train like DDP and keep their values, bit for bit.

The model is the one users fine-tune: a transformer whose token embedding (root unit) and whose
first block's LayerNorm (that block's unit, beside trainable weights) take no gradient. Autograd
reads the frozen LayerNorm weight after every trainable gradient of its unit is in, so a unit that
freed its unsharded params at the last gradient failed in backward ("data is not allocated yet").
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from fsdp_lite.engine.param import ShardedParam
from tests.parity import POLICIES, assert_close, build, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks

FROZEN = ("tok.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias")
# At 4 ranks gloo's reduce-scatter and DDP's all-reduce add in different orders (see test_parity).
TOLERANCE = {2: (0.0, 0.0), 4: (1e-6, 1e-7)}


def _frozen_lm() -> torch.nn.Module:
    model = build("lm_untied", seed=0)
    model.tok.weight.requires_grad_(False)
    model.blocks[0].ln1.requires_grad_(False)
    return model


def _frozen_rank(rank: int, world_size: int, strategy: str, use_orig_params: bool) -> None:
    ddp = DDP(_frozen_lm())
    fsdp = FSDP(
        _frozen_lm(),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=POLICIES["lm"],
        use_orig_params=use_orig_params,
    )
    initial = {n: p.detach().clone() for n, p in _frozen_lm().named_parameters() if n in FROZEN}
    ref = dict(ddp.module.named_parameters())
    rtol, atol = TOLERANCE[world_size]
    optims = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        for m in (ddp, fsdp)
    ]
    for step in range(3):
        x, y = rank_batch("lm", step, rank, world_size)
        for m in (ddp, fsdp):
            loss_fn("lm", m(x), y).backward()
        for name, p in fsdp.named_parameters():
            if name in FROZEN:
                assert p.grad is None, f"step {step}: frozen {name!r} got a gradient"
            else:
                want = shard_of(ref[name].grad, rank, world_size)
                assert_close(
                    local(p.grad), want, what=f"step {step} grad {name}", rtol=rtol, atol=atol
                )
        for optim in optims:
            optim.step()
            optim.zero_grad()
        for w in FSDP.fsdp_modules(fsdp):  # the last backward freed every unit's unsharded params
            assert all(_freed(p) for p in w._unit.params), f"step {step}: {w._unit} kept params"
    state = fsdp.state_dict()
    for name, value in ddp.module.state_dict().items():
        assert_close(state[name], value, what=f"final {name}", rtol=rtol, atol=atol)
    for name, value in initial.items():
        assert_close(state[name], value, what=f"frozen {name} moved", rtol=0, atol=0)


def _freed(p: ShardedParam) -> bool:
    return p.unsharded_flat is None or p.unsharded_flat.untyped_storage().size() == 0


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat"])
@pytest.mark.parametrize(
    "strategy, world_size",
    [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("FULL_SHARD", 4)],
    ids=["FULL_SHARD-ws2", "SHARD_GRAD_OP-ws2", "FULL_SHARD-ws4"],
)
def test_frozen_embedding_and_layernorm_train_like_ddp_and_stay_unchanged(
    tmp_path, strategy, world_size, use_orig_params
):
    run_ranks(_frozen_rank, world_size, tmp_path, args=(strategy, use_orig_params), timeout=240)
