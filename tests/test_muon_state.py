"""fsdp_lite.Muon's optimizer state saved, resharded and loaded, bitwise.

1. By parameter name, full (every rank, or rank 0 only) and sharded: the FSDP1 front's
   FULL_SHARD and SHARD_OPTIM with ``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``,
   ``fully_shard`` with torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, at 2
   ranks: each name's ``momentum_buffer`` is DDP + ``torch.optim.Muon``'s after 3 steps, and a
   fresh model and Muon (other weights, no momentum yet) loaded from it continue bitwise as DDP
   does without stopping (3 more steps).
2. Checkpoints across world sizes and owner placements, Muon on the matrices and AdamW on the
   biases (``fsdp_lite.checkpoint`` with both optimizers for FSDP1 FULL_SHARD, SHARD_OPTIM and
   ``fully_shard``; torch DCP with the state-dict API for ``fully_shard``): 3 steps at 2 ranks,
   save; load at 4 ranks, 3 steps, save; load at 3 ranks (uneven shards), 3 steps. The 2- and
   4-rank legs train under ``fsdp_lite.Canonical``, so after them the parameters and optimizer
   state are bitwise an uninterrupted canonical run's (at 2 ranks). Canonical needs a power-of-two
   world size, so the 3-rank leg trains in the default mode: what it loads is bitwise the
   uninterrupted run's state, and each of its steps is bitwise torch's Muon and AdamW on whole
   copies started from that state and fed the model's own averaged gradients.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import fsdp_lite
import fsdp_lite.checkpoint
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.canonical import Canonical
from fsdp_lite.optim.muon import Muon
from tests.ranks import run_checks, run_ranks

MUON = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw", "nesterov": True}


class Matrices(nn.Module):
    """16x24, 24x16, 8x24 and 7x8: rows 6/6/4, 8/8/8, 3/3/2, 3/3/1 at 3 ranks; 7 rows uneven at 2
    and 4 ranks too. ``biases``: the first three layers have biases (for AdamW beside Muon)."""

    def __init__(self, biases: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(24, 16, bias=biases)
        self.b = nn.Linear(16, 24, bias=biases)
        self.c = nn.Linear(24, 8, bias=biases)
        self.d = nn.Linear(8, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind.startswith("fsdp1/"):
        return FSDP(
            model,
            sharding_strategy=fsdp_lite.ShardingStrategy[kind.removeprefix("fsdp1/")],
            auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
        )
    for sub in (model.a, model.b, model.c):
        fsdp_lite.fully_shard(sub)
    fsdp_lite.fully_shard(model)
    return model


ADAMW = {"lr": 1e-2, "foreach": True}  # foreach: world-size invariant (Canonical.check_optimizer)


def _build(kind: str, seed: int = 0, biases: bool = False) -> tuple[nn.Module, list]:
    """A wrapped model and its optimizers: Muon (torch's for DDP) on the matrices, and with
    ``biases`` AdamW on the biases, as Muon is used; ``seed`` sets the initial weights."""
    torch.set_num_threads(1)  # Canonical's contract; the same in every run here
    torch.manual_seed(seed)
    model = _wrap(kind, Matrices(biases))
    muon = torch.optim.Muon if kind == "ddp" else Muon
    optims = [muon([p for p in model.parameters() if p.ndim == 2], **MUON)]
    if biases:
        optims.append(torch.optim.AdamW([p for p in model.parameters() if p.ndim == 1], **ADAMW))
    return model, optims


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _step(model: nn.Module, optims: list, step: int, rank: int) -> None:
    """One step on this rank's own batch (the default averaged gradient)."""
    g = torch.Generator().manual_seed(10 * step + rank)
    model(torch.randn(4, 24, generator=g)).square().mean().backward()
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _snapshot(model: nn.Module, optims: list) -> dict[str, torch.Tensor]:
    """Whole parameters and optimizer state ("state/a.weight/momentum_buffer") by name (every
    rank gathers)."""
    out = {}
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            for name, p in model.named_parameters():
                out[f"param/{_clean(name)}"] = p.detach().clone()
    for name, p in model.named_parameters():
        if not isinstance(model, FSDP):
            out[f"param/{_clean(name)}"] = _full(p)
        (state,) = [optim.state[p] for optim in optims if p in optim.state]
        for key, value in state.items():
            out[f"state/{_clean(name)}/{key}"] = _full(value)
    return out


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for key in want:
        diff = (got[key].double() - want[key].double()).abs().max().item()
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs (max {diff:.3g})"


# ---- 1. by name, full and sharded, at 2 ranks ------------------------------------------------------

_DDP: dict[str, dict] = {}  # this rank process's DDP + torch.optim.Muon reference, trained once


def _ddp_reference(rank: int) -> dict[str, dict]:
    """{"after 3": snapshot, "after 6": snapshot} of DDP + torch.optim.Muon."""
    if not _DDP:
        model, optims = _build("ddp")
        for step in range(3):
            _step(model, optims, step, rank)
        _DDP["after 3"] = _snapshot(model, optims)
        for step in range(3, 6):
            _step(model, optims, step, rank)
        _DDP["after 6"] = _snapshot(model, optims)
    return _DDP


def _optim_rank0_only(model: nn.Module):
    """The full optimizer state on rank 0 only (the other ranks get {}; loading broadcasts it
    from rank 0); the model's full on every rank, as an FSDP1 script loads it from one file."""
    return FSDP.state_dict_type(
        model,
        fsdp_lite.StateDictType.FULL_STATE_DICT,
        fsdp_lite.FullStateDictConfig(),
        fsdp_lite.FullOptimStateDictConfig(rank0_only=True),
    )


def _state_dicts(kind: str, model: nn.Module, optim, how: str) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts, keyed by name, as each front's users take
    them: ``how`` is "full" (every rank), "rank0" (full on rank 0 only) or "sharded"."""
    if kind.startswith("fsdp1/"):
        if how == "full":  # the default type, FULL_STATE_DICT: every rank gets full tensors
            return model.state_dict(), FSDP.optim_state_dict(model, optim)
        if how == "rank0":
            with _optim_rank0_only(model):
                return model.state_dict(), FSDP.optim_state_dict(model, optim)
        with FSDP.state_dict_type(
            model,
            fsdp_lite.StateDictType.SHARDED_STATE_DICT,
            fsdp_lite.ShardedStateDictConfig(_use_dtensor=True),
            fsdp_lite.ShardedOptimStateDictConfig(_use_dtensor=True),
        ):
            return model.state_dict(), FSDP.optim_state_dict(model, optim)
    # torch's rule: full with cpu_offload gives rank 0 everything, the other ranks nothing
    options = StateDictOptions(full_state_dict=how != "sharded", cpu_offload=how == "rank0")
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optim, options=options
    )


def _load(kind: str, model: nn.Module, optim, msd: dict, osd: dict, how: str) -> None:
    if kind.startswith("fsdp1/"):
        if how == "full":
            model.load_state_dict(msd)
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
            return
        if how == "rank0":
            with _optim_rank0_only(model):
                model.load_state_dict(msd)
                optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
            return
        with FSDP.state_dict_type(
            model,
            fsdp_lite.StateDictType.SHARDED_STATE_DICT,
            fsdp_lite.ShardedStateDictConfig(_use_dtensor=True),
            fsdp_lite.ShardedOptimStateDictConfig(_use_dtensor=True),
        ):
            model.load_state_dict(msd)
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
        return
    options = StateDictOptions(
        full_state_dict=how != "sharded", broadcast_from_rank0=how == "rank0"
    )
    set_model_state_dict(model, msd, options=options)
    set_optimizer_state_dict(model, optim, osd, options=options)


def _by_name(kind: str, how: str):
    def check(rank: int, world_size: int) -> None:
        want = _ddp_reference(rank)
        model, optims = _build(kind)
        for step in range(3):
            _step(model, optims, step, rank)
        msd, osd = _state_dicts(kind, model, optims[0], how)
        if how == "rank0" and rank != 0:
            assert osd == {}, list(osd)
        else:
            saved = {f"state/{n}/{k}": v for n, s in osd["state"].items() for k, v in s.items()}
            assert all(isinstance(v, DTensor) == (how == "sharded") for v in saved.values()), {
                k: type(v).__name__ for k, v in saved.items()
            }
            momentum = {k: v for k, v in want["after 3"].items() if k.startswith("state/")}
            _assert_bitwise({k: _full(v) for k, v in saved.items()}, momentum, f"{kind} saved")
        # Copies, as from a file: the fresh optimizer must not share the old one's tensors.
        msd, osd = torch.load(_bytes((msd, osd)), weights_only=False)
        fresh, fresh_optims = _build(kind, seed=1)  # other initial weights, no momentum yet
        assert not fresh_optims[0].state
        _load(kind, fresh, fresh_optims[0], msd, osd, how)
        _assert_bitwise(_snapshot(fresh, fresh_optims), want["after 3"], f"{kind} loaded")
        for step in range(3, 6):
            _step(fresh, fresh_optims, step, rank)
        _assert_bitwise(_snapshot(fresh, fresh_optims), want["after 6"], f"{kind} resumed")

    return check


def _bytes(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


BY_NAME_KINDS = ("fsdp1/FULL_SHARD", "fsdp1/SHARD_OPTIM", "fully_shard")
CHECKS = {
    f"{kind}/{how}": _by_name(kind, how)
    for kind in BY_NAME_KINDS
    for how in ("full", "rank0", "sharded")
}


def _rank_by_name(rank: int, world_size: int) -> dict[str, str]:
    return run_checks(CHECKS, list(CHECKS), rank, world_size)


@pytest.fixture(scope="module")
def by_name_results(tmp_path_factory):
    return run_ranks(_rank_by_name, 2, tmp_path_factory.mktemp("by_name"), timeout=300)


@pytest.mark.parametrize("check", list(CHECKS))
def test_state_dict_by_name_is_ddp_and_resumes_bitwise(by_name_results, check):
    for rank, failures in enumerate(by_name_results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"


# ---- 2. checkpoints across world sizes: 2 -> 4 -> 3 ranks -----------------------------------------

V = 4  # Canonical's virtual micro-batches: 2 and 4 ranks divide it
LEGS = {2: range(0, 3), 4: range(3, 6), 3: range(6, 9)}
# (front, checkpoint API): fsdp_lite.checkpoint for both fronts and ZeRO-1; torch DCP with the
# state-dict API (get/set_model_state_dict, get/set_optimizer_state_dict) as FSDP2 users write it.
CHAINS = [
    ("fsdp1/FULL_SHARD", "fsdp_lite.checkpoint"),
    ("fsdp1/SHARD_OPTIM", "fsdp_lite.checkpoint"),
    ("fully_shard", "fsdp_lite.checkpoint"),
    ("fully_shard", "dcp"),
]


def _global_batch(step: int) -> torch.Tensor:
    """The same global batch on every rank: V micro-batches of 2 rows."""
    return torch.randn(2 * V, 24, generator=torch.Generator().manual_seed(100 + step))


def _canonical_step(model: nn.Module, optims: list, canon: Canonical, step: int) -> None:
    for micro in canon.micro_batches(_global_batch(step)):
        model(micro).square().mean().backward()
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _save(api: str, model: nn.Module, optims: list, path: str) -> None:
    if api == "fsdp_lite.checkpoint":
        fsdp_lite.checkpoint.save(model, optims, path)
    else:
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optims),
        }
        dcp.save(state, checkpoint_id=path)


def _restore(api: str, model: nn.Module, optims: list, path: str) -> None:
    if api == "fsdp_lite.checkpoint":
        fsdp_lite.checkpoint.load(model, optims, path)
    else:
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optims),
        }
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optims, state["optim"])


def _owners(model: nn.Module, muon: Muon) -> dict[str, int | None]:
    return {_clean(n): muon.whole.owner(p) for n, p in model.named_parameters() if p.ndim == 2}


PREVIOUS = {4: 2, 3: 4}  # the world size whose checkpoint each leg loads


def _leg(rank: int, world_size: int, root: str, reference: bytes | None) -> bytes:
    """This world size's leg of each chain; at 2 ranks also the uninterrupted canonical run."""
    out: dict = {}
    for kind, api in CHAINS:
        path = f"{root}/{kind.replace('/', '_')}_{api}"
        model, optims = _build(kind, seed=0 if world_size == 2 else 1, biases=True)
        if world_size == 2 and (kind, "uninterrupted") not in out:  # 6 canonical steps
            whole, whole_optims = _build(kind, biases=True)
            whole_canon = Canonical(whole, virtual_batches=V)
            for step in (*LEGS[2], *LEGS[4]):
                _canonical_step(whole, whole_optims, whole_canon, step)
            out[(kind, "uninterrupted")] = _snapshot(whole, whole_optims)
        if world_size != 2:
            assert not any(optim.state for optim in optims)  # Muon's momentum is made lazily
            _restore(api, model, optims, f"{path}_{PREVIOUS[world_size]}")
            out[(kind, api, "loaded")] = _snapshot(model, optims)
        out[(kind, api, "owners")] = _owners(model, optims[0])
        if world_size == 3:  # not canonical (3 is no power of two): torch's on whole copies
            steps = _shadowed_steps(kind, model, optims, LEGS[3], rank, reference)
            out[(kind, api, "steps")] = steps
        else:
            canon = Canonical(model, virtual_batches=V)
            for optim in optims:
                canon.check_optimizer(optim)
            for step in LEGS[world_size]:
                _canonical_step(model, optims, canon, step)
            _save(api, model, optims, f"{path}_{world_size}")
        out[(kind, api, "end")] = _snapshot(model, optims)
    return _bytes(out).getvalue()


def _shadowed_steps(kind, model, optims, steps, rank, reference: bytes) -> list[str]:
    """Step ``model`` (default averaged gradients) beside torch.optim.Muon and AdamW on whole
    copies that start from the uninterrupted run's state and take the model's gradients; after
    each step both bitwise alike. Returns what it compared."""
    start = torch.load(io.BytesIO(reference), weights_only=False)[(kind, "uninterrupted")]
    names = [_clean(n) for n, _ in model.named_parameters()]
    shadow = {n: nn.Parameter(start[f"param/{n}"].clone()) for n in names}
    torch_optims = [
        torch.optim.Muon([p for p in shadow.values() if p.ndim == 2], **MUON),
        torch.optim.AdamW([p for p in shadow.values() if p.ndim == 1], **ADAMW),
    ]
    for n in names:
        torch_optim = torch_optims[0 if shadow[n].ndim == 2 else 1]
        prefix = f"state/{n}/"
        torch_optim.state[shadow[n]] = {
            key.removeprefix(prefix): value.clone()
            for key, value in start.items()
            if key.startswith(prefix)
        }
    compared = []
    for step in steps:
        g = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(4, 24, generator=g)).square().mean().backward()
        grads = {_clean(n): _full(p.grad) for n, p in model.named_parameters()}
        for n in names:
            shadow[n].grad = grads[n]
        for optim in (*optims, *torch_optims):
            optim.step()
            optim.zero_grad()
        want = _snapshot_plain(shadow, torch_optims)
        _assert_bitwise(_snapshot(model, optims), want, f"{kind} 3 ranks step {step}")
        compared.append(f"step {step}")
    return compared


def _snapshot_plain(params: dict[str, nn.Parameter], optims: list) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        state = optims[0 if p.ndim == 2 else 1].state[p]
        out.update({f"state/{n}/{key}": value.clone() for key, value in state.items()})
    return out


@pytest.fixture(scope="module")
def legs(tmp_path_factory) -> dict[int, dict]:
    root = str(tmp_path_factory.mktemp("muon_checkpoints"))
    results: dict[int, dict] = {}
    reference = None
    for n in (2, 4, 3):  # each leg loads the checkpoint the last one saved
        launch = run_ranks(
            _leg, n, tmp_path_factory.mktemp(f"leg{n}"), timeout=300, args=(root, reference)
        )
        if n == 2:
            reference = launch[0]
        results[n] = torch.load(io.BytesIO(launch[0]), weights_only=False)
    return results


CHAIN_IDS = [f"{kind}-{api}" for kind, api in CHAINS]


@pytest.mark.parametrize("kind, api", CHAINS, ids=CHAIN_IDS)
def test_checkpoint_2_to_4_ranks_is_the_uninterrupted_run(legs, kind, api):
    """After 3 canonical steps at 2 ranks, a checkpoint, and 3 at 4 ranks: the uninterrupted
    canonical run's parameters and momentum, bitwise (the 4-rank leg started from the loaded
    state: other initial weights, no momentum before loading)."""
    want = legs[2][(kind, "uninterrupted")]
    _assert_bitwise(legs[4][(kind, api, "end")], want, f"{kind} {api} 2 -> 4 ranks")


@pytest.mark.parametrize("kind, api", CHAINS, ids=CHAIN_IDS)
def test_checkpoint_loads_at_3_ranks_and_continues_as_torch_muon(legs, kind, api):
    """The 4-rank leg's checkpoint loaded at 3 ranks (uneven shards) is the uninterrupted run's
    state, and 3 steps on it are torch.optim.Muon's on whole copies (compared after each)."""
    want = legs[2][(kind, "uninterrupted")]
    _assert_bitwise(legs[3][(kind, api, "loaded")], want, f"{kind} {api} loaded at 3 ranks")
    assert legs[3][(kind, api, "steps")] == ["step 6", "step 7", "step 8"]


@pytest.mark.parametrize("kind, api", CHAINS, ids=CHAIN_IDS)
def test_owner_placements_differ_between_legs(legs, kind, api):
    """Each world size places the Newton-Schulz owners anew (costs m n min(m, n): a 6144, b 6144,
    c 1536, d 392, each to the least-loaded rank); the state does not follow them."""
    placements = {n: legs[n][(kind, api, "owners")] for n in (2, 4, 3)}
    want = {2: [0, 1, 0, 1], 4: [0, 1, 2, 3], 3: [0, 1, 2, 2]}
    names = ["a.weight", "b.weight", "c.weight", "d.weight"]
    assert placements == {n: dict(zip(names, owners)) for n, owners in want.items()}, placements
