"""``fsdp_lite.fully_shard`` against torch's ``fully_shard``, in the same run, call for call.

Each check builds the same model twice and makes the same calls through both APIs (``api`` is
``torch.distributed.fsdp`` or ``fsdp_lite``): per-block ``fully_shard`` then the root, as torchtitan
and pytorch/examples do. At 2 ranks in fp32, and with bf16 params and fp32 reduction, every loss,
gradient and parameter is bitwise torch's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor, Shard

import fsdp_lite
from conformance.models import TinyLM
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_checks, run_ranks

APIS = {"torch": torch_fsdp, "fsdp_lite": fsdp_lite}
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _sharded(api, precision: dict | None = None, model: torch.nn.Module | None = None, **kw):
    model = build_model("lm_untied") if model is None else model
    if precision:
        kw["mp_policy"] = api.MixedPrecisionPolicy(**precision)
    for block in model.blocks:
        api.fully_shard(block, **kw)
    api.fully_shard(model, **kw)
    return model


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, rank, world_size, steps=3, micro_batches=1, sync=None):
    """Per step: loss, full grads, full params (SGD with momentum: a wrong scale shows)."""
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record = []
    for step in range(steps):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            if sync is not None:
                sync(model, last)
            x, y = rank_batch("lm", 10 * step + micro, rank, world_size)
            loss = loss_fn("lm", model(x), y)
            loss.backward()
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
        record.append((loss.detach().float(), grads, params))
    return record


def _assert_same(ours, theirs, what, rtol=0.0, atol=0.0):
    for step, ((loss, grads, params), (tloss, tgrads, tparams)) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(
            loss, tloss, rtol=rtol, atol=atol, msg=f"{what} step {step} loss"
        )
        assert grads.keys() == tgrads.keys() and params.keys() == tparams.keys(), what
        for name in grads:
            torch.testing.assert_close(
                grads[name], tgrads[name], rtol=rtol, atol=atol,
                msg=lambda m, n=name, s=step: f"{what} step {s} grad {n}: {m}",
            )  # fmt: skip
            torch.testing.assert_close(
                params[name], tparams[name], rtol=rtol, atol=atol,
                msg=lambda m, n=name, s=step: f"{what} step {s} param {n}: {m}",
            )  # fmt: skip


# ---- numerics ----------------------------------------------------------------------------------


def _check_training(rank, world_size):
    # 3 ranks: torch averages with ReduceOp.AVG after the sum, fsdp_lite divides by 2 before and
    # 1.5 after (FSDP1's split): last-bit differences that momentum carries on.
    tol = {2: 0.0, 3: 1e-5}[world_size]
    for what, precision in (("fp32", None), ("bf16 params, fp32 reduce", BF16)):
        runs = {
            name: _train(_sharded(api, precision), rank, world_size) for name, api in APIS.items()
        }
        _assert_same(runs["fsdp_lite"], runs["torch"], what, rtol=tol, atol=tol)


def _check_summed_gradients(rank, world_size):
    """torchtitan's disable_fsdp_gradient_division: every module sums, dividing by 1."""

    def summing(api):
        model = _sharded(api)
        for module in model.modules():
            if isinstance(module, api.FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    runs = {name: _train(summing(api), rank, world_size) for name, api in APIS.items()}
    _assert_same(runs["fsdp_lite"], runs["torch"], "set_gradient_divide_factor(1.0)")


def _check_gradient_accumulation(rank, world_size):
    def sync(model, last):
        model.set_requires_gradient_sync(last)

    runs = {
        name: _train(_sharded(api), rank, world_size, micro_batches=2, sync=sync)
        for name, api in APIS.items()
    }
    _assert_same(runs["fsdp_lite"], runs["torch"], "set_requires_gradient_sync accumulation")


def _check_explicit_prefetch_and_reshard_after_forward(rank, world_size):
    def prefetching(api):
        model = _sharded(api, reshard_after_forward=True)
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
        return model

    runs = {name: _train(prefetching(api), rank, world_size) for name, api in APIS.items()}
    _assert_same(runs["fsdp_lite"], runs["torch"], "explicit prefetch")
    kept = {name: _train(_sharded(api, reshard_after_forward=False), rank, world_size) for name, api in APIS.items()}  # fmt: skip
    _assert_same(kept["fsdp_lite"], kept["torch"], "reshard_after_forward=False")
    # After a forward the root holds its unsharded params under None, its shards under True.
    x, _ = rank_batch("lm", 0, rank, world_size)
    for setting in (None, True, False):
        held = {}
        for name, api in APIS.items():
            model = _sharded(api, reshard_after_forward=setting)
            model(x)
            held[name] = (
                isinstance(model.pos, DTensor),
                isinstance(model.blocks[0].qkv.weight, DTensor),
            )
        assert held["fsdp_lite"] == held["torch"], (setting, held)


def _check_list_group(rank, world_size):
    """torchtitan's tied case: the embedding, the final norm and the head it shares a weight with,
    one fully_shard([...]) group, between the blocks and the root."""

    def grouped(api, precision):
        model = build_model("lm")  # head.weight is tok.weight
        kw = {"mp_policy": api.MixedPrecisionPolicy(**precision)} if precision else {}
        for block in model.blocks:
            api.fully_shard(block, **kw)
        api.fully_shard([model.tok, model.ln_f, model.head], **kw)
        api.fully_shard(model, **kw)
        return model

    for what, precision in (("fp32", None), ("bf16 params, fp32 reduce", BF16)):
        runs = {
            name: _train(grouped(api, precision), rank, world_size) for name, api in APIS.items()
        }
        _assert_same(runs["fsdp_lite"], runs["torch"], f"list group, {what}")
    model = grouped(fsdp_lite, None)
    assert model.tok._unit is model.head._unit is model.ln_f._unit, "one unit for the group"
    assert isinstance(model.head, fsdp_lite.FSDPModule)


def sharded_on_meta(api, rank, **kw):
    """Build on meta, shard, then to_empty and initialize the shards, as torchtitan does."""
    with torch.device("meta"):
        model = build_model("lm_untied")
    _sharded(api, model=model, **kw)
    model.to_empty(device="cpu")
    torch.manual_seed(1234 + rank)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with torch.no_grad():
        model.pos.normal_(std=0.02)
    assert all(not p.is_meta for p in model.parameters()), api.__name__
    return model


def _check_meta_init(rank, world_size):
    runs = {
        name: _train(sharded_on_meta(api, rank), rank, world_size, steps=2)
        for name, api in APIS.items()
    }
    _assert_same(runs["fsdp_lite"], runs["torch"], "meta init")


# ---- contracts client code relies on -------------------------------------------------------------


def _check_contracts(rank, world_size):
    plain_names = [n for n, _ in build_model("lm_untied").named_parameters()]
    model = _sharded(fsdp_lite)
    assert isinstance(model, fsdp_lite.FSDPModule) and isinstance(model, TinyLM)
    assert type(model).__name__ == "FSDPTinyLM"
    assert isinstance(model.blocks[0], fsdp_lite.FSDPModule)
    assert [n for n, _ in model.named_parameters()] == plain_names, "names changed"
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    x, y = rank_batch("lm", 0, rank, world_size)
    loss_fn("lm", model(x), y).backward()
    state = model.state_dict()
    for name, p in model.named_parameters():
        value = state[name]
        assert isinstance(value, DTensor), f"state_dict()[{name!r}] is {type(value).__name__}"
        local, param_local = value.to_local(), p.to_local()
        if param_local.numel():
            assert local.data_ptr() == param_local.data_ptr(), f"{name}: a copy, not the param"
    with pytest.raises(AssertionError, match="does not support deepcopy"):
        copy.deepcopy(model)
    norms = {}
    for name, api in APIS.items():
        m = _sharded(api)
        loss_fn("lm", m(x), y).backward()
        norms[name] = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1).full_tensor()
    torch.testing.assert_close(norms["fsdp_lite"], norms["torch"], rtol=0, atol=0)
    # explicit unshard / reshard, and a handle
    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    assert isinstance(handle, fsdp_lite.UnshardHandle)
    handle.wait()
    assert not isinstance(block.qkv.weight, DTensor), "unshard left the shards in the module"
    block.reshard()
    assert isinstance(block.qkv.weight, DTensor)
    # fsdp_lite's trace and explain() see the FSDP2 front's units as the FSDP1 wrapper's.
    from fsdp_lite.trace import explain, record_collectives

    with record_collectives(model) as trace:
        loss_fn("lm", model(x), y).backward()
    seen = {(r.kind, r.unit, r.phase) for r in trace.records}
    for unit in ("blocks.0", "blocks.1"):
        assert {("all_gather", unit, "forward"), ("reduce_scatter", unit, "backward")} <= seen, seen
    assert "blocks.1" in explain(model)
    # torch's own policy objects, as Accelerate builds them, work as fsdp_lite's.
    runs = {}
    for name, policy in (
        ("torch's", torch_fsdp.MixedPrecisionPolicy(**BF16)),
        ("fsdp_lite's", fsdp_lite.MixedPrecisionPolicy(**BF16)),
    ):
        m = _sharded(fsdp_lite, mp_policy=policy, offload_policy=torch_fsdp.OffloadPolicy())
        runs[name] = _train(m, rank, world_size, steps=1)
    _assert_same(runs["torch's"], runs["fsdp_lite's"], "torch's MixedPrecisionPolicy")
    with pytest.raises(TypeError, match="mp_policy must be fsdp_lite.MixedPrecisionPolicy"):
        fsdp_lite.fully_shard(build_model("mlp"), mp_policy=BF16)
    with pytest.raises(NotImplementedError, match="set_custom_all_gather"):
        model.set_custom_all_gather(None)

    class Event:  # what set_post_optim_event needs of an event: wait()
        waited = 0

        def wait(self):
            Event.waited += 1

    model.set_post_optim_event(Event())
    model(x)
    model(x)
    assert Event.waited == 1, "the next forward waits for the event once"


def _check_dcp_full_state_dicts(rank, world_size):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    seen = {}
    for name, api in APIS.items():
        model = _sharded(api)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = rank_batch("lm", 0, rank, world_size)
        loss_fn("lm", model(x), y).backward()
        optim.step()
        seen[name] = (
            get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optim, options=options),
        )
    (sd, osd), (tsd, tosd) = seen["fsdp_lite"], seen["torch"]
    # cpu_offload with full_state_dict: rank 0 holds everything, the others nothing (torch's rule).
    assert bool(sd) == bool(tsd) == (rank == 0) and bool(osd) == bool(tosd) == (rank == 0)
    assert sd.keys() == tsd.keys()
    for key in sd:
        assert type(sd[key]) is torch.Tensor, key
        torch.testing.assert_close(sd[key], tsd[key], rtol=0, atol=0, msg=key)
    for key, state in osd.get("state", {}).items():
        for k, v in state.items():
            torch.testing.assert_close(v, tosd["state"][key][k], rtol=0, atol=0, msg=f"{key} {k}")
    # broadcast_from_rank0: a full state dict on rank 0 only, loaded into a fresh sharded model.
    fresh = _sharded(fsdp_lite, model=build_model("lm_untied"))
    full = sd if rank == 0 else {}
    set_model_state_dict(
        fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    loaded = {key: _full(value) for key, value in fresh.state_dict().items()}  # every rank gathers
    for key, value in tsd.items():  # rank 0's full state dict
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=f"loaded {key}")


CHECKS = {
    "training": _check_training,
    "gradient_accumulation": _check_gradient_accumulation,
    "summed_gradients": _check_summed_gradients,
    "explicit_prefetch": _check_explicit_prefetch_and_reshard_after_forward,
    "list_group": _check_list_group,
    "meta_init": _check_meta_init,
    "contracts": _check_contracts,
    "dcp_full_state_dicts": _check_dcp_full_state_dicts,
}


def _checks_rank(rank, world_size, names):
    return run_checks(CHECKS, names, rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(
        _checks_rank, 2, tmp_path_factory.mktemp("fsdp2"), args=(list(CHECKS),), timeout=300
    )


@pytest.mark.parametrize("check", list(CHECKS))
def test_fully_shard_matches_torch(results, check):
    for rank, failures in enumerate(results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"


def test_fully_shard_training_at_3_ranks_within_the_reduction_order_bound(tmp_path):
    (failures, *_) = run_ranks(_checks_rank, 3, tmp_path, args=(["training"],), timeout=300)
    assert not failures, failures
