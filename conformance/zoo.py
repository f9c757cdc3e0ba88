"""What the suite needs to train a zoo model: its data, its loss, and which submodules are units.

models.py builds the modules; this file says, per model name, how to feed one (a seeded batch per
step, rank and micro-batch), how to score it (loss in fp32 whatever the compute dtype), and which
submodules every implementation wraps as units of their own, so that fsdp_lite, FSDP1 and FSDP2 all
shard the same units. A user's own model joins through ``spec_from_factory`` (``--model
package.module:factory``): the factory returns a ``ModelRecipe``. It knows nothing about any FSDP.
"""

from __future__ import annotations

import importlib
import importlib.util
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models import (
    MODEL_NAMES,
    Block,
    BufNet,
    ConvNet,
    FrozenMLP,
    Nested,
    SpikyMLP,
    UnusedMLP,
    build,
)

__all__ = [
    "BATCH_SIZE",
    "SPECS",
    "ModelRecipe",
    "ModelSpec",
    "local_batch",
    "register_model",
    "spec",
    "spec_from_factory",
]

BATCH_SIZE = 4  # samples per rank per micro-batch
SEQ_LEN = 16
VOCAB = 61


@dataclass(frozen=True)
class ModelSpec:
    """One zoo model as the suite trains it."""

    name: str
    units: Callable[[nn.Module], list[nn.Module]]  # own units, children before parents; root apart
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: str  # "cross_entropy" | "mse" | "auto" (cross entropy for integer targets, else mse)
    # BatchNorm normalizes over the batch it is given, so the single-process reference must see
    # each rank's part on its own (one forward per part) to compute what the ranks compute.
    batch_coupled: bool = False
    needs: str | None = None  # an optional package this model needs
    # Parameters no rank uses in forward: the DDP reference needs find_unused_parameters=True.
    has_unused_params: bool = False
    # mark(input, step, micro, rank): changes one rank's batch in place at a chosen step.
    mark: Callable[[torch.Tensor, int, int, int], None] | None = None
    builder: Callable[[], nn.Module] | None = None  # a user's model (--model); None: the zoo's
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None  # overrides ``loss``

    def build(self, seed: int = 0) -> nn.Module:
        if self.builder is None:
            return build(self.name, seed)
        torch.manual_seed(seed)  # as the zoo's builders: the same weights on every rank
        return self.builder()

    def unavailable(self) -> str | None:
        """Why this model cannot be built here, or None."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"needs the optional package {self.needs!r} (pip install {self.needs})"
        return None

    def compute_loss(self, output, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(output, target).float()
        logits = output.logits if hasattr(output, "logits") else output  # transformers' output
        # The loss runs in fp32 under every precision, as mixed-precision recipes do.
        logits = logits.float()
        loss = self.loss
        if loss == "auto":
            loss = "mse" if target.is_floating_point() else "cross_entropy"
        if loss == "cross_entropy":
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


def _bufnet_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, BufNet)
    return [model.fc1]  # the root keeps fc2 and both buffers


def _unused_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, UnusedMLP)
    return [model.fc1, model.fc2, model.spare, model.fc3]


def _spiky_units(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, SpikyMLP)
    return [model.fc1]  # the root keeps fc2 and spike


def _mark_rank0_step2(x: torch.Tensor, step: int, micro: int, rank: int) -> None:
    if (step, micro, rank) == (1, 0, 0):
        x[0, 0] = 1e4  # SpikyMLP's mark: an inf in spike's gradient on the rank holding it


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
        ModelSpec("bufnet", _bufnet_units, _regression(7, 3), "mse"),
        ModelSpec("unused", _unused_units, _regression(7, 3), "mse", has_unused_params=True),
        ModelSpec("spiky", _spiky_units, _regression(7, 3), "mse", mark=_mark_rank0_step2),
    ]
}


# Each model's number in its batches' seeds: the first eight sorted, as they always were, then
# models added later, so that no model's data changes when another joins.
_SEED_ORDER = (
    "convnet",
    "frozen",
    "hf_llama",
    "lm",
    "lm_untied",
    "mlp",
    "nested",
    "wide_lm",
    "bufnet",
    "unused",
    "spiky",
)
_ZOO_ORDER = tuple(SPECS)
assert set(_SEED_ORDER) == set(_ZOO_ORDER), "give a new zoo model its place in _SEED_ORDER"


def spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(SPECS)}")
    return SPECS[name]


def local_batch(model: str, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (input, target) for micro-batch ``micro`` of ``step``: every rank its own."""
    if model in _SEED_ORDER:
        index = _SEED_ORDER.index(model)
    else:  # a user's model: a number from its name alone, the same on every rank and run
        index = len(_SEED_ORDER) + zlib.crc32(model.encode()) % 997
    seed = ((step * 8 + micro) * 1009 + rank) * 31 + index
    x, y = SPECS[model].make_batch(torch.Generator().manual_seed(seed))
    if SPECS[model].mark is not None:
        SPECS[model].mark(x, step, micro, rank)
    return x, y


@dataclass
class ModelRecipe:
    """What a ``--model package.module:factory`` factory returns; a tuple ``(model, units,
    batch)`` or ``(model, units, batch, loss)`` works too.

    Attributes:
        model: the model, on the CPU, built from the torch seed the suite sets before the call
            (so build it from torch's default generator: every rank gets the same weights).
        units: the submodules of ``model`` to wrap as units of their own, children before
            parents; the root is wrapped too and keeps the rest.
        batch: ``batch(generator) -> (input, target)``, one rank's micro-batch, drawn from the
            ``torch.Generator`` given (seeded per step, micro-batch and rank).
        loss: ``loss(output, target) -> scalar``; default cross entropy over the output's last
            dim (``output.logits`` for transformers) for an integer target, else mean squared
            error. It runs in fp32 whatever the precision.
        batch_coupled: the model normalizes over its batch (BatchNorm): the single-process
            reference then runs each rank's part separately.
    """

    model: nn.Module
    units: list[nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    batch_coupled: bool = False


def _as_recipe(value: Any, target: str) -> ModelRecipe:
    if isinstance(value, ModelRecipe):
        recipe = value
    elif isinstance(value, tuple) and len(value) in (3, 4):
        recipe = ModelRecipe(*value)
    else:
        raise TypeError(
            f"{target} returned {type(value).__name__}; it must return a "
            "conformance.zoo.ModelRecipe or a tuple (model, units, batch[, loss])"
        )
    if not isinstance(recipe.model, nn.Module):
        raise TypeError(f"{target}: the model is a {type(recipe.model).__name__}, not an nn.Module")
    inside = {id(m) for m in recipe.model.modules()}
    strays = [type(u).__name__ for u in recipe.units if id(u) not in inside or u is recipe.model]
    if strays:
        raise ValueError(
            f"{target}: units must be submodules of the model it returned (not the model "
            f"itself): {strays}"
        )
    return recipe


def spec_from_factory(target: str) -> ModelSpec:
    """The ``ModelSpec`` of a user's model: ``target`` is ``package.module:factory``, a function
    of no arguments returning a ``ModelRecipe``. The model's name in case names is ``factory``."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model takes package.module:factory, not {target!r}")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise TypeError(f"{target} is not a function")
    if attr in MODEL_NAMES:
        raise ValueError(f"{target}: {attr!r} is a zoo model's name; name the factory otherwise")
    units_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def builder() -> nn.Module:
        recipe = _as_recipe(factory(), target)
        units_of[recipe.model] = list(recipe.units)  # the units of this very instance
        return recipe.model

    torch.manual_seed(0)
    first = _as_recipe(factory(), target)  # checked now, before any rank starts a case
    return ModelSpec(
        attr,
        units=lambda model: units_of[model],
        make_batch=first.batch,
        loss="auto",
        batch_coupled=first.batch_coupled,
        builder=builder,
        loss_fn=first.loss,
    )


def register_model(model_spec: ModelSpec) -> None:
    """Make ``model_spec`` a model the matrix can name (``--model`` registers the user's)."""
    if model_spec.name in _ZOO_ORDER:
        raise ValueError(f"{model_spec.name!r} is a zoo model")
    SPECS[model_spec.name] = model_spec
