"""The trace: collective counts, times and memory per strategy; explain() pinned; the demo script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import expecttest
import pytest
import torch

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import MixedPrecision, ShardingStrategy
from fsdp_lite.trace import CollectiveTrace, explain, record_collectives
from tests.parity import POLICIES, build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def _trace_rank(rank: int, world_size: int) -> dict:
    """Two traced AdamW steps per strategy; the traces as JSON and each unit's unsharded bytes."""
    out = {}
    for name in STRATEGIES:
        model = FSDP(
            build_model("lm"),
            sharding_strategy=ShardingStrategy[name],
            auto_wrap_policy=POLICIES["lm"],
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with record_collectives(model, optim) as trace:
            for step in range(2):
                optim.zero_grad(set_to_none=True)
                x, y = rank_batch("lm", step, rank, world_size)
                loss_fn("lm", model(x), y).backward()
                with trace.span("optimizer"):
                    optim.step()
        units = [w._unit for w in FSDP.fsdp_modules(model)]
        out[name] = {
            "trace": trace.to_json(),
            "detached": all(o is not trace for u in units for o in u.observers),
            "unsharded_nbytes": {
                u.name: sum(p.padded_numel * 4 for p in u.params) for u in units
            },  # fp32
            "sharded_nbytes": sum(p.shard_numel * 4 for u in units for p in u.params),
            "local_nbytes": sum(p.local_numel * 4 for u in units for p in u.params),  # no padding
            "num_params": sum(len(u.params) for u in units),
        }
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return run_ranks(_trace_rank, 2, tmp_path_factory.mktemp("trace"), timeout=120)


# Per step, with the lm's 3 units (root + 2 blocks): (kind, phase) -> count.
EXPECTED_COUNTS = {
    # The root keeps its params from forward into backward, so only the blocks gather again.
    "FULL_SHARD": {("all_gather", "forward"): 3, ("all_gather", "backward"): 2, ("reduce_scatter", "backward"): 3},
    "SHARD_GRAD_OP": {("all_gather", "forward"): 3, ("reduce_scatter", "backward"): 3},
    "NO_SHARD": {("all_reduce", "backward"): 3},
}  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trace_counts_collectives_per_step_and_every_one_ends_after_it_starts(traces, strategy):
    for rank, result in enumerate(traces):
        assert result[strategy]["detached"], "units still hold the trace after the block"
        trace = CollectiveTrace.from_json(result[strategy]["trace"])
        for step in (0, 1):
            counts: dict = {}
            for r in trace.records:
                if r.step == step:
                    counts[(r.kind, r.phase)] = counts.get((r.kind, r.phase), 0) + 1
                assert r.end is not None and 0 <= r.start <= r.end, f"rank {rank}: {r}"
            assert counts == EXPECTED_COUNTS[strategy], f"rank {rank} step {step}: {counts}"
        spans = [(s.unit, s.phase, s.step) for s in trace.spans]
        for unit in ("", "blocks.0", "blocks.1"):
            for phase in ("forward", "backward"):
                for step in (0, 1):
                    assert spans.count((unit, phase, step)) == 1, f"rank {rank} {unit} {phase}"
        assert spans.count(("optimizer", "step", 1)) == 1, spans
        assert all(s.end is not None and s.start <= s.end for s in trace.spans), trace.spans
        times = [m.time for m in trace.memory]
        assert times == sorted(times) and trace.memory[-1].event == "trace end"


def _unsharded(sample, unit: str) -> int:
    return sample.units.get(unit, {}).get("unsharded_params", 0)


def test_full_shard_memory_holds_one_block_unsharded_in_forward_and_frees_it(traces):
    result = traces[0]["FULL_SHARD"]
    trace = CollectiveTrace.from_json(result["trace"])
    full = result["unsharded_nbytes"]
    forward = []
    for m in trace.memory:
        if m.step == 1 and m.event.startswith(("all_gather start blocks", "forward")):
            forward.append(m)
        if m.event == "forward end <root>" and m.step == 1:
            break
    # No forward prefetch: a block's unsharded params exist from its all-gather to its post-forward.
    for block in ("blocks.0", "blocks.1"):
        assert max(_unsharded(m, block) for m in forward) == full[block], block
    for m in forward:
        gathered = [b for b in ("blocks.0", "blocks.1") if _unsharded(m, b)]
        assert len(gathered) <= 1, f"two blocks unsharded at '{m.event}': {m.units}"
    end = trace.memory[-1]
    for cat in ("unsharded_params", "unsharded_grads", "comm_buffers"):
        assert end.total(cat) == 0, f"{cat} left after the step: {end.units}"
    assert end.total("params") == result["sharded_nbytes"]
    assert end.total("grads") > 0
    # AdamW: exp_avg and exp_avg_sq shaped like each local shard, and a scalar step per param.
    local = result["local_nbytes"]
    assert end.total("optim") == 2 * local + 4 * result["num_params"], end.units


def test_shard_grad_op_keeps_every_unit_unsharded_from_forward_to_backward(traces):
    result = traces[0]["SHARD_GRAD_OP"]
    trace = CollectiveTrace.from_json(result["trace"])
    after_forward = next(m for m in trace.memory if m.event == "forward end <root>")
    for unit, nbytes in result["unsharded_nbytes"].items():
        assert _unsharded(after_forward, unit) == nbytes, unit
    assert trace.memory[-1].total("unsharded_params") == 0


def test_no_shard_holds_whole_params_and_grads_and_never_unshards(traces):
    result = traces[0]["NO_SHARD"]
    trace = CollectiveTrace.from_json(result["trace"])
    assert all(m.total("unsharded_params") == 0 for m in trace.memory)
    end = trace.memory[-1]
    whole = sum(result["unsharded_nbytes"].values())
    assert end.total("params") == end.total("grads") == whole, end.units


def test_trace_json_round_trips(traces):
    data = json.loads(json.dumps(traces[1]["FULL_SHARD"]["trace"]))
    assert CollectiveTrace.from_json(data).to_json() == data


@pytest.mark.slow
def test_trace_demo_writes_pngs_explain_summary_and_json(tmp_path):
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "scripts/trace_demo.py", "--out", str(tmp_path), "--steps", "1"]
    proc = subprocess.run(
        cmd + (["--png"] if has_matplotlib else []),
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "step 1/1" in proc.stdout, proc.stdout
    explained = (tmp_path / "explain.txt").read_text()
    assert "unit <root>: FULL_SHARD, rank 1 of 2" in explained, explained
    summary = (tmp_path / "summary.txt").read_text()
    assert "rank 0: all_gather forward x3" in summary and "reduce_scatter backward x3" in summary
    for rank in (0, 1):
        trace = CollectiveTrace.from_json(
            json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        )
        assert trace.count("reduce_scatter") == 3 and trace.rank == rank
    if not has_matplotlib:
        pytest.skip("matplotlib is not installed: the text and JSON were checked, the PNGs not")
    for name in ("timeline.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def _explain_rank(rank: int, world_size: int) -> str:
    model = FSDP(
        build_model("lm"),
        auto_wrap_policy=POLICIES["lm"],
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    return explain(model)


class TestExplain(expecttest.TestCase):
    def test_explain_lists_units_params_rows_and_padding(self):
        with tempfile.TemporaryDirectory() as tmp:
            texts = run_ranks(_explain_rank, 3, tmp, timeout=60)
        self.assertExpectedInline(
            texts[2],
            """\
unit <root>: FULL_SHARD, rank 2 of 3, 4 params, unit_shard_numel 664, padding 96, shard float32 / compute bfloat16 / reduce float32
  pos                                 16x24  rows    4/6    shard_numel     144  padding 48
  tok.weight                          61x24  rows   19/21   shard_numel     504  padding 48
  ln_f.weight                            24  rows    8/8    shard_numel       8  padding 0
  ln_f.bias                              24  rows    8/8    shard_numel       8  padding 0
unit blocks.0: FULL_SHARD, rank 2 of 3, 12 params, unit_shard_numel 1510, padding 50, shard float32 / compute bfloat16 / reduce float32
  ln1.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln1.bias                               24  rows    8/8    shard_numel       8  padding 0
  qkv.weight                          72x24  rows   24/24   shard_numel     576  padding 0
  qkv.bias                               72  rows   24/24   shard_numel      24  padding 0
  proj.weight                         24x24  rows    8/8    shard_numel     192  padding 0
  proj.bias                              24  rows    8/8    shard_numel       8  padding 0
  ln2.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln2.bias                               24  rows    8/8    shard_numel       8  padding 0
  fc.weight                           40x24  rows   12/14   shard_numel     336  padding 48
  fc.bias                                40  rows   12/14   shard_numel      14  padding 2
  out.weight                          24x40  rows    8/8    shard_numel     320  padding 0
  out.bias                               24  rows    8/8    shard_numel       8  padding 0
unit blocks.1: FULL_SHARD, rank 2 of 3, 12 params, unit_shard_numel 1510, padding 50, shard float32 / compute bfloat16 / reduce float32
  ln1.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln1.bias                               24  rows    8/8    shard_numel       8  padding 0
  qkv.weight                          72x24  rows   24/24   shard_numel     576  padding 0
  qkv.bias                               72  rows   24/24   shard_numel      24  padding 0
  proj.weight                         24x24  rows    8/8    shard_numel     192  padding 0
  proj.bias                              24  rows    8/8    shard_numel       8  padding 0
  ln2.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln2.bias                               24  rows    8/8    shard_numel       8  padding 0
  fc.weight                           40x24  rows   12/14   shard_numel     336  padding 48
  fc.bias                                40  rows   12/14   shard_numel      14  padding 2
  out.weight                          24x40  rows    8/8    shard_numel     320  padding 0
  out.bias                               24  rows    8/8    shard_numel       8  padding 0""",
        )
