"""The wrapper's public surface: bad input, the everyday methods, names and state dicts.

Each group of checks runs in one multi-process launch (process start-up dominates the cost); the
rank functions assert, and a failure names the rank, the strategy and the check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_lite import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.trace import record_collectives
from tests.parity import POLICIES, assert_close, build_model, local, loss_fn, rank_batch, shard_of
from tests.ranks import run_ranks

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
EXACT = dict(rtol=0.0, atol=0.0)  # 2 ranks: same arithmetic as DDP, see test_parity.py


# ---- bad input ---------------------------------------------------------------------------------

BAD_INPUT = {
    "module_not_a_module": (lambda m, g: FSDP("linear"), TypeError, "module must be Module"),
    "strategy_as_string": (
        lambda m, g: FSDP(m, sharding_strategy="FULL_SHARD"),
        TypeError,
        "sharding_strategy must be fsdp_lite.api.ShardingStrategy (or torch FSDP's "
        "ShardingStrategy), got builtins.str",
    ),
    "hybrid_with_1d_mesh": (
        lambda m, g: FSDP(
            m,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=DeviceMesh.from_group(g, "cpu"),
        ),
        ValueError,
        "HYBRID_SHARD needs a 2-D device_mesh, got 1-D",
    ),
    "disk_offload_with_no_shard_not_built": (
        lambda m, g: FSDP(
            m,
            sharding_strategy=ShardingStrategy.NO_SHARD,
            cpu_offload=CPUOffload(offload_params=True, offload_dir="/tmp"),
        ),
        NotImplementedError,
        "offload_dir and NO_SHARD",
    ),
    "cpu_offload_wrong_type": (
        lambda m, g: FSDP(m, cpu_offload=True),
        TypeError,
        "cpu_offload must be fsdp_lite.api.CPUOffload",
    ),
    "mixed_precision_integer_dtype": (
        lambda m, g: FSDP(m, mixed_precision=MixedPrecision(param_dtype=torch.int32)),
        TypeError,
        "MixedPrecision.param_dtype must be a floating torch.dtype",
    ),
    "param_init_fn_not_callable": (
        lambda m, g: FSDP(m, param_init_fn=3),
        ValueError,  # torch FSDP1's class; its words too ("to be callable")
        "param_init_fn must be callable: expected 3 to be callable",
    ),
    "policy_not_callable": (
        lambda m, g: FSDP(m, auto_wrap_policy=5),
        TypeError,
        "auto_wrap_policy must be a callable or a Policy",
    ),
    "prefetch_as_string": (
        lambda m, g: FSDP(m, backward_prefetch="pre"),
        TypeError,
        "backward_prefetch must be fsdp_lite.api.BackwardPrefetch",
    ),
    "ignored_not_a_module": (
        lambda m, g: FSDP(m, ignored_modules=["fc1"]),
        ValueError,
        "ignored_modules expects nn.Module list elements but got types",
    ),
    "device_id_as_list": (lambda m, g: FSDP(m, device_id=["cpu"]), TypeError, "device_id"),
    "flag_not_bool": (
        lambda m, g: FSDP(m, sync_module_states="yes"),
        TypeError,
        "sync_module_states must be bool",
    ),
    "process_group_wrong_type": (
        lambda m, g: FSDP(m, process_group="world"),
        TypeError,
        "process_group must be ProcessGroup",
    ),
    "group_tuple_without_hybrid": (
        lambda m, g: FSDP(m, process_group=(g, g)),
        ValueError,
        "a (shard, replicate) process_group tuple needs HYBRID_SHARD, not FULL_SHARD",
    ),
    "already_wrapped": (lambda m, g: FSDP(FSDP(m)), ValueError, "already a FullyShardedModule"),
}


def _bad_input_rank(rank: int, world_size: int) -> dict:
    seen = {}
    for case, (make, _, _) in BAD_INPUT.items():
        try:
            make(build_model("mlp"), dist.group.WORLD)
        except Exception as e:  # noqa: BLE001 - the test compares type and message
            seen[case] = (type(e).__name__, str(e))
        else:
            seen[case] = ("no error", "")
    # A rank that raised must not leave the other waiting in a collective: prove the group works.
    probe = torch.ones(1)
    dist.all_reduce(probe)
    seen["group_still_usable"] = ("ok" if probe.item() == world_size else "broken", "")
    return seen


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    return run_ranks(_bad_input_rank, 2, tmp_path_factory.mktemp("bad_input"))


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_clear_error_before_any_collective(bad_input_results, case):
    _, error_type, message = BAD_INPUT[case]
    for rank, seen in enumerate(bad_input_results):
        name, text = seen[case]
        assert name == error_type.__name__, f"rank {rank}: {case}: got {name}: {text}"
        assert message in text, f"rank {rank}: {case}: message {text!r} lacks {message!r}"
    assert all(seen["group_still_usable"][0] == "ok" for seen in bad_input_results)


def _mismatch_rank(rank: int, world_size: int, kind: str) -> str:
    torch.manual_seed(0)
    if kind == "shape":
        model = nn.Sequential(
            nn.Linear(4, 8 if rank == 0 else 9), nn.Linear(8 if rank == 0 else 9, 2)
        )
    elif kind == "count":
        layers = [nn.Linear(4, 4) for _ in range(2 if rank == 0 else 3)]
        model = nn.Sequential(*layers)
    else:
        model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float32 if rank == 0 else torch.float64))
    try:
        FSDP(model)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "kind, expected",
    [
        (
            "shape",
            "parameter '0.weight' is (8, 4) torch.float32 on rank 0 but '0.weight' is (9, 4)",
        ),
        ("count", "rank 0 has 4 parameters, rank 1 has 6"),
        ("dtype", "torch.float32 on rank 0 but '0.weight' is (4, 4) torch.float64 on rank 1"),
    ],
)
def test_models_that_differ_across_ranks_fail_on_every_rank(tmp_path, kind, expected):
    messages = run_ranks(_mismatch_rank, 2, tmp_path, args=(kind,), timeout=60)
    for rank, message in enumerate(messages):
        assert "ranks built different models" in message, f"rank {rank}: {message}"
        assert expected in message, f"rank {rank}: {message!r} lacks {expected!r}"


# ---- everyday methods --------------------------------------------------------------------------


def _wrapped_lm(strategy_name: str) -> FSDP:
    return FSDP(
        build_model("lm"),
        sharding_strategy=ShardingStrategy[strategy_name],
        auto_wrap_policy=POLICIES["lm"],
    )


def _check_no_sync(rank, world_size, strategy_name):
    ddp, fsdp = DDP(build_model("lm")), _wrapped_lm(strategy_name)
    ref = dict(ddp.module.named_parameters())
    x0, y0 = rank_batch("lm", 0, rank, world_size)
    x1, y1 = rank_batch("lm", 1, rank, world_size)
    with ddp.no_sync():
        loss_fn("lm", ddp(x0), y0).backward()
    with fsdp.no_sync(), record_collectives(fsdp) as trace:
        loss_fn("lm", fsdp(x0), y0).backward()
    reductions = [r for r in trace.records if r.kind != "all_gather"]
    assert not reductions, f"{strategy_name}: no_sync reduced gradients: {reductions}"
    loss_fn("lm", ddp(x1), y1).backward()
    loss_fn("lm", fsdp(x1), y1).backward()
    for name, p in fsdp.named_parameters():
        want = ref[name].grad
        want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
        assert_close(local(p.grad), want, what=f"{strategy_name} no_sync grad {name}", **EXACT)


def _check_clip_grad_norm(rank, world_size, strategy_name):
    for norm_type in (2.0, float("inf"), 1.0):
        ddp, fsdp = DDP(build_model("lm")), _wrapped_lm(strategy_name)
        ref = dict(ddp.module.named_parameters())
        x, y = rank_batch("lm", 0, rank, world_size)
        loss_fn("lm", ddp(x), y).backward()
        loss_fn("lm", fsdp(x), y).backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05, norm_type=norm_type)
        got_norm = fsdp.clip_grad_norm_(0.05, norm_type=norm_type)
        what = f"{strategy_name} clip_grad_norm_ norm_type={norm_type}"
        assert want_norm > 0.05, f"{what}: test needs a norm above max_norm, got {want_norm}"
        # torch takes the norm of per-tensor norms; we sum shard powers across ranks first, so the
        # float32 sums run in another order: a few ulps.
        assert_close(got_norm, want_norm, what=f"{what} total norm", rtol=2e-6, atol=0)
        for name, p in fsdp.named_parameters():
            want = ref[name].grad
            want = shard_of(want, rank, world_size) if hasattr(p, "to_local") else want
            assert_close(local(p.grad), want, what=f"{what} grad {name}", rtol=4e-6, atol=1e-9)


def _check_summon_full_params(rank, world_size, strategy_name):
    plain = build_model("lm")
    fsdp = _wrapped_lm(strategy_name)
    want = dict(plain.named_parameters())
    with FSDP.summon_full_params(fsdp, writeback=False):
        for name, p in fsdp.named_parameters():
            assert p.shape == want[name].shape, f"{strategy_name} summon shape {name}"
            assert_close(p, want[name], what=f"{strategy_name} summon {name}", **EXACT)
    # writeback=True keeps changes; writeback=False drops them
    with FSDP.summon_full_params(fsdp, writeback=False):
        with torch.no_grad():
            for p in fsdp.parameters():
                p.fill_(7.0)
    if strategy_name != "NO_SHARD":  # NO_SHARD's "full params" are the params themselves
        with FSDP.summon_full_params(fsdp):
            assert all(not (p == 7.0).all() for p in fsdp.parameters()), "writeback=False leaked"
    with FSDP.summon_full_params(fsdp, writeback=True):
        with torch.no_grad():
            for p in fsdp.parameters():
                p.fill_(3.0)
    for name, p in fsdp.named_parameters():
        assert (local(p) == 3.0).all(), f"{strategy_name} writeback lost for {name}"
    # rank0_only: only rank 0 sees full shapes
    with FSDP.summon_full_params(fsdp, rank0_only=True, writeback=False):
        full = all(
            p.shape == want[n].shape and not hasattr(p, "to_local")
            for n, p in fsdp.named_parameters()
        )
        assert full == (rank == 0 or strategy_name == "NO_SHARD"), f"rank0_only on rank {rank}"
    with FSDP.summon_full_params(fsdp, offload_to_cpu=True, writeback=False):
        assert all(p.device.type == "cpu" for p in fsdp.parameters())
    # recurse=False: only the root's own unit is unsharded
    with FSDP.summon_full_params(fsdp, recurse=False, writeback=False):
        block_weight = fsdp.blocks[0].qkv.weight
        root_weight = fsdp.tok.weight
        assert not hasattr(root_weight, "to_local"), "root not unsharded by recurse=False"
        assert hasattr(block_weight, "to_local") == (strategy_name != "NO_SHARD")
    # with_grads: full gradients equal DDP's
    ddp = DDP(build_model("lm"))
    x, y = rank_batch("lm", 0, rank, world_size)
    fsdp2 = _wrapped_lm(strategy_name)
    loss_fn("lm", ddp(x), y).backward()
    loss_fn("lm", fsdp2(x), y).backward()
    ref = dict(ddp.module.named_parameters())
    with FSDP.summon_full_params(fsdp2, with_grads=True, writeback=False):
        for name, p in fsdp2.named_parameters():
            assert_close(p.grad, ref[name].grad, what=f"{strategy_name} with_grads {name}", **EXACT)
    with pytest.raises(ValueError, match="rank0_only=True needs writeback=False"):
        with FSDP.summon_full_params(fsdp, rank0_only=True):
            pass


def _check_structure(rank, world_size, strategy_name):
    plain = build_model("lm")
    fsdp = _wrapped_lm(strategy_name)
    wrappers = FSDP.fsdp_modules(fsdp)
    assert len(wrappers) == 1 + plain.cfg.n_layers, wrappers
    assert FSDP.fsdp_modules(fsdp, root_only=True) == [fsdp]
    assert fsdp.check_is_root() and not wrappers[1].check_is_root()
    assert fsdp.module is fsdp._fsdp_wrapped_module
    assert fsdp.cfg == plain.cfg, "attribute forwarding to the wrapped module"
    assert isinstance(fsdp.blocks[0], FSDP), "blocks are units of their own"
    assert [n for n, _ in fsdp.named_parameters()] == [n for n, _ in plain.named_parameters()]
    seq = FSDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    assert isinstance(seq[1], nn.Linear), "indexing forwards to the wrapped Sequential"
    # state_dict: the unwrapped module's keys and full values; loads back, also into a plain module
    full = fsdp.state_dict()
    assert list(full) == list(plain.state_dict()), (list(full), list(plain.state_dict()))
    for key, value in plain.state_dict().items():
        assert_close(full[key], value, what=f"{strategy_name} state_dict {key}", **EXACT)
    changed = {k: v + 1.0 for k, v in full.items()}
    fresh = _wrapped_lm(strategy_name)
    fresh.load_state_dict(changed)
    for key, value in fresh.state_dict().items():
        assert_close(value, changed[key], what=f"{strategy_name} load_state_dict {key}", **EXACT)
    copy.deepcopy(plain).load_state_dict(fresh.state_dict())
    # apply() sees full parameters
    fsdp.apply(lambda m: nn.init.constant_(m.weight, 0.5) if isinstance(m, nn.Linear) else None)
    with FSDP.summon_full_params(fsdp):
        assert (fsdp.blocks[1].fc.weight == 0.5).all(), "apply() did not reach a nested unit"


def _methods_rank(rank: int, world_size: int, strategy_name: str, check: str) -> None:
    globals()[f"_check_{check}"](rank, world_size, strategy_name)


@pytest.mark.parametrize("check", ["no_sync", "clip_grad_norm", "summon_full_params", "structure"])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_everyday_methods_match_torch_semantics(tmp_path, strategy_name, check):
    run_ranks(_methods_rank, 2, tmp_path, args=(strategy_name, check), timeout=120)
