"""Shapes and parameter uses that sharding gets wrong first, and optimizers other than SGD.

The quirky model has: dim 0 sizes that don't divide by the world size, a 1-element parameter
(fewer elements than ranks), a frozen weight beside a trainable bias in one unit, a layer called
twice in one forward, a layer never called, and an embedding tied to the output projection.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from fsdp_lite.wrap import lambda_auto_wrap_policy
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks


class Quirky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.weight.requires_grad_(False)
        self.twice = nn.Linear(7, 7)
        self.unused = nn.Linear(3, 3)
        self.tiny = nn.Parameter(torch.randn(1))
        self.emb = nn.Embedding(11, 7)
        self.out = nn.Linear(7, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.emb(idx)
        h = self.twice(torch.tanh(self.twice(h)))
        h = self.frozen(h) * self.tiny
        return self.out(h)


def _own_unit(module: nn.Module) -> bool:
    # Tied emb/out and the 1-element param stay in the root unit.
    return isinstance(module, nn.Linear) and module.out_features != 11


def _quirky_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (
        torch.randint(0, 11, (6,), generator=g),
        torch.randn(6, 5, generator=g),
        torch.randint(0, 11, (6,), generator=g),
    )


# At 3 ranks gloo sums reduce-scatter and all-reduce contributions in different orders (see
# test_parity.py); the bound is measured.
TOLERANCE = {2: dict(rtol=0.0, atol=0.0), 3: dict(rtol=1e-6, atol=1e-7)}


def _quirky_rank(rank: int, world_size: int, strategy_name: str) -> None:
    import functools

    ddp = DDP(Quirky(), find_unused_parameters=True)
    fsdp = FSDP(
        Quirky(),
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=_own_unit),
    )
    assert len(FSDP.fsdp_modules(fsdp)) == 5, "root + a, frozen, twice, unused"
    ref = dict(ddp.module.named_parameters())
    names = [n for n, _ in fsdp.named_parameters()]
    assert names == list(ref), (names, list(ref))
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    tol = TOLERANCE[world_size]
    for step in range(3):
        idx, x, target = _quirky_batch(rank, step)
        for model in (ddp, fsdp):
            nn.functional.cross_entropy(model(idx, x), target).backward()
        for name, p in fsdp.named_parameters():
            want = ref[name].grad
            what = f"rank {rank} step {step} grad {name} ({strategy_name})"
            if want is None:
                assert p.grad is None, f"{what}: DDP has no grad, fsdp_lite has one"
                continue
            assert p.grad is not None, f"{what}: missing"
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p.grad), want, what=what, **tol)
        for optim in (opt_ref, opt):
            optim.step()
            optim.zero_grad()
        for name, p in fsdp.named_parameters():
            want = ref[name].detach()
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            what = f"rank {rank} step {step} param {name} ({strategy_name})"
            assert_close(local(p).detach(), want, what=what, **tol)
    assert fsdp.unused.weight.grad is None and ref["unused.weight"].grad is None
    assert ref["frozen.weight"].grad is None and fsdp.frozen.weight.grad is None


@pytest.mark.parametrize(
    "strategy_name, world_size",
    [(s, 2) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")] + [("FULL_SHARD", 3)],
    ids=lambda v: str(v),
)
def test_uneven_frozen_reused_unused_and_tied_params_train_like_ddp(
    tmp_path, strategy_name, world_size
):
    run_ranks(_quirky_rank, world_size, tmp_path, args=(strategy_name,), timeout=120)


def test_shared_parameter_across_units_is_rejected(tmp_path):
    run_ranks(_tied_across_units_rank, 2, tmp_path, timeout=60)


def _tied_across_units_rank(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="is shared with a nested unit"):
        FSDP(
            model,
            auto_wrap_policy=lambda module, recurse, **kw: recurse or isinstance(module, nn.Linear),
        )


OPTIMIZERS = {
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
}


def _optimizers_rank(rank: int, world_size: int) -> None:
    for opt_name, make in OPTIMIZERS.items():
        ddp = DDP(build_model("lm"))
        fsdp = FSDP(build_model("lm"), auto_wrap_policy=POLICIES["lm"])
        opts = [make(ddp.parameters()), make(fsdp.parameters())]
        ref = dict(ddp.module.named_parameters())
        for step in range(2):
            x, y = rank_batch("lm", step, rank, world_size)
            for model, opt in zip((ddp, fsdp), opts):
                loss_fn("lm", model(x), y).backward()
                opt.step()
                opt.zero_grad()
            for name, p in fsdp.named_parameters():
                what = f"{opt_name} step {step} param {name}"
                assert_close(
                    local(p).detach(),
                    shard_of(ref[name].detach(), rank, world_size),
                    what=what,
                    rtol=0.0,
                    atol=0.0,
                )


def test_unmodified_torch_optimizers_step_shards_like_ddp(tmp_path):
    run_ranks(_optimizers_rank, 2, tmp_path, timeout=180)


class RankDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


def _rank_dependent_rank(rank: int, world_size: int) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        ddp = DDP(RankDependent(), find_unused_parameters=True)
        fsdp = FSDP(RankDependent(), sharding_strategy=ShardingStrategy[strategy])
        ref = dict(ddp.module.named_parameters())
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        for model in (ddp, fsdp):
            model(x, use_b=rank == 1).sum().backward()
        for name, p in fsdp.named_parameters():
            what = f"rank {rank} {strategy} grad {name}"
            assert p.grad is not None, f"{what}: another rank used it, so it has a gradient"
            want = ref[name].grad
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p.grad), want, what=what, rtol=0.0, atol=0.0)


def test_parameter_used_on_some_ranks_only_gets_the_average_on_all(tmp_path):
    run_ranks(_rank_dependent_rank, 2, tmp_path, timeout=60)


# ---- inputs refused at wrap time (issue 24) -----------------------------------------------------


class TiedSiblings(nn.Module):
    """An embedding and an output head sharing one weight, each a sibling of the other."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)))


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x.double()).float()


def _error(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares type and text
        return f"{type(e).__name__}: {e}"
    return "no error"


def _on_rank0_alone(rank: int, call) -> str | None:
    """``call`` on rank 0 while rank 1 waits in a barrier: a refusal that came after a collective
    would pair with that barrier or wait for rank 1, and never return its error."""
    seen = _error(call) if rank == 0 else None
    dist.barrier()
    return seen


def _fsdp2_siblings(api) -> tuple[nn.Module, object]:
    model = TiedSiblings()
    api.fully_shard(model.emb)
    api.fully_shard(model.head)
    return model, lambda: api.fully_shard(model)


def _fsdp1_siblings_by_hand() -> tuple[nn.Module, object]:
    model = TiedSiblings()
    model.emb = FSDP(model.emb)
    model.head = FSDP(model.head)
    return model, lambda: FSDP(model)


def _refusals_rank(rank: int, world_size: int) -> dict[str, str | None]:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    import fsdp_lite
    from fsdp_lite.wrap import ModuleWrapPolicy

    seen: dict[str, str | None] = {}
    idx = torch.tensor([1, 4, 7])
    # A parameter shared by sibling units: fsdp_lite refuses the common parent's wrap; torch FSDP2
    # refuses at its first forward, torch FSDP1 accepts it.
    _, wrap_root = _fsdp2_siblings(fsdp_lite)
    seen["fsdp2_siblings"] = _on_rank0_alone(rank, wrap_root)
    model, wrap_root = _fsdp2_siblings(torch_fsdp)
    wrap_root()
    seen["torch_fsdp2_siblings"] = _error(lambda: model(idx))
    _, wrap_root = _fsdp1_siblings_by_hand()
    seen["fsdp1_siblings_by_hand"] = _on_rank0_alone(rank, wrap_root)
    siblings = {nn.Embedding, nn.Linear}
    seen["fsdp1_siblings_auto_wrap"] = _error(
        lambda: FSDP(TiedSiblings(), auto_wrap_policy=ModuleWrapPolicy(siblings))
    )
    cpu = torch.device("cpu")
    policy = TorchModuleWrapPolicy(siblings)
    seen["torch_fsdp1_siblings"] = _error(
        lambda: TorchFSDP(TiedSiblings(), auto_wrap_policy=policy, device_id=cpu)(idx)
    )
    # Two dtypes in one unit: torch FSDP1 refuses at wrap, torch FSDP2 at its first forward.
    seen["fsdp2_two_dtypes"] = _on_rank0_alone(rank, lambda: fsdp_lite.fully_shard(TwoDtypes()))
    model = torch_fsdp.fully_shard(TwoDtypes())
    seen["torch_fsdp2_two_dtypes"] = _error(lambda: model(torch.randn(2, 4)))
    seen["fsdp1_two_dtypes"] = _on_rank0_alone(rank, lambda: FSDP(TwoDtypes()))
    seen["torch_fsdp1_two_dtypes"] = _error(lambda: TorchFSDP(TwoDtypes(), device_id=cpu))
    # reshard_after_forward of the wrong type: both refuse at once.
    for api in (fsdp_lite, torch_fsdp):
        name = "fsdp2" if api is fsdp_lite else "torch_fsdp2"
        call = lambda: api.fully_shard(nn.Linear(4, 4), reshard_after_forward="yes")  # noqa: B023
        seen[f"{name}_reshard_after_forward"] = _on_rank0_alone(rank, call)
    # What the message tells the user to do trains exactly like one process.
    model = TiedSiblings()
    reference = TiedSiblings()
    fsdp_lite.fully_shard([model.emb, model.head])
    fsdp_lite.fully_shard(model)
    optims = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, reference)]
    for step in range(3):
        batches = [torch.randint(0, 11, (5,), generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world_size)]  # fmt: skip
        loss = nn.functional.cross_entropy(model(batches[rank]), batches[rank])
        loss.backward()
        whole = torch.cat(batches)
        nn.functional.cross_entropy(reference(whole), whole).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
        want = shard_of(reference.emb.weight.detach(), rank, world_size)
        # One process averages over the global batch at once, the ranks each over theirs: the
        # sums differ in order, so the last bits may too.
        assert_close(local(model.emb.weight).detach(), want, what=f"step {step}", rtol=1e-6, atol=1e-7)  # fmt: skip
    return seen


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    return run_ranks(_refusals_rank, 2, tmp_path_factory.mktemp("refusals"), timeout=120)


def test_a_parameter_shared_by_sibling_units_is_refused_before_any_collective(refusals):
    rank0 = refusals[0]
    torch_words = rank0["torch_fsdp2_siblings"]
    assert torch_words.startswith("ValueError: Parameter 'head.weight' is shared"), torch_words
    assert rank0["fsdp2_siblings"] == torch_words.replace(
        "FSDP group.", "FSDP group ('emb.weight').", 1
    ), rank0["fsdp2_siblings"]
    fsdp1 = (
        "ValueError: parameter 'head.weight' is shared with 'emb.weight' of another unit; put "
        "the modules sharing it in one unit (do not wrap them apart)"
    )
    assert rank0["fsdp1_siblings_by_hand"] == fsdp1
    for seen in refusals:  # auto-wrap: after the model comparison, on every rank alike
        assert seen["fsdp1_siblings_auto_wrap"] == fsdp1
    assert rank0["torch_fsdp1_siblings"] == "no error", "torch FSDP1 accepts it (two copies)"


def test_two_dtypes_in_one_unit_are_refused_at_wrap_time_in_torchs_words(refusals):
    rank0 = refusals[0]
    assert rank0["torch_fsdp1_two_dtypes"] == (
        "ValueError: Must flatten tensors with uniform dtype but got torch.float32 and "
        "torch.float64"
    )
    assert rank0["fsdp1_two_dtypes"].startswith(rank0["torch_fsdp1_two_dtypes"] + ": 'a.weight'")
    words = "FSDP expects uniform original parameter dtype but got {"
    assert rank0["torch_fsdp2_two_dtypes"].startswith(f"AssertionError: {words}")
    assert rank0["fsdp2_two_dtypes"].startswith(
        f"ValueError: {words}torch.float32, torch.float64}}"
    )


def test_reshard_after_forward_of_another_type_is_refused_as_torch_does(refusals):
    rank0 = refusals[0]
    assert rank0["fsdp2_reshard_after_forward"] == rank0["torch_fsdp2_reshard_after_forward"]
    assert rank0["fsdp2_reshard_after_forward"] == (
        "ValueError: reshard_after_forward should be a bool or an int representing the group "
        "size to reshard to, not yes"
    )
