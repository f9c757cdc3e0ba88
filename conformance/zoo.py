"""What the suite needs to train a zoo model: its data, its loss, and which submodules are units.

models.py builds the modules; this file says, per model name, how to feed one (a seeded batch per
step, rank and micro-batch), how to score it (loss in fp32 whatever the compute dtype), and which
submodules every implementation wraps as units of their own, so that fsdp_lite, FSDP1 and FSDP2 all
shard the same units. It knows nothing about any FSDP.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models import Block, ConvNet, FrozenMLP, Nested, build

__all__ = ["BATCH_SIZE", "SPECS", "ModelSpec", "local_batch", "spec"]

BATCH_SIZE = 4  # samples per rank per micro-batch
SEQ_LEN = 16
VOCAB = 61


@dataclass(frozen=True)
class ModelSpec:
    """One zoo model as the suite trains it."""

    name: str
    units: Callable[[nn.Module], list[nn.Module]]  # own units, children before parents; root apart
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: str  # "cross_entropy" | "mse"
    # BatchNorm normalizes over the batch it is given, so the single-process reference must see
    # each rank's part on its own (one forward per part) to compute what the ranks compute.
    batch_coupled: bool = False
    needs: str | None = None  # an optional package this model needs

    def build(self, seed: int = 0) -> nn.Module:
        return build(self.name, seed)

    def unavailable(self) -> str | None:
        """Why this model cannot be built here, or None."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"needs the optional package {self.needs!r} (pip install {self.needs})"
        return None

    def compute_loss(self, output, target: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output  # transformers' output
        # The loss runs in fp32 under every precision, as mixed-precision recipes do.
        logits = logits.float()
        if self.loss == "cross_entropy":
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        return F.mse_loss(logits, target)


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH_SIZE, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # next-token prediction


def _regression(d_in: int, d_out: int):
    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(BATCH_SIZE, d_in, generator=g), torch.randn(
            BATCH_SIZE, d_out, generator=g
        )

    return make


def _images(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH_SIZE, 3, 8, 8, generator=g), torch.randint(
        0, 3, (BATCH_SIZE,), generator=g
    )


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def _of_type(*types: type) -> Callable[[nn.Module], list[nn.Module]]:
    def units(model: nn.Module) -> list[nn.Module]:
        return [m for m in _post_order(model) if isinstance(m, types) and m is not model]

    return units


def _nested_units(model: nn.Module) -> list[nn.Module]:
    # Units inside units: body[0][0] inside body[0] inside body.
    assert isinstance(model, Nested)
    return [model.body[0][0], model.body[0], model.body[1], model.body]


def _convnet_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, ConvNet)
    return list(model.blocks)


def _frozen_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, FrozenMLP)
    return [model.stem, model.mid]


def _hf_units(model: nn.Module) -> list[nn.Module]:
    return [m for m in _post_order(model) if type(m).__name__ == "LlamaDecoderLayer"]


SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("mlp", _of_type(nn.Linear), _regression(7, 3), "mse"),
        ModelSpec("lm", _of_type(Block), _tokens, "cross_entropy"),
        ModelSpec("lm_untied", _of_type(Block), _tokens, "cross_entropy"),
        ModelSpec("nested", _nested_units, _regression(9, 4), "mse"),
        ModelSpec("convnet", _convnet_units, _images, "cross_entropy", batch_coupled=True),
        ModelSpec("frozen", _frozen_units, _regression(7, 3), "mse"),
        ModelSpec("hf_llama", _hf_units, _tokens, "cross_entropy", needs="transformers"),
        # Its vocabulary is wider than the tokens fed (VOCAB): the head still sees every class.
        ModelSpec("wide_lm", _of_type(Block), _tokens, "cross_entropy"),
    ]
}


def spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(SPECS)}")
    return SPECS[name]


def local_batch(model: str, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (input, target) for micro-batch ``micro`` of ``step``: every rank its own."""
    seed = ((step * 8 + micro) * 1009 + rank) * 31 + sorted(SPECS).index(model)
    return SPECS[model].make_batch(torch.Generator().manual_seed(seed))
