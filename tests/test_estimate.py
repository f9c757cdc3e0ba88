"""fsdp_lite.estimate: the ZeRO paper's numbers, the per-strategy formulas, meta-device models, the CLI.

Single process, no process group: the planner is arithmetic. The expected tables are pinned with
expecttest; regenerate them with `EXPECTTEST_ACCEPT=1 pytest tests/test_estimate.py` after checking
the change is intended.
"""

import contextlib
import io
import subprocess
import sys

import expecttest
import pytest
import torch
import torch.nn as nn

from fsdp_lite.tools.estimate import PAPER, STRATEGY_SHARDING, estimate, main, unit_numels

NUMEL = 7.5e9


def _run_main(*argv: str) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(list(argv)) == 0
    return stdout.getvalue()


class TestPaperOutput(expecttest.TestCase):
    def test_table1_matches_the_paper(self):
        # Paper values differ only in rounding: it truncates 4187.5 -> 4187 and prints 1.88 for 1.875
        self.assertExpectedInline(
            _run_main("--paper"),
            """\
ZeRO (arXiv 1910.02054) Table 1: model states per device in GB (1e9 bytes), (2+2+K)psi, K = 12
psi   Nd    P_os (ZeRO-1)  P_os+g (ZeRO-2)  P_os+g+p (ZeRO-3)
7.5B  1     120            120              120
7.5B  4     52.5           41.3             30
7.5B  16    35.6           21.6             7.5
7.5B  64    31.4           16.6             1.9
7.5B  256   30.4           15.4             0.47
7.5B  1024  30.1           15.1             0.12
128B  1     2048           2048             2048
128B  4     896            704              512
128B  16    608            368              128
128B  64    536            284              32
128B  256   518            263              8
128B  1024  513.5          257.8            2
1T    1     16000          16000            16000
1T    4     7000           5500             4000
1T    16    4750           2875             1000
1T    64    4187.5         2218.8           250
1T    256   4046.9         2054.7           62.5
1T    1024  4011.7         2013.7           15.6
""",
        )

    def test_figure1_setting_prints_120_31_4_16_6_1_9(self):
        self.assertExpectedInline(
            _run_main("--params", "7.5e9", "--world-size", "64", "--paper"),
            """\
psi = 7.5B params, world size 64 (HYBRID_SHARD: 8 x 8), bytes/param: params 2, grads 2, optimizer K = 12. GB = 1e9 bytes, per rank.
strategy       ZeRO        params  grads  optim  states  working  device  cpu  comm/step  comm GB
NO_SHARD       DDP         15      15     90     120     0        120     0    2psi       30
SHARD_OPTIM    ZeRO-1      15      15     1.4    31.4    0        31.4    0    3psi       45
SHARD_GRAD_OP  ZeRO-2      15      0.23   1.4    16.6    -        -       0    2psi       30
FULL_SHARD     ZeRO-3      0.23    0.23   1.4    1.9     -        -       0    3psi       45
HYBRID_SHARD   ZeRO-3 x R  1.9     1.9    11.3   15      -        -       0    3.25psi    48.8
states = params + grads + optim; working = transient unsharded bytes at the backward peak ('-': needs unit sizes); comm = collective volume per rank (all-reduce = 2psi; a ring sends (N-1)/N of it).
""",
        )


@pytest.mark.parametrize("world_size", [1, 4, 64, 1000])
def test_model_states_follow_the_paper_formulas(world_size):
    plan = estimate(NUMEL, world_size, **PAPER)
    psi, n, k = plan.numel, world_size, 12
    expected = {
        "NO_SHARD": (2 + 2 + k) * psi,
        "SHARD_OPTIM": 4 * psi + k * psi / n,
        "SHARD_GRAD_OP": 2 * psi + (2 + k) * psi / n,
        "FULL_SHARD": (2 + 2 + k) * psi / n,
    }
    for name, nbytes in expected.items():
        assert plan[name].states_nbytes == pytest.approx(nbytes, rel=1e-12), name


def test_figure1_numbers():
    plan = estimate(NUMEL, 64, **PAPER)
    gb = {z: plan[z].states_nbytes / 1e9 for z in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}
    assert gb == pytest.approx(
        {"DDP": 120, "ZeRO-1": 31.40625, "ZeRO-2": 16.640625, "ZeRO-3": 1.875}
    )


def test_communication_volume_is_2_psi_then_3_psi_for_zero3():
    plan = estimate(NUMEL, 64, **PAPER)
    # ZeRO-1 all-reduces (whole grads on every rank) then gathers: 3 psi, not the paper's 2
    for name, volume in [("DDP", 2), ("ZeRO-1", 3), ("ZeRO-2", 2), ("ZeRO-3", 3)]:
        assert plan[name].comm_numel == pytest.approx(volume * plan.numel), name
        assert plan[name].comm_nbytes == pytest.approx(volume * plan.numel * 2), name


def test_one_rank_communicates_nothing():
    assert all(e.comm_numel == 0 for e in estimate(NUMEL, 1, shard_size=1).estimates)


def test_hybrid_shards_within_group_and_all_reduces_the_shard_across_replicas():
    plan = estimate(NUMEL, 64, shard_size=8, **PAPER)
    hybrid, full_shard_of_8 = plan["HYBRID_SHARD"], estimate(NUMEL, 8, **PAPER)["FULL_SHARD"]
    assert hybrid.states_nbytes == full_shard_of_8.states_nbytes
    # 3Ψ inside the shard group + an all-reduce (2x) of the Ψ/8 grad shard across 8 replicas
    assert hybrid.comm_numel == pytest.approx(3 * plan.numel + 2 * plan.numel / 8)
    with pytest.raises(ValueError, match="must divide"):
        estimate(NUMEL, 64, shard_size=6)


def test_mixed_precision_defaults_add_the_fp32_master_copy():
    assert estimate(1000, 1).optim_bytes_per_param == 8  # fp32 params: AdamW m and v only
    plan = estimate(1000, 1, param_itemsize=2)
    assert (plan.grad_itemsize, plan.optim_bytes_per_param) == (2, 12)  # the paper's K
    assert plan["DDP"].states_nbytes == 16 * 1000


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(
            nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.LayerNorm(1024)
        )


def test_meta_module_gives_the_same_plan_as_its_param_count():
    model = _meta_mlp()
    numel = 1024 * 4096 + 4096 + 4096 * 1024 + 1024 + 2 * 1024
    assert estimate(model, 4, **PAPER) == estimate(numel, 4, **PAPER)


def test_units_give_the_working_set():
    model = _meta_mlp()
    units = unit_numels(model, {nn.Linear})
    assert units == (1024 * 4096 + 4096, 4096 * 1024 + 1024, 2 * 1024)  # two Linears, then root
    plan = estimate(model, 4, unit_classes={nn.Linear}, param_itemsize=2)
    largest, second, root = units
    # FULL_SHARD: params of the root (kept for backward), the unit computing and the prefetched
    # one; grads of the largest unit
    assert plan["FULL_SHARD"].working_set_nbytes == (largest + second + root) * 2 + largest * 2
    assert plan["ZeRO-2"].working_set_nbytes == largest * 2  # params stay whole, grads in flight
    assert plan["DDP"].working_set_nbytes == 0
    assert estimate(model, 4)["FULL_SHARD"].working_set_nbytes is None  # no units known


def test_offload_moves_states_to_the_cpu():
    plan = estimate(NUMEL, 64, offload=True, units=[10**8] * 75, **PAPER)
    for e in plan.estimates:
        assert e.cpu_nbytes == e.states_nbytes, e.sharding.name
    # DDP computes with whole params and grads on the device even though they are stored on the CPU
    assert plan["DDP"].device_nbytes == plan.numel * (2 + 2)
    # params of the root + two more units (all 1e8 here), grads of one unit
    assert plan["FULL_SHARD"].device_nbytes == (10**8 * 3) * 2 + 10**8 * 2


@pytest.mark.parametrize("sharding", STRATEGY_SHARDING, ids=lambda s: s.name)
def test_every_strategy_is_printed(sharding):
    assert sharding.name in _run_main("--params", "1e6", "--world-size", "8")


def test_cli_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_lite.estimate", "--params", "7.5e9", "--world-size", "64"]
        + ["--paper"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "31.4" in result.stdout and "16.6" in result.stdout


class TestMachineFit(expecttest.TestCase):
    def test_the_run_past_ram_fits_this_machines_disk_not_its_ram(self):
        # scripts/beyond_ram.py's model on this machine (docs/disk_offload.md): 1.81B fp32 params
        # with AdamW on 2 ranks, 25.3 GB of RAM, 64 GB of free disk.
        self.assertExpectedInline(
            _run_main(
                "--params", "1.81B", "--world-size", "2", "--ram-gb", "25.3", "--disk-gb", "64"
            ).split("\n\n")[1],
            """\
A node of 25.3 GB RAM and 64 GB free disk, 2 rank(s) a node; states/node = per-rank states x ranks a node.
strategy       states/node  in RAM  largest in RAM  on disk       largest on disk
NO_SHARD       57.9         no      790M            not modelled  -
SHARD_OPTIM    43.4         no      1.05B           not modelled  -
SHARD_GRAD_OP  36.2         no      1.26B           not modelled  -
FULL_SHARD     29           no      1.58B           yes           4.00B
HYBRID_SHARD   29           no      1.58B           yes           4.00B
largest: the parameter count whose states fill it, at these bytes per parameter (the working set and the page cache not counted).
""",
        )
