"""torchtitan's own FSDP code on fsdp_lite, against torch FSDP2 in the same launch (optional).

Runs only where torchtitan is installed (``pip install -e '.[titan]'``; it imports triton even on
CPU). torchtitan's llama3 ``debugmodel`` goes through torchtitan's ``apply_fsdp_to_decoder`` with
the names ``torchtitan/distributed/fsdp.py`` imports from torch (``fully_shard``,
``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, ``FSDPModule``, ``DataParallelMeshDims``) bound
to fsdp_lite's, then trains 3 AdamW steps with torchtitan's losses: plain cross entropy, and its
``ChunkedLossWrapper`` (the head once per sequence chunk with a backward each, under torchtitan's
toggles). Losses and parameters must be bitwise torch FSDP2's.

CPU stand-ins, the same for both runs: torchtitan's SDPA inner attention (causal) for
FlexAttention, which has no backward on CPU; ``set_force_sum_reduction_for_comms(True)``, since
gloo lacks the PREMUL_SUM that torch picks for torchtitan's divide factor of 1.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (.[titan])")

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fsdp_lite  # noqa: E402
from tests.ranks import run_checks, run_ranks  # noqa: E402

NAMES = (
    "fully_shard",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "FSDPModule",
    "DataParallelMeshDims",
)
VOCAB, SEQ, BATCH = 2048, 32, 2


@contextlib.contextmanager
def _names_bound_to(api):
    """torchtitan.distributed.fsdp's imported names bound to ``api``'s (fsdp_lite) or left."""
    import torchtitan.distributed.fsdp as titan_fsdp

    saved = {n: getattr(titan_fsdp, n) for n in NAMES if hasattr(titan_fsdp, n)}
    if api is not None:
        for n in saved:
            setattr(titan_fsdp, n, getattr(api, n))
    try:
        yield titan_fsdp
    finally:
        for n, v in saved.items():
            setattr(titan_fsdp, n, v)


def _debugmodel() -> torch.nn.Module:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_states()
    for m in list(model.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, FlexAttention):
                setattr(m, name, ScaledDotProductAttention(ScaledDotProductAttention.Config()))
    return model


def _train(api, rank: int, param_dtype: torch.dtype, policy: str, chunks: int):
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    model = _debugmodel()
    with _names_bound_to(api) as titan_fsdp:
        titan_fsdp.apply_fsdp_to_decoder(
            model, mesh, param_dtype, torch.float32, pp_enabled=False,
            reshard_after_forward_policy=policy,
        )  # fmt: skip
        titan_fsdp.disable_fsdp_gradient_division(model)  # as torchtitan's trainer does
        for m in model.modules():
            if isinstance(m, titan_fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    # The swap took: every layer is fsdp_lite's in its run and none is in torch's.
    ours = [isinstance(layer, fsdp_lite.FSDPModule) for layer in model.layers.values()]
    assert ours == [api is not None] * len(ours), ours
    if chunks > 1:
        loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=chunks))
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    else:
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        positions = torch.arange(SEQ).repeat(BATCH, 1)
        global_tokens = torch.tensor(float(labels.numel() * dist.get_world_size()))
        pred = model(tokens, positions, None)
        loss, _ = loss_fn(pred, labels, global_valid_tokens=global_tokens)
        loss.backward()
        optim.step()
        optim.zero_grad()
        params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        record.append((loss.detach().clone(), params))
    return record


def _check(param_dtype: torch.dtype, policy: str, chunks: int):
    def check(rank: int, world_size: int) -> None:
        theirs = _train(None, rank, param_dtype, policy, chunks)
        ours = _train(fsdp_lite, rank, param_dtype, policy, chunks)
        for step, ((loss, params), (tloss, tparams)) in enumerate(zip(ours, theirs)):
            assert torch.equal(loss, tloss), f"step {step} loss {loss} != torch's {tloss}"
            assert params.keys() == tparams.keys()
            for name in tparams:
                torch.testing.assert_close(
                    params[name], tparams[name], rtol=0, atol=0,
                    msg=lambda m, n=name, s=step: f"step {s} param {n}: {m}",
                )  # fmt: skip

    return check


CHECKS = {
    "fp32_default": _check(torch.float32, "default", 1),
    "bf16_fp32_always": _check(torch.bfloat16, "always", 1),
    "fp32_never": _check(torch.float32, "never", 1),
    "chunked_loss_fp32": _check(torch.float32, "default", 2),
    "chunked_loss_bf16_fp32": _check(torch.bfloat16, "default", 4),
}


def _rank(rank: int, world_size: int) -> dict[str, str]:
    return run_checks(CHECKS, list(CHECKS), rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("torchtitan"), timeout=600)


@pytest.mark.parametrize("check", list(CHECKS))
def test_torchtitan_apply_fsdp_trains_as_torch_fsdp2_bitwise(results, check):
    for rank, failures in enumerate(results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"
