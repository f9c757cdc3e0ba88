"""The canonical reduction mode (fsdp_lite.Canonical, docs/invariance.md): 6 AdamW steps with
clipping and a frozen parameter give bitwise equal parameters, optimizer state and reported losses at
1, 2 and 4 ranks, for both fronts and every strategy it covers, fp32 and bf16 params with an fp32
reduce; in fp32 also bitwise one process with no process group. One launch per world size."""

from __future__ import annotations

import io
import math
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import fsdp_lite
import fsdp_lite.checkpoint
from fsdp_lite.canonical import Canonical
from fsdp_lite.engine import canonical
from tests.ranks import run_ranks

V = 8  # virtual micro-batches per global batch
STEPS = 6
VOCAB, DIM = 29, 12  # 29 rows: uneven at 2 and at 4 ranks


class Net(nn.Module):
    """An embedding, two blocks (LayerNorm, Linear 7 rows out, Linear back) and a head; the first
    block's LayerNorm is frozen; ``gate`` is used only by micro-batches whose first token is even,
    ``spare`` by none."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 7), nn.GELU(), nn.Linear(7, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)
        self.gate = nn.Parameter(torch.ones(DIM))
        self.spare = nn.Parameter(torch.zeros(3))
        for p in self.blocks[0][0].parameters():
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if int(tokens[0, 0]) % 2 == 0:
            x = x * self.gate
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _hsdp_mesh(kind: str):
    """ "hsdp/2x2" -> a (replicate 2, shard 2) mesh; None for other kinds."""
    if "hsdp/" not in kind:
        return None
    replicas, shards = map(int, kind.split("/")[1].split("x"))
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _wrap(kind: str, model: nn.Module, bf16: bool) -> nn.Module:
    mesh = _hsdp_mesh(kind)
    if kind == "plain":
        return model
    if kind.startswith("hsdp/"):
        mp = fsdp_lite.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
        return fsdp_lite.FullyShardedDataParallel(
            model,
            sharding_strategy=fsdp_lite.ShardingStrategy.HYBRID_SHARD,
            auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({nn.Sequential}),
            mixed_precision=mp,
            device_mesh=mesh,
            use_orig_params=True,
        )
    if kind.startswith("fsdp1/"):
        mp = fsdp_lite.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
        policy = fsdp_lite.wrap.ModuleWrapPolicy({nn.Sequential})
        strategy, _, offload = kind.removeprefix("fsdp1/").partition("+")
        return fsdp_lite.FullyShardedDataParallel(
            model,
            sharding_strategy=fsdp_lite.ShardingStrategy[strategy],
            cpu_offload=fsdp_lite.CPUOffload(
                offload_params=bool(offload),
                offload_dir=tempfile.mkdtemp() if offload == "disk" else None,
            ),
            auto_wrap_policy=policy,
            mixed_precision=mp,
            use_orig_params=True,
        )
    mp = fsdp_lite.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
    extra = {"mp_policy": mp} if mp is not None else {}
    if mesh is not None:
        extra["mesh"] = mesh
    if kind == "fully_shard_hpz2":  # ZeRO++'s hpZ: after forward keep 1/2 of the params, not 1/N
        extra["reshard_after_forward"] = 2
    if kind == "fully_shard_keep":  # ZeRO-2: keep the params from forward to backward
        extra["reshard_after_forward"] = False
    for block in model.blocks:
        fsdp_lite.fully_shard(block, **extra)
    fsdp_lite.fully_shard(model, **extra)
    return model


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(
    kind: str,
    bf16: bool,
    steps: range = range(STEPS),
    load: str | None = None,
    save: str | None = None,
) -> dict[str, torch.Tensor]:
    """``steps`` on the same global batches (after loading the checkpoint ``load``, then saving
    to ``save``); everything that must not depend on N, by name."""
    torch.set_num_threads(1)  # the contract: the same thread count in every run
    torch.manual_seed(0)
    kind, _, schedule = kind.partition("@")  # "fsdp1/FULL_SHARD@local": the local schedule
    model = _wrap(kind, Net(), bf16)
    canon = Canonical(model, virtual_batches=V, schedule=schedule or "interleaved")
    optim = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True
    )
    canon.check_optimizer(optim)
    if load is not None:
        fsdp_lite.checkpoint.load(model, optim, load)
    out: dict[str, torch.Tensor] = {}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(VOCAB, (2 * V, 9), generator=g)  # 16 sequences: 2 per leaf
        losses = []
        for micro in canon.micro_batches(tokens):
            logits = model(micro[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), micro[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss.detach())
        out[f"norm/{step}"] = canon.clip_grad_norm_(0.5 if step % 2 else 50.0)
        if step == steps[-1]:  # the last step's clipped gradients
            for name, p in model.named_parameters():
                if p.grad is not None:
                    out[f"grad/{_clean(name)}"] = _full(p.grad)
        optim.step()
        optim.zero_grad()
        out[f"loss/{step}"] = canon.mean(losses)
    if save is not None:
        fsdp_lite.checkpoint.save(model, optim, save)
    for name, p in model.named_parameters():
        name = _clean(name)
        out[f"param/{name}"] = _full(p)
        for key, value in optim.state.get(p, {}).items():
            out[f"state/{name}/{key}"] = _full(value)
    return out


KINDS = [
    "fsdp1/FULL_SHARD",
    "fsdp1/SHARD_GRAD_OP",
    "fsdp1/NO_SHARD",
    "fsdp1/SHARD_OPTIM",
    "fully_shard",
    "fully_shard_keep",
]
RUNS = [(kind, bf16) for kind in KINDS for bf16 in (False, True)]


# Elastic resume, 4 -> 2 -> 1 ranks: steps 0-1 at 4 ranks, 2-3 at 2, 4-5 at 1 (and in one
# process without a process group), each leg loading the sharded checkpoint the last one saved.
ELASTIC = {4: range(0, 2), 2: range(2, 4), 1: range(4, STEPS)}
ELASTIC_RUNS = [("fsdp1/FULL_SHARD", False), ("fully_shard", True)]


def _elastic_leg(run: tuple[str, bool], world_size: int, root: str) -> dict[str, torch.Tensor]:
    name = run[0].replace("/", "_") + ("_bf16" if run[1] else "")
    load = None if world_size == 4 else f"{root}/{name}_{2 * world_size}"
    return _train(*run, ELASTIC[world_size], load=load, save=f"{root}/{name}_{world_size}")


# HYBRID_SHARD at every (replicate, shard) mesh of 2 and 4 ranks: the 1-rank FULL_SHARD bits.
HSDP_RUNS = {
    4: [
        ("fully_shard_hpz2", False),
        ("hsdp/2x2", False),
        ("hsdp/4x1", False),
        ("hsdp/1x4", False),
        ("fully_shard_hsdp/2x2", True),
    ],
    2: [("hsdp/2x1", False), ("hsdp/1x2", False)],
    1: [],
}


# Shards, gradients and optimizer state offloaded to CPU memory and to files: the same bits.
OFFLOAD_RUNS = [("fsdp1/FULL_SHARD+cpu", False), ("fsdp1/FULL_SHARD+disk", False)]
# The local schedule (each rank's adjacent leaves summed unsharded, one reduction per step).
LOCAL_RUNS = [
    ("fsdp1/FULL_SHARD@local", False),
    ("fsdp1/FULL_SHARD@local", True),
    ("fsdp1/NO_SHARD@local", False),
    ("fsdp1/SHARD_OPTIM@local", False),
    ("fully_shard@local", True),
]


def _rank(rank: int, world_size: int, root: str) -> bytes:
    runs = RUNS + HSDP_RUNS[world_size] + OFFLOAD_RUNS + LOCAL_RUNS
    if world_size == 4:
        runs.append(("hsdp/2x2@local", False))
    results = {run: _train(*run) for run in runs}
    results.update({("elastic", *run): _elastic_leg(run, world_size, root) for run in ELASTIC_RUNS})
    buffer = io.BytesIO()  # tensors cross the process boundary as bytes, not shared memory
    torch.save(results, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def by_world_size(tmp_path_factory, checkpoints) -> dict[int, dict]:
    results = {}
    for n in (4, 2, 1):  # the elastic legs run in this order
        launch = run_ranks(
            _rank, n, tmp_path_factory.mktemp(f"c{n}"), timeout=400, args=(checkpoints,)
        )
        results[n] = torch.load(io.BytesIO(launch[0]))
    return results


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        same = torch.equal(
            got[key].view(-1).view(torch.uint8), want[key].view(-1).view(torch.uint8)
        )
        diff = (got[key].double() - want[key].double()).abs().max().item()
        assert same, f"{what}: {key} differs (max {diff:.3g})"


@pytest.mark.parametrize("run", RUNS, ids=[f"{k}-{'bf16' if b else 'fp32'}" for k, b in RUNS])
def test_same_bits_at_1_2_4_ranks(by_world_size, run):
    one = by_world_size[1][run]
    for n in (2, 4):
        _assert_bitwise(by_world_size[n][run], one, f"{run} at {n} ranks vs 1")


@pytest.fixture(scope="module")
def plain_run() -> dict[str, torch.Tensor]:
    return _train("plain", False)


@pytest.mark.parametrize("kind", KINDS)
def test_one_process_without_a_process_group(by_world_size, plain_run, kind):
    """A plain nn.Module in this process, no process group: the 4-rank run's bits."""
    _assert_bitwise(plain_run, by_world_size[4][(kind, False)], f"{kind} vs plain")


@pytest.mark.parametrize(
    "n, run", [(n, run) for n, runs in HSDP_RUNS.items() for run in runs], ids=lambda v: str(v)
)
def test_hybrid_shard_meshes_give_the_same_bits(by_world_size, n, run):
    """HYBRID_SHARD 1x4, 2x2, 4x1, 1x2, 2x1 (both fronts) and hpZ at 4 ranks: the 1-rank bits."""
    same_front = "fully_shard" if run[0].startswith("fully_shard") else "fsdp1/FULL_SHARD"
    _assert_bitwise(by_world_size[n][run], by_world_size[1][(same_front, run[1])], f"{run}")


@pytest.mark.parametrize("run", OFFLOAD_RUNS, ids=[k for k, _ in OFFLOAD_RUNS])
def test_offload_gives_the_same_bits(by_world_size, run):
    """CPU and disk offload at 1, 2 and 4 ranks: the 1-rank FULL_SHARD bits."""
    for n in (1, 2, 4):
        _assert_bitwise(
            by_world_size[n][run], by_world_size[1][("fsdp1/FULL_SHARD", False)], f"{run} at {n}"
        )


@pytest.mark.parametrize(
    "run", LOCAL_RUNS, ids=[f"{k}-{'bf16' if b else 'fp32'}" for k, b in LOCAL_RUNS]
)
def test_local_schedule_gives_the_same_bits(by_world_size, run):
    """Summing each rank's leaves locally and reducing once: the interleaved schedule's bits."""
    want = by_world_size[1][(run[0].partition("@")[0], run[1])]
    for n in (1, 2, 4):
        _assert_bitwise(by_world_size[n][run], want, f"{run} at {n}")
    if run == ("fsdp1/FULL_SHARD@local", False):
        _assert_bitwise(by_world_size[4][("hsdp/2x2@local", False)], want, "hsdp/2x2@local")


@pytest.mark.parametrize("run", ELASTIC_RUNS, ids=[k for k, _ in ELASTIC_RUNS])
def test_elastic_resume_4_2_1_continues_bitwise(by_world_size, run):
    """The last leg's parameters, state and its steps' losses and norms are the uninterrupted
    runs' (which are the same at every N)."""
    resumed = by_world_size[1][("elastic", *run)]
    full = by_world_size[4][run]
    want = {k: v for k, v in full.items() if k in resumed}
    assert len(want) == len(resumed), set(resumed) - set(want)
    _assert_bitwise(resumed, want, f"{run} resumed 4 -> 2 -> 1")


def test_elastic_resume_in_one_process_without_a_process_group(by_world_size, checkpoints):
    """The 2-rank leg's checkpoint of the FSDP1 front, loaded into a plain module."""
    resumed = _train("plain", False, ELASTIC[1], load=f"{checkpoints}/fsdp1_FULL_SHARD_2")
    full = by_world_size[4][("fsdp1/FULL_SHARD", False)]
    _assert_bitwise(resumed, {k: v for k, v in full.items() if k in resumed}, "plain resumed")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700), cuts=st.lists(st.integers(1, 699), max_size=5), seed=st.integers(0, 99)
)
def test_element_tree_does_not_depend_on_the_cuts(n, cuts, seed):
    """Pieces of any contiguous split combine to the sum of the zero-padded elements in the
    fixed tree (canonical.tree_sum), bit for bit."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) ** 2
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    pieces = [pc for a, b in zip(bounds, bounds[1:]) for pc in canonical.tree_pieces(x[a:b], a, n)]
    width = 1 << max(n - 1, 0).bit_length()
    padded = torch.cat([x, x.new_zeros(width - n)])
    assert canonical.combine_pieces(pieces, n) == canonical.tree_sum(list(padded.unbind())).item()


def test_tree_sum_pushed_one_at_a_time():
    leaves = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    tree = canonical.TreeSum(8)
    results = [tree.push(leaf.clone()) for leaf in leaves]
    assert results[:-1] == [None] * 7
    assert torch.equal(results[-1], canonical.tree_sum(leaves))


def test_bad_input():
    with pytest.raises(ValueError, match="power of two"):
        Canonical(nn.Linear(2, 2), virtual_batches=6)
    canon = Canonical(nn.Linear(2, 2), virtual_batches=4)
    with pytest.raises(ValueError, match="multiple of virtual_batches"):
        canon.micro_batches(torch.zeros(6, 2))
    with pytest.raises(ValueError, match="fused=True"):
        canon.check_optimizer(torch.optim.AdamW(nn.Linear(2, 2).parameters(), fused=True))
    with pytest.raises(NotImplementedError, match="norm_type 2 or inf"):
        canon.clip_grad_norm_(1.0, norm_type=1.0)
    assert math.isfinite(canon.clip_grad_norm_(1.0).item())
    with pytest.raises(ValueError, match="schedule must be one of"):
        Canonical(nn.Linear(2, 2), virtual_batches=4, schedule="ring")
    with pytest.raises(ValueError, match="mean takes this rank's 4 values, got 3"):
        canon.mean([torch.tensor(1.0)] * 3)
    model = nn.Linear(2, 2)
    canon = Canonical(model, virtual_batches=1)
    model(torch.ones(1, 2)).sum().backward()  # the step's one leaf: its gradient lands
    with pytest.raises(RuntimeError, match="a gradient from the last step is still there"):
        model(torch.ones(1, 2)).sum().backward()  # no zero_grad between the steps


def _refusals(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"multiple of the data-parallel world size \(2\)"):
        Canonical(fsdp_lite.FullyShardedDataParallel(nn.Linear(4, 4)), virtual_batches=1)
    with pytest.raises(ValueError, match="without fsdp_lite units runs in one process"):
        Canonical(nn.Linear(4, 4), virtual_batches=2)
    model = fsdp_lite.FullyShardedDataParallel(nn.Linear(4, 4))
    Canonical(model, virtual_batches=2)
    with pytest.raises(RuntimeError, match="without gradient sync"), model.no_sync():
        model(torch.ones(2, 4)).sum().backward()
    # Two units over two process groups of the same ranks.
    two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fsdp_lite.fully_shard(two[0], mesh=DeviceMesh.from_group(dist.new_group([0, 1]), "cpu"))
    fsdp_lite.fully_shard(two, mesh=DeviceMesh.from_group(dist.new_group([0, 1]), "cpu"))
    with pytest.raises(NotImplementedError, match="share one process group"):
        Canonical(two, virtual_batches=2)
    torch.set_num_threads(1 + rank)
    try:
        with pytest.raises(RuntimeError, match=r"same torch.get_num_threads\(\) on every rank"):
            Canonical(fsdp_lite.FullyShardedDataParallel(nn.Linear(4, 4)), virtual_batches=2)
    finally:
        torch.set_num_threads(1)
    # NO_SHARD: the gradient lands on the parameter autograd accumulates into.
    plain = fsdp_lite.FullyShardedDataParallel(
        nn.Linear(4, 4), sharding_strategy=fsdp_lite.ShardingStrategy.NO_SHARD
    )
    Canonical(plain, virtual_batches=2)
    plain(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="still holds the last step's gradient"):
        plain(torch.ones(2, 4)).sum().backward()  # no zero_grad between the steps
    # Columns: a Shard(1) shard holds no contiguous range of the elements.
    cols = nn.Linear(4, 4)
    fsdp_lite.fully_shard(cols, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    canon = Canonical(cols, virtual_batches=2)
    cols(torch.ones(2, 4)).sum().backward()
    with pytest.raises(NotImplementedError, match="only dim-0 shards"):
        canon.clip_grad_norm_(1.0)
    # HSDP (2 replicas of 1 shard) with the all-reduce across replicas skipped.
    hsdp = nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    fsdp_lite.fully_shard(hsdp, mesh=mesh)
    Canonical(hsdp, virtual_batches=2)
    hsdp.set_requires_all_reduce(False)
    with pytest.raises(RuntimeError, match=r"set_requires_all_reduce\(False\) in the canonical"):
        hsdp(torch.ones(2, 4)).sum().backward()


def test_refusals_at_2_ranks(tmp_path):
    """V not a multiple of N, a plain module at 2 ranks, no_sync, units over two groups, thread
    counts that differ, a NO_SHARD gradient not zeroed, a clip of column shards and HSDP without
    its all-reduce are refused by name."""
    run_ranks(_refusals, 2, tmp_path, timeout=120)
