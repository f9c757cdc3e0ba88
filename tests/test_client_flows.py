"""A transformers model prepared exactly as HF Accelerate and Trainer prepare an FSDP1 model.

Accelerate's ``FullyShardedDataParallelPlugin`` builds torch's config objects and
``Accelerator.prepare_model`` calls ``FSDP(model, **kwargs)`` with them, then applies activation
checkpointing to the wrapped model; Trainer then moves the wrapped model to ``args.device``
(``cpu:0`` under torchrun). Accelerate itself turns FSDP off on a machine without an accelerator
(its FSDP paths run only with a GPU-type backend: docs/integrations.md), so its calls are made here as it makes them, in the same order, with fsdp_lite's
class in place of torch's. The model is a tiny ``LlamaForCausalLM`` with a frozen embedding and a
frozen first-layer norm, the fine-tuning case. It must train like DDP and like native FSDP1 taken
through the same calls, bitwise at 2 ranks, and Accelerate's full state dict (rank 0 only,
offloaded) must hold the same trained weights as theirs.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conformance.models import build
from tests.ranks import run_ranks

transformers = pytest.importorskip("transformers")  # declared in the test extra
accelerate_utils = pytest.importorskip("accelerate.utils")


def _llama() -> torch.nn.Module:
    model = build("hf_llama", seed=0)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    return model


def _prepare_like_accelerate(model: torch.nn.Module, fsdp_cls) -> torch.nn.Module:
    """Accelerator.prepare_model's FSDP1 branch (accelerate 1.15), then Trainer's device move."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    plugin = accelerate_utils.FullyShardedDataParallelPlugin(
        fsdp_version=1,
        sharding_strategy="FULL_SHARD",
        backward_prefetch="BACKWARD_PRE",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        use_orig_params=True,
        sync_module_states=False,  # True makes the plugin look for an accelerator
        activation_checkpointing=True,
        state_dict_type="FULL_STATE_DICT",
    )
    plugin.set_auto_wrap_policy(model)
    wrapped = fsdp_cls(
        model,
        sharding_strategy=plugin.sharding_strategy,
        cpu_offload=plugin.cpu_offload,
        auto_wrap_policy=plugin.auto_wrap_policy,
        mixed_precision=plugin.mixed_precision_policy,
        sync_module_states=plugin.sync_module_states,
        backward_prefetch=plugin.backward_prefetch,
        forward_prefetch=plugin.forward_prefetch,
        use_orig_params=plugin.use_orig_params,
        param_init_fn=plugin.param_init_fn,
        ignored_modules=plugin.ignored_modules,
        limit_all_gathers=plugin.limit_all_gathers,
        device_id=torch.device("cpu"),
    )
    apply_activation_checkpointing(
        wrapped,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        auto_wrap_policy=plugin.auto_wrap_policy,
    )
    wrapped.to(torch.device("cpu", 0))  # Trainer._move_model_to_device(model, args.device)
    return wrapped, plugin


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model, rank, steps=3) -> list[float]:
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        ids = _batch(step, rank)
        # use_cache=False, as for any training with activation checkpointing: a recomputed layer
        # would append to the KV cache a second time.
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _accelerate_flow_rank(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as NativeFSDP

    from fsdp_lite import FullyShardedDataParallel as FSDP

    ddp = DDP(_llama())
    want_losses = _train(ddp, rank)
    want_state = ddp.module.state_dict()

    states = {}
    for name, fsdp_cls in (("fsdp_lite", FSDP), ("torch FSDP1", NativeFSDP)):
        model, plugin = _prepare_like_accelerate(_llama(), fsdp_cls)
        losses = _train(model, rank)
        assert losses == want_losses, f"{name}: losses {losses} != DDP's {want_losses}"
        # Accelerator.get_state_dict's FSDP1 path: FULL, offloaded to CPU, on rank 0 only.
        # torch FSDP1 cannot offload on CPU (measured: it crashes), so it gives FULL's defaults.
        configs = (plugin.state_dict_config, plugin.optim_state_dict_config)
        if fsdp_cls is NativeFSDP:
            configs = (None, None)
        with fsdp_cls.state_dict_type(model, plugin.state_dict_type, *configs):
            states[name] = model.state_dict()
    state = states["fsdp_lite"]
    if dist.get_rank() != 0:
        assert state == {}, "rank0_only: other ranks get nothing"
        return
    assert sorted(state) == sorted(want_state), "keys differ from the unwrapped model's"
    assert sorted(state) == sorted(states["torch FSDP1"]), "keys differ from torch FSDP1's"
    for key, value in want_state.items():
        assert type(state[key]) is torch.Tensor and state[key].device.type == "cpu", key
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(state[key], states["torch FSDP1"][key], rtol=0, atol=0, msg=key)
    frozen = _llama().state_dict()["model.embed_tokens.weight"]
    assert torch.equal(state["model.embed_tokens.weight"], frozen), "the frozen embedding moved"


@pytest.mark.slow
def test_llama_prepared_as_accelerate_and_trainer_do_trains_like_ddp(tmp_path):
    run_ranks(_accelerate_flow_rank, 2, tmp_path, timeout=240)
