"""The HTML report (issue 41 item 2): ``python -m conformance --html`` and ``python -m
conformance.html``, read back as a person would read it.

Most tests render a synthetic ``--json`` report of 1,000 cases over three implementations, built
from real ``CaseResult``s by ``report.to_json`` (no ranks are started), with one planted failing
case (``params`` from step 2) late in the run, one crashed case early and some unsupported ones,
and parse the page with the standard library's ``html.parser``: the planted failure comes first
with its first failing stage and step, the counts are right, no ``src`` or ``href`` leaves the
file, the page stays under a size bound, and ``--compare-to`` shows the planted case as a
regression. One test runs the suite itself on three cases with a gradient bug planted in one
(scripts/conformance_html_demo.py); two render the stored report of the default-matrix run that
docs/conformance.md shows (988 cases, one planted failure). The browser tests open the pages in
headless Chromium, offline (scripts/headless_chromium.py), and read them as laid out: the text
that is rendered, the failure list's first row on the first screen in red, the open details'
charts, the heat map's cell colours, the filter box and the "failing rows only" switch at work.
They skip where no ``chromium`` is on PATH.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import os
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conformance import html as html_report
from conformance import report
from conformance.compare import StageTally
from conformance.matrix import Case
from conformance.results import CaseResult
from conformance.tolerances import STAGES, tolerance
from scripts import headless_chromium as browser

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("fsdp_lite", "torch_fsdp2", "torch_fsdp1")
FEATURES = ("plain", "no_sync", "clip_grad_norm", "accumulate", "frozen_in_unit", "cpu_offload")
MODELS = ("lm_untied", "mlp", "nested", "bufnet", "unused", "convnet", "frozen", "spiky")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
PRECISIONS = ("fp32", "bf16", "fp16")
PLANTED = "fsdp_lite/SHARD_GRAD_OP/bf16/clip_grad_norm/nested/ws2"
CRASHED = "fsdp_lite/FULL_SHARD/fp32/plain/lm_untied/ws2"
SIZE_BOUND = 1_000_000  # bytes, for 1,000 cases (measured: see test_size_bound)


def _cases(n: int) -> list[Case]:
    cases = []
    for impl in IMPLS:
        for model in MODELS:
            for feature in FEATURES:
                for strategy in STRATEGIES:
                    for precision in PRECISIONS:
                        cases.append(Case(impl, strategy, precision, feature, model, 2))
    assert len(cases) >= n
    return cases[:n]


def _result(case: Case, planted: bool) -> CaseResult:
    """A passing case (bitwise vs DDP in fp32, a small distance otherwise), or the planted one:
    params off both references from step 2 on, so optimizer state and state dict too."""
    r = CaseResult(case, "passed", seconds=0.5)
    r.stages = {
        s: {ref: StageTally(tolerance(case, ref, s)) for ref in ("ddp", "single")} for s in STAGES
    }
    for stage in STAGES:
        for ref, tally in r.stages[stage].items():
            tally.compared = True
            small = 0.0 if (ref == "ddp" and case.precision == "fp32") else 1e-7
            tally.max_abs, tally.max_rel = small, small * 2
            tally.bitwise = small == 0.0
            if planted and STAGES.index(stage) >= STAGES.index("params"):
                tally.max_abs, tally.max_rel, tally.bitwise, tally.passed = 5e-3, 0.7, False, False
                tally.first_failed_step = 2 if stage != "state_dict" else 4
                tally.worst = "step 2: fc1.weight"
                tally.problems = ["step 2: fc1.weight: max abs error 0.005 > atol 0 + rtol 0"]
    if planted:
        r.status, r.reason = "failed", "params differs from the references (first at step 2)"
    loss = [4.36, 4.16, 4.28, 4.25]
    norm = [0.52, 0.50, 0.55, 0.52]
    bent = [4.36, 4.16, 4.29, 4.26] if planted else loss
    r.curves = {
        "loss": {"impl": bent, "ddp": loss, "single": [4.29, 4.19, 4.28, 4.27]},
        "grad_norm": {"impl": norm, "ddp": norm, "single": norm},
    }
    return r


def synthetic(n: int = 1000, planted: bool = True) -> dict:
    """A --json report of ``n`` cases: the planted failure (late), a crash (early), and every
    ``cpu_offload`` case of torch_fsdp1 unsupported."""
    results = []
    for case in _cases(n):
        if case.name == CRASHED:
            crash = {"kind": "signal", "rank": 1, "signal": "SIGSEGV", "summary": "rank 1 died"}
            crash["after"] = "step 2, comparing grads"
            results.append(CaseResult(case, "crashed", "rank 1 died: SIGSEGV", crash=crash))
        elif case.impl == "torch_fsdp1" and case.feature == "cpu_offload":
            results.append(CaseResult(case, "unsupported", "no accelerator for CPUOffload"))
        else:
            results.append(_result(case, planted and case.name == PLANTED))
    meta = {"impls": list(IMPLS), "world_size": 2, "backend": "gloo", "device": "cpu", "steps": 3}
    return json.loads(report.to_json(results, {**meta, "seconds": 123.4}))


class _Page(HTMLParser):
    """The parts of the page the tests read: text by element id, table rows by table id, every
    src and href, and the whole text."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self.links: list[str] = []
        self.text: list[str] = []
        self._open: list[tuple[str, str | None]] = []  # (tag, id)
        self._table: list[str | None] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if tag in ("br", "input", "meta"):
            return
        self._open.append((tag, attrs.get("id")))
        if tag == "table":
            self._table.append(attrs.get("id"))
        elif tag == "tr" and self._table and self._table[-1]:
            self.rows.setdefault(self._table[-1], []).append([])
        elif tag in ("td", "th") and self._table and self._table[-1]:
            self._cell = []

    def handle_endtag(self, tag):
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break
        if tag == "table" and self._table:
            self._table.pop()
        elif tag in ("td", "th") and self._cell is not None:
            self.rows[self._table[-1]][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        for _, ident in self._open:
            if ident:
                self.by_id[ident] = self.by_id.get(ident, "") + data
        if self._cell is not None:
            self._cell.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


@pytest.fixture(scope="module")
def thousand() -> tuple[dict, str, float]:
    doc = synthetic(1000)
    start = time.perf_counter()
    text = html_report.render(doc)
    return doc, text, time.perf_counter() - start


def test_the_planted_failure_comes_first_with_its_stage_and_step(thousand):
    _, text, _ = thousand
    page = _parse(text)
    failures = page.rows["failure-list"]
    header, first, second = failures[0], failures[1], failures[2]
    assert header[:4] == ["#", "case", "status", "first failing stage"]
    assert first[1:4] == [PLANTED, "failed", "params, step 2"], first
    assert second[1:3] == [CRASHED, "crashed"], second  # crashes after the failures
    assert len(failures) == 3
    # before the heat map in the page, and the heat map links to it
    assert text.index(PLANTED) < text.index('id="heatmap"')
    assert f'href="#f0">{PLANTED.split("/", 1)[1]}</a>' in text
    # its details: the failing comparisons and its curves (two charts per metric)
    details = text[text.index('id="f0"') : text.index('id="f1"')]
    assert details.count('<svg width="250"') == 4 and "fc1.weight" in details


def test_the_counts_are_right(thousand):
    doc, text, _ = thousand
    page = _parse(text)
    counts = {s: int(page.by_id[f"n-{s}"]) for s in ("total", *html_report.STATUSES)}
    assert counts == {"total": 1000, "passed": 980, "failed": 1, "unsupported": 18, "crashed": 1}
    assert counts["total"] == sum(doc["summary"].values())
    assert {s: counts[s] for s in html_report.STATUSES} == doc["summary"]
    per_impl = {row[0]: row[1:] for row in page.rows["per-impl"][1:]}
    assert per_impl["fsdp_lite"][:5] == ["432", "430", "1", "0", "1"]
    assert per_impl["torch_fsdp1"][:5] == ["136", "118", "0", "18", "0"]
    assert "1 failed, 1 crashed of 1000" in "".join(page.text)  # the title and the heading


def test_nothing_leaves_the_file(thousand):
    _, text, _ = thousand
    page = _parse(text)
    assert page.links, "the page links its own sections"
    assert all(link.startswith("#") for link in page.links), [
        x for x in page.links if not x.startswith("#")
    ][:5]
    assert "http://" not in text and "https://" not in text
    assert "<link" not in text and "@import" not in text and "<script src" not in text


def test_size_bound(thousand):
    doc, text, seconds = thousand
    size = len(text.encode())
    print(
        f"\n1,000 cases: HTML {size / 1024:.0f} KiB (JSON {len(json.dumps(doc)) / 1024:.0f} KiB), rendered in {seconds:.2f} s"
    )
    assert size < SIZE_BOUND
    assert seconds < 10
    page = _parse(text)
    rows = page.rows["heatmap"]
    assert len(rows) == 2 + 432  # two header rows, a row per case name less its implementation
    assert sum(len(r) - 1 for r in rows[2:]) == 432 * len(IMPLS) * len(STAGES) * 2


def test_the_diff_view_names_the_regression():
    old, new = synthetic(300, planted=False), synthetic(300)
    page = _parse(html_report.render(new, old, "old.json"))
    assert page.by_id["n-regressions"] == str(len([r for r in page.rows["regressions"][1:]]))
    assert {row[0] for row in page.rows["regressions"][1:]} == {PLANTED}
    assert page.rows["status-changes"][1] == [PLANTED, "passed", "failed"]
    assert "old.json" in page.by_id["comparison"]


def test_rendered_from_a_saved_report_or_events_file(tmp_path):
    doc = synthetic(50)
    (tmp_path / "r.json").write_text(json.dumps(doc))
    # the events file of the same run, as rank 0 and the launcher write it
    lines = [
        {
            "event": "run",
            "cases": [c["name"] for c in doc["cases"]],
            "notes": [],
            "meta": {"world_size": 2},
        }
    ]
    for i, c in enumerate(doc["cases"]):
        fields = {f.name: c[f.name] for f in dataclasses.fields(Case)}
        lines.append(
            {"event": "start", "index": i, "case": c["name"], "fields": fields, "time": 0.0}
        )
        if c["status"] == "crashed":
            lines.append(
                {
                    "event": "crashed",
                    "index": i,
                    "case": c["name"],
                    "crash": {**c["crash"], "case_seconds": 0.1},
                }
            )
        else:
            lines.append({"event": "case", "index": i, **c})
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for source in ("r.json", "r.jsonl"):
        proc = subprocess.run(
            [sys.executable, "-m", "conformance.html", source, "-o", f"{source}.html"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        page = _parse((tmp_path / f"{source}.html").read_text())
        assert page.rows["failure-list"][1][1:4] == [
            CRASHED,
            "crashed",
            "rank died after step 2, comparing grads",
        ]
        assert int(page.by_id["n-total"]) == 50


PLANTED_RUN_CASE = "fsdp_lite_planted/FULL_SHARD/fp32/plain/lm_untied/ws2"


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The suite itself, three cases of three implementations, the planted adapter's failing."""
    out = tmp_path_factory.mktemp("planted")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    args = ["--impl", "scripts.conformance_html_demo:PlantedFsdpLite", "torch_fsdp2", "torch_fsdp1"]
    args += [
        "--only",
        "*/FULL_SHARD/fp32/plain/lm_untied/*",
        "--json",
        "r.json",
        "--html",
        "r.html",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", *args],
        cwd=out, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out, proc


@pytest.mark.slow
def test_a_run_with_a_planted_bug(planted_run):
    out, proc = planted_run
    assert proc.returncode == report.EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = _parse((out / "r.html").read_text())
    assert page.rows["failure-list"][1][1:4] == [PLANTED_RUN_CASE, "failed", "params, step 2"]
    assert {s: page.by_id[f"n-{s}"] for s in ("total", "passed", "failed")} == {
        "total": "3", "passed": "2", "failed": "1",
    }  # fmt: skip
    doc = json.loads((out / "r.json").read_text())
    curves = {c["name"]: c["curves"] for c in doc["cases"]}
    # the planted bug bends the curves from step 3 on; the native FSDPs follow DDP exactly
    planted = curves[PLANTED_RUN_CASE]["loss"]
    assert planted["impl"][:2] == planted["ddp"][:2] and planted["impl"][2] != planted["ddp"][2]
    native = curves["torch_fsdp2/FULL_SHARD/fp32/plain/lm_untied/ws2"]["loss"]
    assert native["impl"] == native["ddp"]
    assert len(native["impl"]) == 4  # 3 steps and the step after the round trip


# ---- in a browser ---------------------------------------------------------------------------------

needs_chromium = pytest.mark.skipif(
    browser.chromium() is None,
    reason="no chromium on PATH (Debian's chromium package): the rendered page cannot be read",
)

# Read off the page as Chromium laid it out at 1400 x 1000 (scripts/headless_chromium.py probe):
# the text a person sees (innerText leaves out what is not rendered), the counts, the failure
# list's rows and whether the first is on the first screen in the failed colour, the open details
# and their curves' boxes, each heat map row's cell colours; then the filter box typed into and
# the "failing rows only" switch clicked, and the rows left showing.
READ_REPORT = r"""
var q=function(s){return document.querySelector(s)},visible=function(){
 return [].filter.call(document.querySelectorAll('#heatmap tr.r'),function(r){return r.getClientRects().length>0})
  .map(function(r){return r.cells[0].innerText})};
var counts={};['total','passed','failed','unsupported','crashed'].forEach(function(s){counts[s]=q('#n-'+s).innerText});
var list=[].slice.call(q('#failure-list').rows,1),first=list[0].getBoundingClientRect();
var open=[].filter.call(document.querySelectorAll('details.case'),function(d){return d.open}).map(function(d){
 return {id:d.id,charts:[].filter.call(d.querySelectorAll('svg'),function(g){return g.getBoundingClientRect().height>50}).length}});
var heat={};[].forEach.call(document.querySelectorAll('#heatmap tr.r'),function(r){
 heat[r.cells[0].innerText]=[].slice.call(r.cells,1).map(function(c){return getComputedStyle(c).backgroundColor})});
var perImpl={};[].slice.call(q('#per-impl').rows,1).forEach(function(r){perImpl[r.cells[0].innerText]=[].slice.call(r.cells,1).map(function(c){return c.innerText})});
var result={text:document.body.innerText,counts:counts,perImpl:perImpl,
 failures:list.map(function(r){return [].map.call(r.cells,function(c){return c.innerText})}),
 firstTop:first.top,firstBottom:first.bottom,screen:innerHeight,
 firstColour:getComputedStyle(list[0].cells[2]).color,open:open,heat:heat,allRows:visible().length};
var box=q('#hmq');box.value=ROW;box.dispatchEvent(new Event('input'));
result.typed=[visible(),q('#hmn').innerText];
box.value='';box.dispatchEvent(new Event('input'));q('#hmf').click();
result.failingOnly=[visible(),q('#hmn').innerText];
return result;
"""
RED = "rgb(207, 34, 46)"  # html._CSS: .failed's colour, .f's background


def _read_report(page: Path, row: str) -> dict:
    return browser.probe(page, f"var ROW={json.dumps(row)};" + READ_REPORT, size=(1400, 1000))


@needs_chromium
def test_headless_chromium_shows_the_failure_and_the_counts(tmp_path, thousand):
    doc, text, _ = thousand
    page = tmp_path / "report.html"
    page.write_text(text)
    row = PLANTED.split("/", 1)[1]
    seen = _read_report(page, row)
    assert "1 failed, 1 crashed of 1000" in seen["text"]
    assert seen["counts"] == {"total": "1000", "passed": "980", "failed": "1", "unsupported": "18", "crashed": "1"}  # fmt: skip
    assert {s: int(seen["counts"][s]) for s in html_report.STATUSES} == doc["summary"]
    assert seen["perImpl"]["fsdp_lite"][:5] == ["432", "430", "1", "0", "1"]
    # the planted failure first, on the first screen, in red; the crash after it
    assert [f[1:4] for f in seen["failures"]] == [
        [PLANTED, "failed", "params, step 2"],
        [CRASHED, "crashed", "rank died after step 2, comparing grads"],
    ]
    assert 0 < seen["firstTop"] and seen["firstBottom"] < seen["screen"]
    assert seen["firstColour"] == RED
    # its details open with their four charts drawn; the crash's open too
    assert seen["open"] == [{"id": "f0", "charts": 4}, {"id": "f1", "charts": 0}]
    # its heat map row: fsdp_lite's params, optimizer state and state dict red against both
    # references, loss and grads not; the other implementations' cells not red
    cells = seen["heat"][row]
    assert [c == RED for c in cells[:10]] == [False] * 4 + [True] * 6
    assert RED not in cells[10:]
    assert sum(RED in c for c in seen["heat"].values()) == 1
    # the filter finds it by name; "failing rows only" leaves its row and the crashed case's
    assert seen["allRows"] == 432
    assert seen["typed"] == [[row], "1 rows shown"]
    assert seen["failingOnly"] == [[CRASHED.split("/", 1)[1], row], "2 rows shown"]  # run order


@pytest.mark.slow
@needs_chromium
def test_a_run_with_a_planted_bug_in_chromium(planted_run):
    out, proc = planted_run
    assert (out / "r.html").is_file(), proc.stderr[-3000:]
    row = PLANTED_RUN_CASE.split("/", 1)[1]
    seen = _read_report(out / "r.html", row)
    assert seen["counts"] == {"total": "3", "passed": "2", "failed": "1", "unsupported": "0", "crashed": "0"}  # fmt: skip
    assert [f[1:4] for f in seen["failures"]] == [[PLANTED_RUN_CASE, "failed", "params, step 2"]]
    assert seen["firstBottom"] < seen["screen"] and seen["firstColour"] == RED
    assert seen["open"] == [{"id": "f0", "charts": 4}]
    # one heat map row, three implementations: only the planted one's params onwards are red
    cells = seen["heat"][row]
    assert len(cells) == 30 and RED in cells[:10] and RED not in cells[10:]
    assert seen["failingOnly"] == [[row], "1 rows shown"]


def test_a_raised_case_and_non_finite_distances_render():
    """The reports' hard cases (test_conformance_reports): a NaN against a number (an infinite
    distance, "Infinity" in the JSON), a case that raised, control characters in the reasons."""
    from tests.test_conformance_reports import _results

    doc = json.loads(report.to_json(_results(), {"world_size": 2}))
    text = html_report.render(doc)
    rows = _parse(text).rows["failure-list"]
    assert [row[3] for row in rows[1:]] == ["grads, step 1", "raised in step 1"]
    assert rows[1][4] == "inf"  # as the terminal summary writes it
    assert "\x1b" not in text and "\x00" not in text and "\\x1b[31mred" in text


def test_only_renders_a_selection_with_its_own_counts():
    doc = html_report.select(synthetic(200), ["*/fp32/*", "no_sync"])
    assert all("/fp32/" in c["name"] or "no_sync" in c["name"] for c in doc["cases"])
    page = _parse(html_report.render(doc))
    assert int(page.by_id["n-total"]) == len(doc["cases"]) == sum(doc["summary"].values()) > 0
    assert "rendered_only" in page.by_id["meta"]


def test_curves_of_chosen_passing_cases_on_demand(thousand):
    doc, _, _ = thousand
    name = "fsdp_lite/FULL_SHARD/fp32/plain/mlp/ws2"
    assert thousand[1].count('<svg width="250"') == 4  # the planted failure's only
    text = html_report.render(doc, curves_for=[name])
    section = text[text.index('id="selected"') : text.index('id="heatmap-title"')]
    assert name in section and section.count('<svg width="250"') == 4
    # against DDP, the single process and both native FSDPs' runs of the same case
    assert all(run in section for run in ("ddp", "single", "torch_fsdp2", "torch_fsdp1"))


# ---- the stored run: the default matrix of 3 implementations with one planted failure ------------

STORED_RUN = REPO / "benchmarks/results/conformance_planted_default_2026-12-06.json.xz"


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory) -> Path:
    """The page of the run docs/conformance.md shows (scripts/conformance_html_demo.py, the
    default matrix, 988 cases), rendered from its stored --json report."""
    page = tmp_path_factory.mktemp("stored") / "report.html"
    page.write_text(html_report.render(html_report.load(STORED_RUN)))
    return page


def test_the_stored_run_renders_with_its_planted_failure_first(stored_run):
    page = _parse(stored_run.read_text())
    counts = {s: page.by_id[f"n-{s}"] for s in ("total", *html_report.STATUSES)}
    assert counts == {"total": "988", "passed": "868", "failed": "23", "unsupported": "97", "crashed": "0"}  # fmt: skip
    assert page.rows["failure-list"][1][1:4] == [PLANTED_RUN_CASE, "failed", "params, step 2"]
    assert len(page.rows["failure-list"]) == 1 + 23


@needs_chromium
def test_the_stored_run_in_chromium(stored_run):
    row = PLANTED_RUN_CASE.split("/", 1)[1]
    seen = _read_report(stored_run, row)
    assert "23 failed, 0 crashed of 988" in seen["text"]
    assert seen["counts"] == {"total": "988", "passed": "868", "failed": "23", "unsupported": "97", "crashed": "0"}  # fmt: skip
    assert seen["perImpl"]["fsdp_lite_planted"] == ["348", "325", "1", "22", "0", "303"]
    assert seen["perImpl"]["torch_fsdp1"][:5] == ["320", "256", "22", "42", "0"]
    # the planted case first and on the first screen, in red; then torch FSDP1's 22
    assert seen["failures"][0][1:4] == [PLANTED_RUN_CASE, "failed", "params, step 2"]
    assert [f[1].split("/")[0] for f in seen["failures"][1:]] == ["torch_fsdp1"] * 22
    assert seen["firstBottom"] < seen["screen"] and seen["firstColour"] == RED
    assert seen["open"][0] == {"id": "f0", "charts": 4}
    # its heat map row red in the planted implementation's columns only
    cells = seen["heat"][row]
    assert cells[:10] == [RED] * 10 and RED not in cells[10:]
    assert seen["allRows"] == 348
    assert seen["typed"] == [[row], "1 rows shown"]
    assert len(seen["failingOnly"][0]) == 23 and row in seen["failingOnly"][0]


def test_a_compressed_report_loads(tmp_path):
    text = json.dumps(synthetic(20)).encode()
    (tmp_path / "r.json.gz").write_bytes(gzip.compress(text))
    (tmp_path / "r.json.xz").write_bytes(lzma.compress(text))
    assert html_report.load(tmp_path / "r.json.gz") == html_report.load(tmp_path / "r.json.xz")
    (tmp_path / "e.jsonl.xz").write_bytes(lzma.compress(b'{"event": "run"}\n'))
    with pytest.raises(ValueError, match="must hold a --json report"):
        html_report.load(tmp_path / "e.jsonl.xz")
