"""fsdp_lite.tools.trace_view: the offline page that draws a Trace Event Format file, read in
headless Chromium as a person reads it (the summary's counts, the lanes and spans drawn, zoom and
click). Synthetic traces, no ranks; tests/test_chrome_trace.py opens the demo model's real trace.
The browser tests skip where no ``chromium`` is on PATH."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import pytest
import torch

from fsdp_lite.tools.trace import CollectiveRecord, ComputeSpan, MemorySample, chrome_trace
from fsdp_lite.tools.trace_view import trace_html, write_trace_html
from fsdp_lite.trace import CollectiveTrace
from scripts import headless_chromium as browser

needs_chromium = pytest.mark.skipif(
    browser.chromium() is None,
    reason="no chromium on PATH (Debian's chromium package): the page cannot be drawn",
)

# The page's layout constants (trace_view._JS): the label column's width, the right margin.
LABEL, MARGIN = 215, 8


def _rank(rank: int) -> CollectiveTrace:
    """One rank's step: the root's forward holding a block's, an all-gather per unit, one
    reduce-scatter waited on, one never waited on, memory at three events."""
    f32 = torch.float32
    ag = [
        CollectiveRecord("all_gather", "", "forward", f32, 100, 0, 0.001, 0.002, [0, 1], 0.0015),
        CollectiveRecord("all_gather", "blocks.0", "forward", f32, 50, 0, 0.002, 0.003, [0, 1]),
    ]
    rs = [
        CollectiveRecord(
            "reduce_scatter", "blocks.0", "backward", f32, 80, 0, 0.006, 0.008, [0, 1], 0.007
        ),  # fmt: skip
        CollectiveRecord("reduce_scatter", "", "backward", f32, 200, 0, 0.009, None, [0, 1]),
    ]
    spans = [
        ComputeSpan("", "forward", 0, 0.002, 0.005),
        ComputeSpan("blocks.0", "forward", 0, 0.003, 0.004),
        ComputeSpan("", "backward", 0, 0.005, 0.009),
        ComputeSpan("optimizer", "step", 0, 0.0095, 0.010),
    ]
    memory = [
        MemorySample(0.001, 0, "a", {"": {"params": 400}}),
        MemorySample(0.003, 0, "b", {"": {"params": 400, "unsharded_params": 800}}),
        MemorySample(0.010, 0, "c", {"": {"params": 400, "grads": 400, "optim": 800}}),
    ]
    return CollectiveTrace(ag + rs, spans, memory, rank=rank, world_size=2)


@pytest.fixture(scope="module")
def doc() -> dict:
    return chrome_trace([_rank(0), _rank(1)], offsets=[0.0, 0.0005])


# What the probe reads off the drawn page: the summary table's cells by process, the lanes'
# labels, every drawn span (its process, category, title and box), the counters' areas.
READ = r"""
var rows={};[].forEach.call(document.querySelectorAll('#summary tr[data-pid]'),function(tr){
 rows[tr.getAttribute('data-pid')]=[].map.call(tr.cells,function(c){return c.innerText})});
var svg=document.querySelector('#timeline svg');
var spans=[].map.call(svg.querySelectorAll('rect.span'),function(r){return {pid:r.getAttribute('data-pid'),
 cat:r.getAttribute('data-cat'),title:r.querySelector('title').textContent,x:+r.getAttribute('x'),
 w:+r.getAttribute('width'),h:r.getBoundingClientRect().height}});
return {rows:rows,width:+svg.getAttribute('width'),spans:spans,
 processes:[].map.call(svg.querySelectorAll('text.p'),function(t){return t.textContent}),
 lanes:[].map.call(svg.querySelectorAll('text.lane'),function(t){return t.textContent}),
 counters:[].map.call(svg.querySelectorAll('path.counter'),function(p){return [p.getAttribute('data-pid'),p.querySelector('title').textContent]}),
 window:document.getElementById('window').innerText,text:document.body.innerText}
"""


def test_the_page_is_self_contained_and_embeds_any_name_safely(doc):
    hostile = {**doc, "traceEvents": doc["traceEvents"] + [
        {"name": "</script><script>alert(1)</script>", "ph": "X", "pid": 0, "tid": 9, "ts": 1, "dur": 1}
    ]}  # fmt: skip
    text = trace_html(hostile, "t")
    assert text.count("<script") == 2 and "</script><script>alert" not in text
    assert "http://" not in text and "https://" not in text
    assert not re.search(r"\b(src|href)=", text)
    data = text[text.index('id="trace-data">') + 16 : text.index("</script>")]
    assert json.loads(data) == hostile


def test_command_line_writes_the_page_beside_the_trace(tmp_path, doc):
    (tmp_path / "t.json").write_text(json.dumps(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_lite.tools.trace_view", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "<title>t.json</title>" in (tmp_path / "t.html").read_text()


@needs_chromium
def test_chromium_draws_each_rank_with_its_counts_lanes_and_spans(tmp_path, doc):
    page = write_trace_html(doc, tmp_path / "trace.html")
    seen = browser.probe(page, READ)
    header = ["process", "threads", "compute", "collectives", "by kind", "bytes", "waits", "user",
              "other spans", "counter samples"]  # fmt: skip
    for pid in ("0", "1"):
        # 3 lanes (the block's forward nests in the root's), 3 unit spans, 3 collectives waited
        # on (the fourth is an instant) and their 920 bytes, 2 waits, the optimizer, 3 samples
        assert seen["rows"][pid] == [f"rank {pid}", "3", "3", "3", "all_gather 2, reduce_scatter 1",
                                     "920 B", "2", "1", "0", "3"], header  # fmt: skip
    assert seen["processes"] == ["rank 0", "rank 1"]
    # the memory counter's peak: params 400 + grads 400 + optim 800 bytes at the last sample
    assert seen["lanes"] == ["compute", "collectives", "waits", "memory max 1,600"] * 2
    for pid in ("0", "1"):
        mine = [s for s in seen["spans"] if s["pid"] == pid]
        titles = sorted(s["title"].split(" (")[0] for s in mine)
        assert titles == sorted([
            "<root> forward", "blocks.0 forward", "<root> backward", "optimizer",
            "all_gather <root>", "all_gather blocks.0", "reduce_scatter blocks.0",
            "wait all_gather <root>", "wait reduce_scatter blocks.0",
        ])  # fmt: skip
        # the memory counter: an area per category, all six (zeros included)
        assert len([c for c in seen["counters"] if c[0] == pid]) == 6
    # every span drawn inside the plot, with a height a person sees
    assert all(LABEL <= s["x"] and s["x"] + s["w"] <= seen["width"] - MARGIN + 0.01 for s in seen["spans"])  # fmt: skip
    assert all(s["w"] > 0 and s["h"] >= 10 for s in seen["spans"])
    # the never-waited reduce-scatter shows as an instant with its reason
    assert "reduce_scatter <root> (never waited)" in json.dumps(doc)
    # the whole trace at first: from rank 1's first sample (0.5 ms earlier on rank 0's clock)
    # to rank 0's last
    assert seen["window"].startswith("0.000 – 9.500 ms of 9.500 ms")


@needs_chromium
def test_a_window_in_the_address_zooms_and_a_click_shows_the_args(tmp_path, doc):
    page = write_trace_html(doc, tmp_path / "trace.html")
    click = r"""
    var r=document.querySelector('rect.span[data-cat="collective"]'),b=r.getBoundingClientRect();
    var at={clientX:b.left+b.width/2,clientY:b.top+b.height/2,bubbles:true};
    r.dispatchEvent(new MouseEvent('mousedown',at));r.dispatchEvent(new MouseEvent('mouseup',at));
    return {details:document.getElementById('details').innerText,
     spans:document.querySelectorAll('rect.span').length,window:document.getElementById('window').innerText}
    """
    whole = browser.probe(page, click)
    zoomed = browser.probe(page, click, fragment="#t=5,7")
    assert whole["spans"] == 18 and zoomed["spans"] < whole["spans"]
    assert zoomed["window"].startswith("5.000 – 7.000 ms")
    args = json.loads(whole["details"].split("\n", 1)[1])
    assert args["kind"] == "all_gather" and args["group"] == [0, 1] and "tag" in args


@needs_chromium
def test_begin_end_pairs_instants_and_other_phases(tmp_path):
    events = [
        {"name": "process_name", "ph": "M", "pid": 7, "tid": 0, "args": {"name": "host"}},
        {"name": "outer", "ph": "B", "pid": 7, "tid": 1, "ts": 0},
        {"name": "inner", "ph": "X", "pid": 7, "tid": 1, "ts": 10, "dur": 20},
        {"name": "outer", "ph": "E", "pid": 7, "tid": 1, "ts": 100},
        {"name": "mark", "ph": "i", "s": "t", "pid": 7, "tid": 1, "ts": 50},
        {"name": "flow", "ph": "s", "id": 1, "pid": 7, "tid": 1, "ts": 5},
    ]
    page = write_trace_html(events, tmp_path / "bare.html")  # a bare event list is a trace too
    seen = browser.probe(page, READ)
    assert seen["processes"] == ["host"]
    assert sorted(s["title"] for s in seen["spans"]) == ["inner (0.020 ms)", "outer (0.100 ms)"]
    assert "1 events of other phases" in seen["text"]


@needs_chromium
def test_a_screenshot_is_a_png_of_the_window(tmp_path, doc):
    page = write_trace_html(doc, tmp_path / "trace.html")
    png = browser.screenshot(page, tmp_path / "trace.png", size=(900, 500)).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (900, 500)
