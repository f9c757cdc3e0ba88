"""write_chrome_trace: two ranks' steps of the trace demo's model as one Trace Event Format file,
checked against the format's rules, against what record_collectives recorded, and against
torch.profiler's events of the same steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from fsdp_lite.tools.trace import ComputeSpan, _lanes
from fsdp_lite.tools.trace_view import write_trace_html
from fsdp_lite.trace import CollectiveTrace, chrome_trace, write_chrome_trace
from scripts import headless_chromium as browser
from tests.ranks import run_ranks
from tests.test_trace_view import READ, needs_chromium

REPO_ROOT = Path(__file__).resolve().parents[1]

# The Trace Event Format (Google's document "Trace Event Format", the one chrome://tracing and
# Perfetto's JSON importer read): the phases, and what each needs beyond name, ph, pid, tid, ts.
PHASES = set("BEXiICbnestfPONDMVvRc") | {"(", ")"}
METADATA = {
    "process_name": "name",
    "process_labels": "labels",
    "process_sort_index": "sort_index",
    "thread_name": "name",
    "thread_sort_index": "sort_index",
}


OURS = {"compute", "user", "collective", "wait"}  # the categories of fsdp_lite's events


def check_trace_event_format(doc: dict) -> None:
    """Raise AssertionError naming every event that breaks the format's rules (those above), and
    every pair of fsdp_lite's "X" events on one thread that overlap without nesting (a viewer
    stacks them). torch.profiler's own need not nest: its gloo:recv outlasts the c10d::recv_
    around it."""
    problems = []
    assert isinstance(doc.get("traceEvents"), list), "no traceEvents list"
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns"), doc.get("displayTimeUnit")
    open_b: dict = defaultdict(int)
    spans: dict = defaultdict(list)
    for e in doc["traceEvents"]:
        missing = [k for k in ("name", "ph", "pid", "tid", "ts") if k not in e]
        if missing:
            problems.append(f"missing {missing}: {e}")
            continue
        ph = e["ph"]
        if ph not in PHASES or not isinstance(e["name"], str):
            problems.append(f"unknown phase or name: {e}")
        if not all(isinstance(e[k], (int, float)) for k in ("pid", "tid", "ts")):
            problems.append(f"pid, tid and ts must be numbers: {e}")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"args must be an object: {e}")
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"X needs dur >= 0: {e}")
            elif e.get("cat") in OURS:
                spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph in "BE":
            open_b[(e["pid"], e["tid"])] += 1 if ph == "B" else -1
        elif ph in "iI" and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"instant scope must be g, p or t: {e}")
        elif ph == "C":
            args = e.get("args", {})
            if not args or not all(isinstance(v, (int, float)) for v in args.values()):
                problems.append(f"C needs numeric args: {e}")
        elif ph == "M":
            key = METADATA.get(e["name"])
            if key is None or key not in e.get("args", {}):
                problems.append(f"M must be one of {sorted(METADATA)} with args.{key}: {e}")
        elif ph in "bnestf" and "id" not in e and "id2" not in e:
            problems.append(f"{ph} needs an id: {e}")
    problems += [f"{k}: B without E" for k, n in open_b.items() if n]
    for thread, xs in spans.items():
        stack: list = []  # ends of the spans that contain the current one
        for start, end, name in sorted(xs, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack and end > stack[-1][0] + 1e-3:  # 1 ns: ts and dur are rounded to ns apart
                problems.append(f"{thread}: {name} overlaps {stack[-1][1]} without nesting")
            stack.append((end, name))
    assert not problems, "\n".join(problems[:20])


def _events(doc: dict, pid: int, cat: str, ph: str = "X") -> list[dict]:
    return [e for e in doc["traceEvents"] if e["pid"] == pid and e.get("cat") == cat and e["ph"] == ph]  # fmt: skip


# ---- two ranks, two steps -----------------------------------------------------------------------


def _two_steps(rank: int, world_size: int, out: str) -> dict:
    """Two traced FULL_SHARD steps of the trace demo's model under torch.profiler, written to
    out/plain.json and, with this rank's profile merged, out/merged.json."""
    from scripts.trace_demo import Job, train_traced

    profile = Path(out) / f"torch_rank{rank}.json"
    _, trace = train_traced(Job("", "FULL_SHARD"), steps=2, profile=profile)
    write_chrome_trace(trace, Path(out) / "plain.json")
    write_chrome_trace(trace, Path(out) / "merged.json", profile=profile)
    return {"trace": trace.to_json(), "t0": trace.t0}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chrome")
    ranks = run_ranks(_two_steps, 2, out, args=(str(out),), timeout=180)
    docs = {name: json.loads((out / f"{name}.json").read_text()) for name in ("plain", "merged")}
    return ranks, docs


def test_file_follows_the_trace_event_format_with_one_process_per_rank(run):
    _, docs = run
    for name, doc in docs.items():
        check_trace_event_format(doc)
        names = {
            e["pid"]: e["args"]["name"]
            for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"
        }
        assert names == {0: "rank 0", 1: "rank 1"}, (name, names)
        assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}, name
        assert doc["displayTimeUnit"] == "ms"


def test_each_rank_has_the_collectives_spans_waits_and_memory_it_recorded(run):
    ranks, docs = run
    doc = docs["plain"]
    tags = []
    for rank, result in enumerate(ranks):
        trace = CollectiveTrace.from_json(result["trace"])
        collectives = _events(doc, rank, "collective")
        assert len(collectives) == len(trace.records) == 16, (rank, len(collectives))
        assert Counter(e["args"]["kind"] for e in collectives) == Counter(
            r.kind for r in trace.records
        )
        assert all(e["args"]["group"] == [0, 1] for e in collectives)
        assert sum(e["args"]["bytes"] for e in collectives) == sum(r.nbytes for r in trace.records)
        tags.append({e["args"]["tag"]: (e["args"]["kind"], e["args"]["unit"]) for e in collectives})
        # Every unit's collective waits through Collective.waiter on CPU: each one's wait shows.
        assert len(_events(doc, rank, "wait")) == len(trace.records)
        spans = _events(doc, rank, "compute") + _events(doc, rank, "user")
        assert (
            len(spans) == len(trace.spans) == 3 * 2 * 2 + 2
        )  # 3 units x fwd/bwd x 2 steps + optim
        memory = [e for e in doc["traceEvents"] if e["pid"] == rank and e["ph"] == "C"]
        assert len(memory) == len(trace.memory)
        assert memory[-1]["args"]["params"] == trace.memory[-1].total("params") > 0
        threads = {
            e["args"]["name"]
            for e in doc["traceEvents"]
            if e["pid"] == rank and e["ph"] == "M" and e["name"] == "thread_name"
        }
        assert {"compute", "collectives", "waits"} <= threads, threads
    assert tags[0] == tags[1], "a tag names a different collective on each rank"


def test_ranks_clocks_are_aligned(run):
    ranks, docs = run
    doc = docs["plain"]
    # One host: perf_counter is one clock for both ranks, so the true offset is known: rank 1's
    # trace clock reads ahead of rank 0's by the time rank 0's trace began before rank 1's.
    true_us = (ranks[0]["t0"] - ranks[1]["t0"]) * 1e6
    estimated_us = doc["otherData"]["clock_offsets_us"][1]
    bound_us = doc["otherData"]["clock_error_bound_us"][1]
    assert abs(estimated_us - true_us) <= bound_us + 0.01, (estimated_us, true_us, bound_us)
    # No rank's wait on a collective returns before every rank has issued it.
    by_tag = defaultdict(list)
    for rank in (0, 1):
        for e in _events(doc, rank, "collective"):
            by_tag[e["args"]["tag"]].append(e)
    for tag, (a, b) in by_tag.items():
        issued = max(a["ts"], b["ts"])
        assert min(a["ts"] + a["dur"], b["ts"] + b["dur"]) >= issued - 1000, (tag, a, b)


def test_merged_file_puts_each_wait_inside_torch_profilers_label_of_it(run):
    _, docs = run
    doc = docs["merged"]
    aten = [e for e in doc["traceEvents"] if str(e["name"]).startswith("aten::")]
    assert {e["pid"] for e in aten} == {0, 1}, "torch's ops are not in the ranks' processes"
    for rank in (0, 1):
        labels = defaultdict(list)  # the engine's own profiler labels (engine/unit.py _label)
        for e in doc["traceEvents"]:
            if e["pid"] == rank and e["ph"] == "X" and str(e["name"]).startswith("fsdp_lite::"):
                labels[e["name"]].append(e)
        waits = sorted(_events(doc, rank, "wait"), key=lambda e: e["ts"])
        assert waits
        for w in waits:
            stage = "wait_for_unshard" if w["args"]["kind"] == "all_gather" else "finish_reduce"
            name = f"fsdp_lite::{stage} {w['args']['unit'] or '<root>'}"
            # Within 0.5 ms: the profile comes through the wall clock (Note [Chrome trace clocks]).
            inside = [
                lab
                for lab in labels[name]
                if lab["ts"] - 500 <= w["ts"] and w["ts"] + w["dur"] <= lab["ts"] + lab["dur"] + 500
            ]
            assert len(inside) == 1, (rank, w, labels[name])


def _human(nbytes: float) -> str:
    """As the viewer writes bytes (trace_view._JS's human)."""
    units, i = ["B", "KiB", "MiB", "GiB"], 0
    while nbytes >= 1024 and i < 3:
        nbytes, i = nbytes / 1024, i + 1
    return f"{nbytes:.1f} {units[i]}" if i else f"{nbytes} {units[i]}"


@needs_chromium
@pytest.mark.parametrize("name", ["plain", "merged"])
def test_the_offline_viewer_in_chromium_shows_what_each_rank_recorded(run, name, tmp_path):
    """The file opened offline in headless Chromium through fsdp_lite.tools.trace_view (Chromium's
    chrome://tracing does not open headless): per rank, the summary's counts and the spans drawn
    are those record_collectives recorded; merged, torch's ops are drawn in the ranks too."""
    ranks, docs = run
    page = write_trace_html(docs[name], tmp_path / f"{name}.html")
    seen = browser.probe(page, READ, size=(1600, 1000))
    assert seen["processes"][:2] == ["rank 0", "rank 1"], seen["processes"]
    for rank, result in enumerate(ranks):
        trace = CollectiveTrace.from_json(result["trace"])
        kinds = Counter(r.kind for r in trace.records)
        units = [s for s in trace.spans if s.phase in ("forward", "backward")]
        row = seen["rows"][str(rank)]
        assert row[0] == f"rank {rank}"
        assert row[2:8] == [
            str(len(units)),  # 3 units x forward and backward x 2 steps
            str(len(trace.records)),
            ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())),
            _human(sum(r.nbytes for r in trace.records)),
            str(len(trace.records)),  # a wait per collective
            str(len(trace.spans) - len(units)),  # the optimizer, once a step
        ], row
        assert row[9] == str(len(trace.memory))
        drawn = [s for s in seen["spans"] if s["pid"] == str(rank)]
        collectives = [s["title"].split(" (")[0] for s in drawn if s["cat"] == "collective"]
        assert Counter(collectives) == Counter(
            f"{r.kind} {r.unit or '<root>'}" for r in trace.records
        )
        compute = [s["title"].split(" (")[0] for s in drawn if s["cat"] == "compute"]
        assert Counter(compute) == Counter(f"{s.unit or '<root>'} {s.phase}" for s in units)
        assert {"blocks.0 forward", "blocks.1 backward", "<root> forward"} <= set(compute)
        assert len([c for c in seen["counters"] if c[0] == str(rank)]) == 6  # memory categories
        torch_ops = [s["title"] for s in drawn if s["cat"] not in OURS]
        if name == "merged":
            assert any(t.startswith("aten::") for t in torch_ops)
            assert any(t.startswith("fsdp_lite::wait_for_unshard") for t in torch_ops)
        else:
            assert torch_ops == [] and row[8] == "0"
    lanes = seen["lanes"]
    assert lanes.count("compute") == lanes.count("collectives") == lanes.count("waits") == 2
    assert all(s["w"] > 0 for s in seen["spans"])


# ---- one process ---------------------------------------------------------------------------------


def test_lanes_keep_nested_spans_together_and_move_overlapping_ones():
    # a contains b; c overlaps a without nesting; d follows a
    assert _lanes([(0, 10), (2, 5), (8, 12), (10, 11)]) == [0, 0, 1, 0]


def test_offsets_put_ranks_on_one_clock_and_open_spans_become_instants():
    first = CollectiveTrace(spans=[ComputeSpan("", "forward", 0, 0.5, 0.75)], rank=0, world_size=2)
    second = CollectiveTrace(
        spans=[ComputeSpan("", "forward", 0, 1.5, 1.75), ComputeSpan("", "backward", 0, 2.0)],
        rank=1,
        world_size=2,
    )
    doc = chrome_trace([first, second], offsets=[0.0, 1.0])
    check_trace_event_format(doc)
    forward = [e for e in doc["traceEvents"] if e.get("name") == "<root> forward"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in forward] == [(0, 0.0, 250e3), (1, 0.0, 250e3)]
    (never,) = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert never["pid"] == 1 and never["ts"] == 500e3 and "never ended" in never["name"]


def test_a_trace_without_units_exports_its_user_spans():
    trace = CollectiveTrace()  # world size 1, no process group: nothing but what the user marks
    with trace.span("optimizer"):
        torch.ones(1)
    doc = chrome_trace([trace])
    check_trace_event_format(doc)
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["optimizer"]


# ---- the demo's command line --------------------------------------------------------------------


@pytest.mark.slow
def test_trace_demo_chrome_writes_one_file_for_both_ranks(tmp_path):
    # -m from the repo root, as its ranks run it; with RANK set it would run as one rank.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = tmp_path / "trace.json"
    argv = ["--out", str(tmp_path), "--steps", "2", "--chrome", str(path), "--torch-profile"]
    cmd = [sys.executable, "-m", "scripts.trace_demo", *argv]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(path.read_text())
    check_trace_event_format(doc)
    for rank in (0, 1):
        recorded = CollectiveTrace.from_json(
            json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        )
        assert len(_events(doc, rank, "collective")) == len(recorded.records) == 16
        assert any(
            str(e["name"]).startswith("aten::") for e in doc["traceEvents"] if e["pid"] == rank
        )
    # and its offline page beside it, with the same document in it
    page = path.with_suffix(".html").read_text()
    assert "<title>FULL_SHARD, 2 ranks: 2 steps" in page and "CPU ops</title>" in page
    data = page[page.index('id="trace-data">') + 16 : page.index("</script>")]
    assert json.loads(data) == doc
