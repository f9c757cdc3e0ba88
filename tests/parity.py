"""Shared pieces of the parity tests: data per model, shard slicing, and exact comparisons."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models import Block, build
from fsdp_lite.wrap import (
    always_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

# Each zoo model with the auto-wrap policy the core-engine issue pairs it with.
POLICIES = {
    "mlp": always_wrap_policy,
    "lm": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "nested": functools.partial(size_based_auto_wrap_policy, min_num_params=300),
}


def batch(model_name: str, seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (input, target) batch for a zoo model."""
    g = torch.Generator().manual_seed(seed)
    if model_name == "lm":
        tokens = torch.randint(0, 61, (size, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    d_in, d_out = {"mlp": (7, 3), "nested": (9, 4)}[model_name]
    return torch.randn(size, d_in, generator=g), torch.randn(size, d_out, generator=g)


def loss_fn(model_name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model_name == "lm":
        return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
    return F.mse_loss(output, target)


def rank_batch(model_name: str, step: int, rank: int, world_size: int):
    return batch(model_name, seed=1000 * step + rank)


def global_batch(model_name: str, step: int, world_size: int):
    parts = [rank_batch(model_name, step, r, world_size) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of dim 0 under the ceil-chunk rule (see fsdp_lite/engine/param.py Note [Padding])."""
    rows = -(-full.size(0) // world_size)
    return full[rank * rows : (rank + 1) * rows]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def assert_close(actual, expected, *, what: str, rtol: float, atol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def build_model(model_name: str) -> nn.Module:
    return build(model_name, seed=0)


def train_lm(
    model: nn.Module, rank: int, world_size: int, steps: int, lr: float
) -> torch.optim.Optimizer:
    """``steps`` steps of SGD with momentum on the 'lm' data; returns the optimizer."""
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = rank_batch("lm", step, rank, world_size)
        loss_fn("lm", model(x), y).backward()
        optim.step()
        optim.zero_grad()
    return optim
