"""The pieces of the checks issue 25 added, one process, no ranks: how compare treats dtypes and
infinities, the spiky model's planted inf, the new models' data seeds, where
checkpoint_outside_unit puts its wrappers, and the whole read of a DCP checkpoint.
tests/test_conformance.py runs them end to end."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from conformance.compare import compare
from conformance.models import Block, GPTConfig, TinyLM
from conformance.runner import checkpoint_units, read_checkpoint_whole
from conformance.tolerances import Tolerance
from conformance.zoo import local_batch, spec

EXACT = Tolerance()


def test_a_saved_tensor_of_another_dtype_fails_only_where_dtypes_are_checked():
    bf16 = {"scale": torch.tensor([0.5, 1.25]).to(torch.bfloat16)}
    fp32 = {"scale": torch.tensor([0.5, 1.25])}
    assert compare(bf16, fp32, EXACT).passed  # the same values
    checked = compare(bf16, fp32, EXACT, check_dtype=True)
    assert not checked.passed
    assert checked.problems == ["scale: dtype torch.bfloat16, the reference torch.float32"]


def test_equal_infinities_match_and_an_inf_against_a_number_does_not():
    inf = {"spike": torch.tensor([0.0, math.inf])}
    assert compare(inf, {"spike": torch.tensor([0.0, math.inf])}, EXACT).bitwise
    against_number = compare(inf, {"spike": torch.tensor([0.0, 1.0])}, EXACT)
    assert not against_number.passed and against_number.max_abs == math.inf


def test_spiky_puts_an_inf_in_one_gradient_element_only_in_the_marked_batch():
    model = spec("spiky").build()
    for step, rank, marked in [(1, 0, True), (1, 1, False), (0, 0, False)]:
        x, y = local_batch("spiky", step, 0, rank)
        model.zero_grad()
        spec("spiky").compute_loss(model(x), y).backward()
        spike = model.spike.grad
        assert spike[:3].eq(0).all()
        assert math.isinf(spike[3]) == marked, (step, rank)
        assert all(
            torch.isfinite(p.grad).all() for n, p in model.named_parameters() if n != "spike"
        )


def test_new_models_do_not_change_the_data_of_the_old_ones():
    # The seed of an old model's batch is what it was when the zoo had eight models, sorted.
    x, _ = local_batch("mlp", 2, 1, 1)
    seed = ((2 * 8 + 1) * 1009 + 1) * 31 + 5  # "mlp" was sixth of the eight
    expected, _ = spec("mlp").make_batch(torch.Generator().manual_seed(seed))
    assert torch.equal(x, expected)


class _Wrapper(nn.Module):
    """Stands for an FSDP1-style wrapper: holds one unit and nothing else."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_checkpoint_outside_unit_wraps_the_outermost_module_that_holds_only_the_unit():
    torch.manual_seed(0)
    model = TinyLM(GPTConfig(tie_embeddings=False))
    units = list(model.blocks)
    model.blocks[0] = _Wrapper(
        units[0]
    )  # FSDP1-like for the first block, FSDP2-like for the second
    checkpoint_units(model, units)
    first, second = model.blocks
    assert (
        type(first).__name__ == "CheckpointWrapper"
        and first._checkpoint_wrapped_module.inner is units[0]
    )
    assert (
        type(second).__name__ == "CheckpointWrapper"
        and second._checkpoint_wrapped_module is units[1]
    )
    assert isinstance(units[1], Block)
    tokens = torch.randint(0, 61, (2, 16))
    model(tokens).sum().backward()  # the wrapped model still trains


def test_a_checkpoint_read_whole_has_the_sizes_and_dtypes_its_metadata_records(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    saved = {"w": torch.arange(14.0).view(7, 2), "b": torch.ones(3, dtype=torch.bfloat16)}
    with warnings.catch_warnings():  # no_dist: DCP says it assumes one process
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    whole = read_checkpoint_whole(str(tmp_path))
    assert whole.keys() == saved.keys()
    assert compare(whole, saved, EXACT, check_dtype=True).bitwise
    # 7 rows against a model's 6: the shape is reported as saved, not cut to fit.
    smaller = {"w": torch.zeros(6, 2), "b": saved["b"]}
    assert compare(whole, smaller, EXACT).problems == ["w: shape (7, 2), the reference (6, 2)"]
