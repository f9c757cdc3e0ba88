"""HF Accelerate on fsdp_lite: ``FSDPLiteAccelerator`` (fsdp_lite/integrations/accelerate.py) at 2
gloo ranks, against Accelerate's own DDP run of the same loop in the same launch.

A tiny ``LlamaForCausalLM`` (conformance.models, built from a config), sharded by either front
before ``prepare``; the loop is Accelerate's: ``accumulate`` over 2 micro-batches,
``backward``, ``clip_grad_norm_``, AdamW. At 2 ranks fsdp_lite's arithmetic is DDP's, so losses,
and the weights ``get_state_dict`` gathers, are bitwise DDP's while the clip stays inactive; the
norm itself may differ in its last bit (shard norms summed across ranks). ``save_state`` /
``load_state`` must give every rank back its own shards: Accelerate's non-FSDP path writes rank 0's
optimizer state alone and loads it on every rank.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conformance.models import build
from tests.ranks import run_checks, run_ranks
from tests.test_trainer import _assert_same_weights, _expect, _join_hf

accelerate = pytest.importorskip("accelerate")  # the hf extra, in the test extra
pytest.importorskip("transformers")

FRONTS = ("fsdp2", "fsdp1")


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    """The tiny Llama: plain for "ddp", else sharded by one front, per decoder layer and root."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import fsdp_lite
    from fsdp_lite.wrap import transformer_auto_wrap_policy

    model = build("hf_llama", seed=seed)
    if kind == "fsdp2":
        for layer in model.model.layers:
            fsdp_lite.fully_shard(layer)
        fsdp_lite.fully_shard(model)
    elif kind == "fsdp1":
        policy = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
        )
        model = fsdp_lite.FullyShardedDataParallel(model, auto_wrap_policy=policy)
    return model


def _accelerator(kind: str, **kwargs):
    from accelerate import Accelerator

    from fsdp_lite.integrations.accelerate import FSDPLiteAccelerator

    # cpu=True: on a machine without an accelerator Accelerate runs distributed only so.
    return (Accelerator if kind == "ddp" else FSDPLiteAccelerator)(cpu=True, **kwargs)


def _batch(step: int, rank: int) -> torch.Tensor:
    rows = torch.randint(0, 61, (64, 12), generator=torch.Generator().manual_seed(1))
    return rows[4 * step + 2 * rank : 4 * step + 2 * rank + 2]


def _steps(accelerator, model, optim, first: int, count: int, max_norm: float = 1e6):
    """``count`` micro-batches from ``first``: (losses, the clip's total norms)."""
    losses, norms = [], []
    for step in range(first, first + count):
        ids = _batch(step, dist.get_rank())
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm).item())
            optim.step()
            optim.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _prepared(kind: str, seed: int = 0, **kwargs):
    accelerator = _accelerator(kind, gradient_accumulation_steps=2, **kwargs)
    model = _model(kind, seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optim = accelerator.prepare(model, optim)
    return accelerator, model, optim


def _trains_like_ddp(out: Path, rank: int) -> None:
    """prepare leaves the model sharded (no DDP); accumulate/no_sync, clip (inactive) and
    AdamW give DDP's losses, and get_state_dict / save_model DDP's weights, bitwise."""
    import safetensors.torch
    from transformers import LlamaForCausalLM

    from fsdp_lite import FSDPModule, FullyShardedDataParallel

    runs = {}
    for kind in ("ddp", *FRONTS):
        accelerator, model, optim = _prepared(kind)
        losses, norms = _steps(accelerator, model, optim, 0, 6)
        state = accelerator.get_state_dict(model)
        accelerator.save_model(model, str(out / kind))
        runs[kind] = losses, norms, state
        if kind == "ddp":
            continue
        front = FSDPModule if kind == "fsdp2" else FullyShardedDataParallel
        assert isinstance(model, front), type(model)  # not DDP
        assert isinstance(accelerator.unwrap_model(model), LlamaForCausalLM)
        # ACCELERATE_PRIVATE_API: the registries save_state walks hold what prepare returned.
        assert any(m is model for m in accelerator._models)
        assert any(o is optim for o in accelerator._optimizers)
    if rank == 0:  # the numbers docs/integrations.md quotes
        table = {kind: {"losses": r[0], "clip_norms": r[1]} for kind, r in runs.items()}
        (out / "losses.json").write_text(json.dumps(table, indent=1))
    want_losses, want_norms, want_state = runs["ddp"]
    for kind in FRONTS:
        losses, norms, state = runs[kind]
        assert losses == want_losses, f"{kind}: {losses} != DDP's {want_losses}"
        assert norms == pytest.approx(want_norms, rel=1e-6), kind
        if rank == 0:
            _assert_same_weights(state, want_state, f"{kind} get_state_dict")
            assert all(v.device.type == "cpu" for v in state.values())
            saved = safetensors.torch.load_file(str(out / kind / "model.safetensors"))
            _assert_same_weights(saved, want_state, f"{kind} save_model")
        else:
            assert state == {}, "get_state_dict: the main process alone keeps the tensors"


def _clips_like_ddp(out: Path, rank: int) -> None:
    """An active clip (each front's: the wrapper's own for FSDP1, Accelerate's DTensor-aware one
    for FSDP2) clips as DDP's does. Not bitwise by construction: shard norms are summed in another
    order, so the norm may differ in its last bit (measured: 7.7e-8 relative; losses equal)."""
    runs = {}
    for kind in ("ddp", *FRONTS):
        accelerator, model, optim = _prepared(kind)
        runs[kind] = _steps(accelerator, model, optim, 0, 6, max_norm=0.5)
    assert all(n > 0.5 for n in runs["ddp"][1]), "the clip must be active"
    for kind in FRONTS:
        assert runs[kind][0] == pytest.approx(runs["ddp"][0], rel=1e-6), kind
        assert runs[kind][1] == pytest.approx(runs["ddp"][1], rel=1e-6), kind


def _local_optim_state(optim) -> list[torch.Tensor]:
    return [
        (v.to_local() if hasattr(v, "to_local") else v).clone()
        for state in optim.state_dict()["state"].values()
        for v in state.values()
    ]


def _save_and_load_state(out: Path, rank: int, kind: str) -> None:
    """save_state mid-run; the run goes on; load_state; the same steps again are bitwise the first
    time's, and right after load_state each rank holds its own shards and optimizer state again.
    A plain model prepared beside it goes through Accelerate's own path."""
    import safetensors.torch

    from fsdp_lite.integrations.accelerate import CHECKPOINT_DIR

    accelerator, model, optim = _prepared(kind)
    plain = torch.nn.Linear(4, 4)
    plain_optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain, plain_optim = accelerator.prepare(plain, plain_optim)  # DDP: not sharded
    _steps(accelerator, model, optim, 0, 4)
    folder = out / kind
    accelerator.save_state(str(folder))
    at_save = accelerator.get_state_dict(model), _local_optim_state(optim)
    plain_at_save = {k: v.clone() for k, v in plain.module.state_dict().items()}
    after = _steps(accelerator, model, optim, 4, 4)
    end = accelerator.get_state_dict(model)
    with torch.no_grad():
        plain.module.weight.add_(1.0)
    accelerator.load_state(str(folder))
    files = set(os.listdir(folder))
    assert {CHECKPOINT_DIR, "model.safetensors", "optimizer.bin", "random_states_1.pkl"} <= files
    # Accelerate's own files hold the plain model alone
    assert not {"model_1.safetensors", "optimizer_1.bin"} & files, files
    plain_keys = set(safetensors.torch.load_file(str(folder / "model.safetensors")))
    assert plain_keys == {"weight", "bias"}, plain_keys
    loaded = accelerator.get_state_dict(model), _local_optim_state(optim)
    for mine, theirs in zip(loaded[1], at_save[1]):
        assert torch.equal(mine, theirs), "a rank's own optimizer state must come back"
    shards = [None, None]
    dist.all_gather_object(shards, [t.sum().item() for t in loaded[1]])
    assert shards[0] != shards[1], "the ranks hold different shards (else the test shows nothing)"
    torch.testing.assert_close(plain.module.state_dict(), plain_at_save, rtol=0, atol=0)
    again = _steps(accelerator, model, optim, 4, 4)
    assert again == after, f"{again} != {after}"
    if rank == 0:
        _assert_same_weights(loaded[0], at_save[0], "weights after load_state")
        _assert_same_weights(accelerator.get_state_dict(model), end, "weights after the steps")
    else:
        accelerator.get_state_dict(model)  # a collective


def _bf16(out: Path, rank: int) -> None:
    """mixed_precision="bf16": Accelerate's autocast around fsdp_lite's model, DDP's numbers."""
    from accelerate.state import AcceleratorState

    # Accelerate fixes mixed precision per process; reset it, as TrainingArguments does.
    AcceleratorState._reset_state(reset_partial_state=False)
    runs = {
        kind: _steps(*_prepared(kind, mixed_precision="bf16"), 0, 6)[0] for kind in ("ddp", *FRONTS)
    }
    for kind in FRONTS:
        assert runs[kind] == runs["ddp"], f"{kind}: {runs[kind]} != DDP's {runs['ddp']}"


def _refusals(out: Path, rank: int) -> None:
    """Each refused alike on every rank, before fsdp_lite's first collective."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import fsdp_lite
    from fsdp_lite.integrations.accelerate import FSDPLiteAccelerator, as_fsdp_lite_accelerator

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    _expect(ValueError, "fsdp_plugin", lambda: FSDPLiteAccelerator(cpu=True, fsdp_plugin=plugin))

    class Mine(Accelerator):
        pass

    _expect(TypeError, "Accelerator", lambda: as_fsdp_lite_accelerator(Mine(cpu=True)))
    accelerator = _accelerator("fsdp2")
    layers_only = build("hf_llama")
    for layer in layers_only.model.layers:
        fsdp_lite.fully_shard(layer)
    _expect(ValueError, "root is not sharded", lambda: accelerator.prepare(layers_only))
    one, two = _model("fsdp2"), _model("fsdp1")
    both = torch.optim.AdamW([*one.parameters(), *two.parameters()])
    one, two, both = accelerator.prepare(one, two, both)
    _expect(ValueError, "own optimizer", lambda: accelerator.save_state(str(out / "refused")))
    # the check runs before anything is written, alike on every rank
    assert not (out / "refused").exists() or not os.listdir(out / "refused")


def _fp16_scaler(out: Path, rank: int) -> None:
    """fp16's loss scaler (Accelerate makes one on accelerators only, so it is set by hand here)
    becomes fsdp_lite's ShardedGradScaler, its settings kept: an inf in one rank's shards skips
    the step on every rank, or the replicas would part."""
    from accelerate import Accelerator

    from fsdp_lite.integrations.accelerate import as_fsdp_lite_accelerator
    from fsdp_lite.optim.grad_scaler import ShardedGradScaler

    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    as_fsdp_lite_accelerator(accelerator)
    scaler = accelerator.scaler
    assert isinstance(scaler, ShardedGradScaler), type(scaler)
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (1024.0, 7)
    model = _model("fsdp2")
    model, optim = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.to_local().clone() for p in model.parameters()]
    ids = _batch(0, rank)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    if rank == 1:
        model.lm_head.weight.grad.to_local().view(-1)[0] = float("inf")
    optim.step()
    assert accelerator.optimizer_step_was_skipped, "every rank skips the step"
    assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 512.0, "and backs off its scale"


CHECKS = {
    "trains_like_ddp": _trains_like_ddp,
    "clips_like_ddp": _clips_like_ddp,
    "save_and_load_state_fsdp2": functools.partial(_save_and_load_state, kind="fsdp2"),
    "save_and_load_state_fsdp1": functools.partial(_save_and_load_state, kind="fsdp1"),
    "refusals": _refusals,
    "fp16_scaler": _fp16_scaler,
    "bf16": _bf16,  # last: it resets Accelerate's per-process mixed precision
}


def _rank(rank: int, world_size: int, out: str) -> dict[str, str]:
    _join_hf(rank, world_size)
    return run_checks(CHECKS, list(CHECKS), Path(out), rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    return out, run_ranks(_rank, 2, out, timeout=180, args=(str(out),))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_accelerate_on_fsdp_lite(results, name):
    out, failures = results
    for rank, failed in enumerate(failures):
        assert name not in failed, f"rank {rank}:\n{failed[name]}"
    if name == "trains_like_ddp":  # pytest -s shows the numbers
        print("\n" + (out / "losses.json").read_text())
