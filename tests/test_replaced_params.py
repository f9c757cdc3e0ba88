"""A parameter replaced with ``setattr`` after wrapping is used, or refused before any collective.

Code that loads weights into a wrapped model may put a new ``nn.Parameter`` in a module instead of
copying into the old one (transformers' load-time FSDP2 sharding does, after ``fully_shard`` and
before the first forward). runtime.py Note [Replaced parameters] says what fsdp_lite does. The
oracle for both fronts and every strategy: replacing after wrapping trains bitwise as having the
same values before wrapping did; for ``fully_shard`` also bitwise torch's ``fully_shard`` with the
same replacement; and transformers' own ``from_pretrained(distributed_config=...)`` with fsdp_lite's
``fully_shard`` bound in trains and saves bitwise torch's.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import fsdp_lite
from fsdp_lite import ShardingStrategy
from fsdp_lite.tools.trace import record_collectives
from tests.ranks import run_checks, run_ranks

STEPS = 3
REPLACED = ("0.weight", "2.bias")  # a weight whose 5 rows shard unevenly, and a bias


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _new_values(name: str, like: torch.Tensor) -> torch.Tensor:
    """The values a loader would bring for ``name``: fixed, and different from the init."""
    g = torch.Generator().manual_seed(hash(name) % 1000)
    return torch.randn(like.shape, generator=g, dtype=like.dtype)


def _module_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def _replace(model: nn.Module, name: str, values: torch.Tensor) -> nn.Parameter:
    """``setattr`` a new parameter holding ``values``, laid out as the one it replaces (a DTensor
    with its mesh and placements, as transformers' loader builds it; no collective)."""
    module, attr = _module_and_attr(model, name)
    old = getattr(module, attr)
    if isinstance(old, DTensor):
        values = distribute_tensor(values, old.device_mesh, old.placements, src_data_rank=None)
    new = nn.Parameter(values, requires_grad=old.requires_grad)
    setattr(module, attr, new)
    return new


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _train(
    model: nn.Module, rank: int, steps: int, optim=None
) -> tuple[list[float], torch.optim.Optimizer]:
    optim = optim or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        loss = model(_batch(rank, step)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, optim


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name.replace("_fsdp_wrapped_module.", "")] = (
            p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        )
    return out


def _assert_same(a, b, what: str) -> None:
    (la, pa), (lb, pb) = a, b
    assert la == lb, f"{what}: losses {la} != {lb}"
    for name in pb:
        assert torch.equal(pa[name], pb[name]), f"{what}: {name} differs after {STEPS} steps"


# ---- the fronts ----------------------------------------------------------------------------------


def _fully_shard(api, model: nn.Module) -> nn.Module:
    api.fully_shard(model[0])
    api.fully_shard(model)
    return model


def _fsdp1(strategy: ShardingStrategy):
    def wrap(model: nn.Module) -> nn.Module:
        inner = fsdp_lite.FullyShardedDataParallel(model[0], sharding_strategy=strategy)
        model[0] = inner
        return fsdp_lite.FullyShardedDataParallel(model, sharding_strategy=strategy)

    return wrap


def _values_before_wrapping(wrap, rank: int):
    """The reference: the new values put in before wrapping."""
    model = _net()
    with torch.no_grad():
        for name in REPLACED:
            module, attr = _module_and_attr(model, name)
            getattr(module, attr).copy_(_new_values(name, getattr(module, attr)))
    model = wrap(model)
    losses, _ = _train(model, rank, STEPS)
    return losses, _full(model)


def _replaced_after_wrapping(wrap, rank: int):
    model = _net()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    model = wrap(model)
    for name in REPLACED:
        where = _inner_name(model, name)
        _replace(model, where, _new_values(name, torch.empty(shapes[name])))
    losses, _ = _train(model, rank, STEPS)
    return losses, _full(model)


def _inner_name(model: nn.Module, name: str) -> str:
    """``name`` as the module tree spells it: the FSDP1 wrapper's ``named_parameters`` hides its
    ``_fsdp_wrapped_module`` level, and ``setattr`` must reach the module that holds it."""
    for full, _ in nn.Module.named_parameters(model, remove_duplicate=False):
        if full.replace("_fsdp_wrapped_module.", "") == name:
            return full
    raise KeyError(name)


def check_fully_shard_before_first_forward(rank: int, world_size: int) -> None:
    wrap = lambda m: _fully_shard(fsdp_lite, m)
    ours = _replaced_after_wrapping(wrap, rank)
    _assert_same(ours, _values_before_wrapping(wrap, rank), "fsdp_lite vs values before wrapping")
    torchs = _replaced_after_wrapping(lambda m: _fully_shard(torch_api, m), rank)
    _assert_same(ours, torchs, "fsdp_lite vs torch fully_shard, both replaced after wrapping")


class torch_api:  # noqa: N801 - torch's fully_shard under the name the helpers call
    fully_shard = staticmethod(torch_fully_shard)


FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD")


def _check_fsdp1_before_first_forward(strategy: str, rank: int, world_size: int) -> None:
    wrap = _fsdp1(ShardingStrategy[strategy])
    _assert_same(
        _replaced_after_wrapping(wrap, rank),
        _values_before_wrapping(wrap, rank),
        f"FSDP1 front {strategy}: replaced after wrapping vs values before wrapping",
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _between_steps(wrap, rank: int, replace: bool):
    """One step, then the new values (replaced, or copied in place as the reference), a new
    optimizer (a replacement is a new tensor: an old optimizer holds the old one), two steps."""
    model = wrap(_net())
    losses, _ = _train(model, rank, 1)
    for name in REPLACED:
        where = _inner_name(model, name)
        module, attr = _module_and_attr(model, where)
        values = _new_values(name, torch.empty(getattr(module, attr).shape))
        if replace:
            _replace(model, where, values)
        else:
            with torch.no_grad():
                current = getattr(module, attr)
                local = current.to_local() if isinstance(current, DTensor) else current
                local.copy_(
                    distribute_tensor(
                        values, current.device_mesh, current.placements, src_data_rank=None
                    ).to_local()
                    if isinstance(current, DTensor)
                    else values
                )
    more, _ = _train(model, rank, STEPS - 1)
    return losses + more, _full(model)


def check_between_steps(rank: int, world_size: int) -> None:
    """fsdp_lite takes a replacement at any forward, and says so after the first."""
    records = _Records()
    logger = logging.getLogger("fsdp_lite")
    logger.addHandler(records)
    try:
        for what, wrap in (
            ("fully_shard", lambda m: _fully_shard(fsdp_lite, m)),
            ("FSDP1 front", _fsdp1(ShardingStrategy.FULL_SHARD)),
        ):
            records.messages.clear()
            _assert_same(
                _between_steps(wrap, rank, replace=True),
                _between_steps(wrap, rank, replace=False),
                f"{what}: replaced between steps vs copied in place",
            )
            assert any("'0.weight'" in m and "replaced" in m for m in records.messages), (
                f"{what}: no warning named the parameter replaced between steps: {records.messages}"
            )
    finally:
        logger.removeHandler(records)


def check_torch_drops_a_replacement_between_steps(rank: int, world_size: int) -> None:
    """What docs/integrations.md and Note [Replaced parameters] say of torch: after its lazy init
    torch FSDP2 puts the old parameter back; fsdp_lite keeps the new one."""
    for api, keeps in ((torch_api, False), (fsdp_lite, True)):
        model = _fully_shard(api, _net())
        _train(model, rank, 1)
        new = _replace(model, "0.weight", torch.zeros(5, 6))
        model(_batch(rank, 9)).sum().backward()
        assert (model[0].weight is new) == keeps, (
            f"{api.__name__}: holds the replacement: {not keeps}"
        )


def _refused(model: nn.Module, name: str, bad, error: type, words: str) -> None:
    """Putting ``bad`` in place of ``name`` raises ``error`` at the next forward, on every rank,
    before any collective; put back, the model trains on."""
    module, attr = _module_and_attr(model, name)
    old = module._parameters[attr]
    module._parameters[attr] = bad
    with record_collectives(model) as trace:
        with pytest.raises(error, match=words):
            model(_batch(dist.get_rank(), 0))
    assert not trace.records, f"{name}: collectives issued before the refusal: {trace.records}"
    module._parameters[attr] = old
    _train(model, dist.get_rank(), 1)


def check_refusals(rank: int, world_size: int) -> None:
    model = _fully_shard(fsdp_lite, _net())
    weight = model[0].weight
    _refused(model, "0.weight", nn.Parameter(torch.zeros(5, 6)), TypeError,
             r"'0.weight' was replaced after wrapping by a plain Parameter of shape \(5, 6\)")  # fmt: skip
    replicated = DTensor.from_local(torch.zeros(5, 6), weight.device_mesh, [Replicate()])
    _refused(
        model, "0.weight", nn.Parameter(replicated), ValueError, r"placements \(Replicate\(\),\)"
    )
    frozen = distribute_tensor(torch.zeros(5, 6), weight.device_mesh, weight.placements)
    _refused(model, "0.weight", nn.Parameter(frozen, requires_grad=False), ValueError,
             "requires_grad=False")  # fmt: skip
    _refused(model, "0.weight", None, ValueError, "deleted or set to None")

    no_shard = _fsdp1(ShardingStrategy.NO_SHARD)(_net())
    _refused(no_shard, "0._fsdp_wrapped_module.weight", nn.Parameter(torch.zeros(6, 5)),
             ValueError, r"NO_SHARD: kept whole.*shape \(5, 6\)")  # fmt: skip


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def check_tied(rank: int, world_size: int) -> None:
    """A tied parameter replaced in every module that holds it is one parameter still; replaced
    in one only, refused (the unit holds one parameter; untying it is not a replacement)."""
    x = torch.arange(6).view(2, 3)
    model = fsdp_lite.fully_shard(_Tied())
    new = _replace(model, "emb.weight", torch.ones(7, 4))
    model.head.weight = new
    model(x).sum().backward()
    assert model.emb.weight is new and model.head.weight is new
    assert torch.equal(new.full_tensor(), torch.ones(7, 4))
    assert new.grad is not None

    model = fsdp_lite.fully_shard(_Tied())
    _replace(model, "head.weight", torch.ones(7, 4))
    with pytest.raises(
        ValueError, match=r"'emb.weight' is tied \(Embedding.weight, Linear.weight\)"
    ):
        model(x)


CHECKS = {
    "fully_shard_before_first_forward": check_fully_shard_before_first_forward,
    **{
        f"fsdp1_{s}_before_first_forward": (
            lambda r, w, s=s: _check_fsdp1_before_first_forward(s, r, w)
        )
        for s in FSDP1_STRATEGIES
    },
    "between_steps": check_between_steps,
    "torch_drops_a_replacement_between_steps": check_torch_drops_a_replacement_between_steps,
    "refusals": check_refusals,
    "tied": check_tied,
}


def _rank(rank: int, world_size: int) -> dict[str, str]:
    return run_checks(CHECKS, list(CHECKS), rank, world_size)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("replaced"), timeout=240)


@pytest.mark.parametrize("check", list(CHECKS))
def test_replaced_parameter(results, check):
    for rank, failures in enumerate(results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"


# ---- transformers' load-time sharding ------------------------------------------------------------

HF_NAMES = ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy")


def _hf_load_and_train(api, checkpoint: str, out: str, rank: int):
    """``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``, with the names
    transformers.distributed.fsdp imports from torch bound to ``api``'s (None: torch's), then 3
    AdamW steps on this rank's tokens and ``save_pretrained`` (every rank gathers, rank 0 writes)."""
    import transformers.distributed.fsdp as hf_fsdp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    saved = {n: getattr(hf_fsdp, n) for n in HF_NAMES}
    if api is not None:
        for n in HF_NAMES:
            setattr(hf_fsdp, n, getattr(api, n))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, distributed_config=DistributedConfig(fsdp_size=2)
        )
    finally:
        for n, v in saved.items():
            setattr(hf_fsdp, n, v)
    assert isinstance(model, fsdp_lite.FSDPModule if api is not None else torch_fsdp_module())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses, first_logits = [], None
    for _ in range(3):
        ids = torch.randint(0, 61, (2, 12), generator=g)
        out_ = model(input_ids=ids, labels=ids)
        if first_logits is None:
            first_logits = (ids, out_.logits.detach())
        out_.loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(out_.loss.item())
    model.save_pretrained(out)
    dist.barrier()
    return losses, load_file(f"{out}/model.safetensors"), first_logits


def torch_fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _hf_rank(rank: int, world_size: int, checkpoint: str, tmp: str) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    def check() -> None:
        lite = _hf_load_and_train(fsdp_lite, checkpoint, f"{tmp}/lite", rank)
        ref = _hf_load_and_train(None, checkpoint, f"{tmp}/torch", rank)
        assert lite[0] == ref[0], f"losses: fsdp_lite {lite[0]} != torch {ref[0]}"
        for name, value in ref[1].items():
            assert torch.equal(lite[1][name], value), f"saved {name} differs from torch's"
        # The loaded weights are the ones used: the first logits are the plain loaded model's.
        plain = AutoModelForCausalLM.from_pretrained(checkpoint)
        ids, logits = lite[2]
        assert torch.equal(plain(input_ids=ids).logits, logits), "first logits != plain model's"

    return run_checks(
        {"transformers_load_time_sharding": check}, ["transformers_load_time_sharding"]
    )


def test_transformers_load_time_sharding_trains_and_saves_as_torch_fully_shard(tmp_path):
    """The issue's reproduction: transformers replaces every parameter after fully_shard."""
    pytest.importorskip("transformers.distributed")  # the test extra's transformers has it
    from conformance.models import build

    build("hf_llama", seed=0).save_pretrained(tmp_path / "checkpoint")
    results = run_ranks(
        _hf_rank, 2, tmp_path, timeout=180, args=(str(tmp_path / "checkpoint"), str(tmp_path))
    )
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures.values())
