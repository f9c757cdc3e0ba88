"""The HTML report of a conformance run: one self-contained file a person opens first.

``python -m conformance ... --html report.html`` writes it at the end of a run, from the same JSON
document ``--json`` writes; ``python -m conformance.html results.json -o report.html`` renders one
from a saved ``--json`` report (or a ``--jsonl`` events file, whose cases are read back as the
launcher reads them), with ``--compare-to OLD.json`` for the diff view. What it shows, top down:

* the counts (passed, failed, unsupported, crashed) overall and per implementation, and the exit
  status;
* the failures first: every failed case, then every crashed one, each with its first failing
  stage and step, the failing comparisons (distance, tolerance, the worst tensor, the first
  problems), the traceback or the crash, and the per-step loss and gradient-norm curves of the
  implementation against DDP, the single process and each native torch FSDP that ran the same
  case (inline SVG, drawn here; the numbers are in a table beside them);
* with a baseline: the regressions and improvements (baseline.compare_reports) and every case
  whose status changed;
* the heat map: a row per case (strategy/precision/feature/model/...), a column group per
  implementation, a cell per stage and reference coloured by the stage's worst distance to that
  reference over the steps (``max_rel``) relative to its tolerance: bitwise, within 1e-3, 1e-2,
  1e-1 or 1 of the tolerance, failed; a cell's title gives the numbers; a filter box and a
  "failing rows only" switch;
* the unsupported reasons, the run's metadata and the tolerance table.

Self-contained: inline CSS and a few lines of inline JavaScript (the filter; the page reads the
same without it), no external URL in any ``src`` or ``href``. Small for 1,000+ cases: the heat map
is one short element per cell, a title only on a cell that is not bitwise, and curves only for
failing cases (``MAX_CURVES`` of them), the other details collapsed.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import lzma
import math
import sys
from collections import Counter
from collections.abc import Sequence
from html import escape as _escape
from pathlib import Path
from typing import Any

__all__ = ["MAX_CURVES", "load", "main", "render"]


def escape(text: str) -> str:
    """``text`` for HTML, with the control characters HTML forbids (terminal colour escapes in an
    exception message, a NUL) written as their escapes, as report.xml_text does for JUnit."""
    from conformance.report import xml_text

    return _escape(xml_text(text))


STAGES = ("loss", "grads", "params", "optim_state", "state_dict")  # tolerances.STAGES
REFS = (("vs_ddp", "ddp"), ("vs_single", "single"))
STATUSES = ("passed", "failed", "unsupported", "crashed")
MAX_CURVES = 50  # failing cases drawn with their curves; the rest say how to see theirs
_TRACEBACK_CHARS = 6000
_OPEN_FAILURES = 3  # the first failures' details open on load

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.2em;margin:1.2em 0 .4em;border-bottom:1px solid #ccc}
table{border-collapse:collapse}td,th{padding:1px 6px;text-align:left;vertical-align:top}
.t td,.t th{border:1px solid #ddd}.num{text-align:right;font-variant-numeric:tabular-nums}
.counts span{display:inline-block;margin-right:1.2em;font-size:1.1em}
.passed{color:#1a7f37}.failed{color:#cf222e}.unsupported{color:#777}.crashed{color:#8250df}
details.case{color:#222;border:1px solid #ddd;border-left:4px solid #cf222e;margin:.3em 0;padding:.2em .6em}
details.case.crashed{border-left-color:#8250df}details.case.sel{border-left-color:#0969da}details.case>summary{cursor:pointer}
pre{background:#f6f8fa;padding:.5em;overflow:auto;max-height:24em;font-size:12px}
.hm{font-size:11px}.hm td{padding:0;width:9px;height:11px;border:1px solid #fff}
.hm td.k{width:auto;padding:0 6px 0 0;white-space:nowrap;font-family:monospace;border:0}
.hm th{font-weight:normal;font-size:10px;padding:0 2px;text-align:center}
.hm td:nth-child(10n+2){border-left:3px solid #fff}
.b{background:#116329}.g1{background:#4ac26b}.g2{background:#aceebb}.g3{background:#fff8c5}
.g4{background:#f5c542}.f{background:#cf222e}.e{background:#82071e}.u{background:#d0d7de}
.x{background:#f6f8fa}.n{background:#eaeef2}.c{background:#8250df}
.legend i{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}
svg{background:#fff;border:1px solid #ddd;margin:4px 6px 4px 0}svg text{font-size:10px}
.keys svg{border:0;margin:0 3px 0 8px}
.changed{font-weight:bold}.muted{color:#777}
"""

_JS = """
function hmFilter(){var q=document.getElementById('hmq').value.toLowerCase(),
o=document.getElementById('hmf').checked,rows=document.querySelectorAll('#heatmap tr.r'),n=0;
for(var i=0;i<rows.length;i++){var r=rows[i],show=r.cells[0].textContent.toLowerCase().indexOf(q)>=0&&
(!o||r.classList.contains('bad'));r.style.display=show?'':'none';if(show)n++}
document.getElementById('hmn').textContent=n+' rows shown'}
"""


def _num(x: Any) -> str:
    """A distance as the other reports write it: 0, 1.2e-07, inf."""
    if isinstance(x, str):
        return x  # NaN / Infinity as the JSON wrote them
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.1e}" if math.isfinite(x) else str(x)


def _float(x: Any) -> float:
    if isinstance(x, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x, math.nan)
    return math.nan if x is None else float(x)


def _rest(name: str) -> str:
    """A case's name without its implementation: the heat map's row."""
    return name.split("/", 1)[1] if "/" in name else name


def _first_failure(case: dict[str, Any]) -> str:
    """``params, step 2``; ``raised in step 1, comparing grads``; ``rank died after ...``."""
    first = case.get("first_failure")
    if first:
        return f"{first['stage']}, step {first['step']}"
    if case["status"] == "crashed":
        crash = case.get("crash") or {}
        kind = "hung" if crash.get("kind") == "hang" else "rank died"
        return f"{kind} after {crash['after']}" if crash.get("after") else kind
    reason = case.get("reason") or ""
    if case.get("traceback") and " raised in " in reason:
        return "raised in " + reason.split(" raised in ", 1)[1].split(":", 1)[0]
    return "-"


def _worst(case: dict[str, Any], ref: str) -> str:
    """The largest max_abs over the stages against ``ref``, or 'bitwise'."""
    tallies = [v[ref] for v in case.get("stages", {}).values()]
    if not tallies:
        return "-"
    if all(t["bitwise"] for t in tallies):
        return "bitwise"
    return _num(max((_float(t["max_abs"]) for t in tallies), key=lambda v: -1 if v != v else v))


def _level(case: dict[str, Any], stage: str, ref: str) -> tuple[str, str | None]:
    """The heat map's class for one cell, and its title (None: bitwise or nothing to say)."""
    status = case["status"]
    if status == "unsupported":
        return "u", None
    if status == "crashed":
        return "c", None
    verdict = case.get("stages", {}).get(stage)
    if verdict is None:
        return ("e" if case.get("traceback") else "n"), None
    t = verdict[ref]
    tol = t["tolerance"]
    # short: a title per cell is most of the page's size
    title = f"{stage} {ref[3:]}: {_num(t['max_rel'])} (rtol {tol['rtol']:g}"
    title += f", atol {tol['atol']:g})" if tol["atol"] else ")"
    if not t["passed"]:
        step = t.get("first_failed_step")
        return "f", title + (f" fails from step {step}" if step else " fails")
    if t["bitwise"]:
        return "b", None
    rel, rtol = _float(t["max_rel"]), tol["rtol"]
    q = rel / rtol if rtol > 0 else 1e-2  # within an absolute tolerance only
    for cls, bound in (("g1", 1e-3), ("g2", 1e-2), ("g3", 1e-1)):
        if q <= bound:
            return cls, title
    return "g4", title


# ---- curves ------------------------------------------------------------------------------------

_SERIES_STYLE = {
    "impl": ("#cf222e", ""),
    "ddp": ("#222", "4 2"),
    "single": ("#888", "1 2"),
}
_NATIVE_COLOURS = ("#1a7f37", "#0969da", "#bf8700")
Series = tuple[str, list[Any], str, str]  # label, values by step, colour, dash


def _points(values: Sequence[Any]) -> list[tuple[int, float]]:
    points = [(i + 1, _float(v)) for i, v in enumerate(values) if v is not None]
    return [(s, y) for s, y in points if y == y]  # NaN: no point


def _svg(title: str, series: list[Series], steps: int, log: bool = False) -> str:
    """A small line chart of ``series`` over steps 1..``steps``. ``log``: log10 of the values,
    0 drawn on the bottom line (labelled 0: bitwise)."""
    w, h, left, right, top, bottom = 250, 130, 52, 10, 16, 18
    lines = []
    for _label, values, colour, dash in series:
        pts = _points(values)
        if log:
            pts = [(s, math.log10(y) if y > 0 else -math.inf) for s, y in pts]
        lines.append((pts, colour, dash))
    finite = [y for pts, _, _ in lines for _, y in pts if math.isfinite(y)]
    has_zero = log and any(y == -math.inf for pts, _, _ in lines for _, y in pts)
    if not finite and not has_zero:
        return ""
    all_zero = has_zero and not finite  # every point bitwise: one line on the bottom, said so
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.01 or 1.0
    lo, hi = lo - pad, hi + pad
    if has_zero:
        lo -= (hi - lo) * 0.15  # room for the bitwise line below the smallest difference

    def xy(step: int, y: float) -> str:
        x = left + (w - left - right) * ((step - 1) / max(1, steps - 1))
        y = lo if y == -math.inf else hi if y == math.inf else y
        return f"{x:.1f},{top + (h - top - bottom) * (1 - (y - lo) / (hi - lo)):.1f}"

    def tick(y: float) -> str:
        return f"{10**y:.1e}" if log else f"{y:.4g}"

    out = [
        f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-size="10" role="img"><title>{escape(title)}</title>',
        f'<text x="{left}" y="11">{escape(title)}</text>',
        f'<path d="M{left} {top}V{h - bottom}H{w - right}" fill="none" stroke="#999"/>',
        f'<text x="{left - 3}" y="{top + 8}" text-anchor="end">{"" if all_zero else tick(hi)}</text>',
        f'<text x="{left - 3}" y="{h - bottom}" text-anchor="end">'
        f"{'0' if has_zero else tick(lo)}</text>",
    ]
    for step in range(1, steps + 1):
        x = xy(step, lo).split(",")[0]
        label = str(step) if step < steps else f"{step}*"
        out.append(f'<text x="{x}" y="{h - 5}" text-anchor="middle">{label}</text>')
    for pts, colour, dash in lines:
        if not pts:
            continue
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        path = " ".join(xy(s, y) for s, y in pts)
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"{dash_attr}/>'
        )
    if all_zero:
        out.append(
            f'<text x="{(left + w) / 2:.0f}" y="{h / 2:.0f}" text-anchor="middle">all 0</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _minus(values: list[Any], ref: list[Any]) -> list[float | None]:
    """|values - ref| per step (None where either is missing)."""
    out: list[float | None] = []
    for i, v in enumerate(values):
        r = ref[i] if i < len(ref) else None
        out.append(None if v is None or r is None else abs(_float(v) - _float(r)))
    return out


def _curves(case: dict[str, Any], natives: list[dict[str, Any]]) -> str:
    """The case's loss and gradient-norm charts (values, and distance to DDP on a log scale) and
    their numbers, or a line saying why there are none."""
    curves = case.get("curves")
    if not curves:
        return (
            '<p class="muted">No curves recorded for this case (it ended before its first loss, '
            "or the report predates them).</p>"
        )
    steps = max(len(v) for metric in curves.values() for v in metric.values())
    charts, rows, legend = [], [], {}
    for metric, title in (("loss", "loss (rank 0)"), ("grad_norm", "gradient norm")):
        per = curves.get(metric)
        if not per:
            continue
        series: list[Series] = [
            (case["impl"] if key == "impl" else key, per.get(key, []), *_SERIES_STYLE[key])
            for key in ("impl", "ddp", "single")
        ]
        for colour, native in zip(_NATIVE_COLOURS, natives):
            values = (native.get("curves") or {}).get(metric, {}).get("impl", [])
            series.append((native["impl"], values, colour, "6 3"))
        legend.update({label: (colour, dash) for label, _, colour, dash in series})
        charts.append(_svg(title, series, steps))
        ddp = per.get("ddp", [])
        diffs = [
            (label, _minus(values, ddp), colour, dash)
            for label, values, colour, dash in series
            # the single process's loss is on the global batch: its distance says nothing
            if label != "ddp" and not (label == "single" and metric == "loss")
        ]
        charts.append(_svg(f"|{title.split(' (')[0]} - DDP| (log)", diffs, steps, log=True))
        for label, values, _, _ in series:
            cells = "".join(
                '<td class="num">'
                + ("-" if i >= len(values) or values[i] is None else f"{_float(values[i]):.8g}")
                + "</td>"
                for i in range(steps)
            )
            rows.append(f"<tr><td>{metric}</td><td>{escape(label)}</td>{cells}</tr>")
    keys = "".join(
        f'<svg width="22" height="8"><line x1="0" y1="4" x2="22" y2="4" stroke="{colour}" '
        + (f'stroke-dasharray="{dash}" ' if dash else "")
        + f'stroke-width="2"/></svg>{escape(label)} '
        for label, (colour, dash) in legend.items()
    )
    head = "".join(f"<th>{s + 1}{'*' if s + 1 == steps else ''}</th>" for s in range(steps))
    return (
        f'<p class="keys">{keys}<span class="muted">(single: its loss is on the global batch, '
        "rank 0's on its own; step * is the step after the state-dict round trip)</span></p>"
        f"<div>{''.join(charts)}</div>"
        f'<details><summary>the numbers</summary><table class="t"><tr><th>metric</th><th>run</th>'
        f"{head}</tr>{''.join(rows)}</table></details>"
    )


# ---- sections ----------------------------------------------------------------------------------


def _counts(cases: list[dict[str, Any]]) -> Counter:
    return Counter(c["status"] for c in cases)


def _summary(doc: dict[str, Any], cases: list[dict[str, Any]]) -> str:
    counts = _counts(cases)
    spans = [f'<span>cases <b id="n-total">{len(cases)}</b></span>']
    spans += [f'<span class="{s}">{s} <b id="n-{s}">{counts[s]}</b></span>' for s in STATUSES]
    impls = list(dict.fromkeys(c["impl"] for c in cases))
    rows = []
    for impl in impls:
        n = _counts([c for c in cases if c["impl"] == impl])
        bitwise = sum(
            1
            for c in cases
            if c["impl"] == impl
            and c["status"] == "passed"
            and all(v["vs_ddp"]["bitwise"] for v in c.get("stages", {}).values())
        )
        cells = "".join(f'<td class="num">{n[s]}</td>' for s in STATUSES)
        rows.append(
            f'<tr data-impl="{escape(impl)}"><td>{escape(impl)}</td><td class="num">{sum(n.values())}</td>'
            f'{cells}<td class="num">{bitwise}</td></tr>'
        )
    head = "".join(f"<th>{s}</th>" for s in STATUSES)
    status = doc.get("exit_status")
    return (
        f'<p class="counts" id="counts">{"".join(spans)}</p>'
        + (f"<p>Exit status <b>{escape(str(status))}</b>.</p>" if status is not None else "")
        + f'<table class="t" id="per-impl"><tr><th>implementation</th><th>cases</th>{head}'
        f"<th>bitwise vs DDP</th></tr>{''.join(rows)}</table>"
    )


def _failing_table(case: dict[str, Any]) -> str:
    rows = []
    for stage, verdict in case.get("stages", {}).items():
        for key, ref in REFS:
            t = verdict[key]
            if t["passed"]:
                continue
            tol = t["tolerance"]
            problems = "<br>".join(escape(p) for p in t.get("problems", [])[:3])
            rows.append(
                f"<tr><td>{stage}</td><td>{ref}</td><td class='num'>{t.get('first_failed_step')}</td>"
                f"<td class='num'>{_num(t['max_abs'])}</td><td class='num'>{_num(t['max_rel'])}</td>"
                f"<td class='num'>{tol['rtol']:g}</td><td>{escape(t.get('worst') or '')}</td>"
                f"<td>{problems}</td></tr>"
            )
    if not rows:
        return ""
    return (
        '<table class="t"><tr><th>stage</th><th>vs</th><th>from step</th><th>max abs</th>'
        "<th>max rel</th><th>rtol</th><th>worst</th><th>problems</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _crash(crash: dict[str, Any]) -> str:
    keys = (
        "summary",
        "kind",
        "rank",
        "signal",
        "exit_code",
        "after",
        "native",
        "verdict",
        "crashed_runs",
    )
    rows = "".join(
        f"<tr><th>{k}</th><td>{escape(str(crash[k]))}</td></tr>"
        for k in keys
        if crash.get(k) is not None
    )
    tail = crash.get("stderr_tail")
    return f'<table class="t">{rows}</table>' + (
        f"<pre>{escape(tail[-_TRACEBACK_CHARS:])}</pre>" if tail else ""
    )


def _failures(
    cases: list[dict[str, Any]], by_name: dict[str, dict[str, Any]], doc: dict[str, Any]
) -> str:
    failing = [c for c in cases if c["status"] == "failed"]
    failing += [c for c in cases if c["status"] == "crashed"]
    outside = doc.get("crashes_outside_cases") or []
    if not failing and not outside:
        return '<h2 id="failures">Failures</h2><p class="passed">No case failed or crashed.</p>'
    rows, details = [], []
    for i, c in enumerate(failing):
        anchor = f"f{i}"
        where = _first_failure(c)
        rows.append(
            f'<tr><td class="num">{i + 1}</td><td><a href="#{anchor}">{escape(c["name"])}</a></td>'
            f'<td class="{c["status"]}">{c["status"]}</td><td class="first">{escape(where)}</td>'
            f'<td class="num">{_worst(c, "vs_ddp")}</td><td class="num">{_worst(c, "vs_single")}</td></tr>'
        )
        body = [f"<p>{escape(c.get('reason') or '')}</p>", _failing_table(c)]
        if c.get("crash"):
            body.append(_crash(c["crash"]))
        if c.get("traceback"):
            body.append(f"<pre>{escape(c['traceback'][-_TRACEBACK_CHARS:])}</pre>")
        if i < MAX_CURVES:
            body.append(_curves(c, _natives(c, by_name)))
        else:
            body.append(
                f'<p class="muted">Curves are drawn for the first {MAX_CURVES} failures; this '
                "case's are in the JSON report's <code>curves</code>, or drawn by "
                "<code>python -m conformance.html --curves NAME</code>.</p>"
            )
        details.append(
            f'<details class="case {c["status"]}" id="{anchor}"{" open" if i < _OPEN_FAILURES else ""}>'
            f'<summary><b class="{c["status"]}">{c["status"]}</b> <code>{escape(c["name"])}</code>'
            f" &mdash; {escape(where)}</summary>{''.join(body)}</details>"
        )
    for j, crash in enumerate(outside):
        details.append(
            f'<details class="case crashed" id="o{j}"><summary><b class="crashed">crashed outside a case</b> '
            f"{escape(str(crash.get('where', '?')))}</summary>{_crash(crash)}</details>"
        )
    return (
        f'<h2 id="failures">Failures ({len(failing)} cases'
        + (f", {len(outside)} deaths outside any case" if outside else "")
        + ")</h2>"
        '<table class="t" id="failure-list"><tr><th>#</th><th>case</th><th>status</th>'
        "<th>first failing stage</th><th>vs DDP</th><th>vs single</th></tr>"
        + "".join(rows)
        + "</table>"
        + "".join(details)
    )


def _natives(case: dict[str, Any], by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The same case run by every native torch FSDP (``torch_*``) of the run but its own."""
    impls = dict.fromkeys(c["impl"] for c in by_name.values())
    names = (f"{impl}/{_rest(case['name'])}" for impl in impls if impl.startswith("torch_"))
    return [by_name[n] for n in names if n in by_name and n != case["name"]]


def _selected(by_name: dict[str, dict[str, Any]], patterns: Sequence[str]) -> str:
    """The curves of the cases ``patterns`` choose (``--curves``), whatever their status."""
    if not patterns:
        return ""
    chosen = _matching(list(by_name.values()), patterns)
    parts = []
    for c in chosen[:MAX_CURVES]:
        parts.append(
            f'<details class="case sel"><summary><b class="{c["status"]}">{c["status"]}</b> '
            f"<code>{escape(c['name'])}</code></summary>{_curves(c, _natives(c, by_name))}</details>"
        )
    more = len(chosen) - MAX_CURVES
    if more > 0:
        parts.append(
            f'<p class="muted">{more} more cases match; drawn: the first {MAX_CURVES}.</p>'
        )
    shown = ", ".join(escape(p) for p in patterns)
    return f'<h2 id="selected">Curves of the cases chosen ({shown}: {len(chosen)})</h2>' + "".join(
        parts
    )


def _matching(cases: list[dict[str, Any]], patterns: Sequence[str]) -> list[dict[str, Any]]:
    """The cases whose name matches one of ``patterns`` (matrix.select's rule), in order."""
    from types import SimpleNamespace

    from conformance import matrix

    named = [SimpleNamespace(name=c["name"]) for c in cases]
    chosen = {n.name for n in matrix.select(named, list(patterns))}
    return [c for c in cases if c["name"] in chosen]


def _comparison(doc: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    comparison = doc.get("comparison")
    if comparison is None:
        return ""
    parts = [
        f'<h2 id="comparison">Compared with <code>{escape(str(comparison["baseline"]))}</code></h2>',
        f'<p><b id="n-regressions">{len(comparison["regressions"])}</b> regressions, '
        f'<b id="n-improvements">{len(comparison["improvements"])}</b> improvements (factor '
        f"{comparison['factor']:g}), {len(comparison['new_cases'])} new cases, "
        f"{len(comparison['missing_cases'])} cases not run.</p>",
    ]
    for title, key, cls in (
        ("Regressions", "regressions", "failed"),
        ("Improvements", "improvements", "passed"),
    ):
        changes = comparison[key]
        if changes:
            rows = "".join(
                f"<tr><td>{escape(ch['case'])}</td><td>{escape(ch['stage'] or '-')}</td><td>{escape(ch['what'])}</td></tr>"
                for ch in changes
            )
            parts.append(
                f'<h3 class="{cls}">{title}</h3><table class="t" id="{key}"><tr><th>case</th>'
                f"<th>stage</th><th>what changed</th></tr>{rows}</table>"
            )
    if baseline is not None:
        old = {c["name"]: c["status"] for c in baseline.get("cases", [])}
        moved = [
            (c["name"], old[c["name"]], c["status"])
            for c in doc["cases"]
            if c["name"] in old and old[c["name"]] != c["status"]
        ]
        if moved:
            rows = "".join(
                f'<tr><td>{escape(n)}</td><td class="{a}">{a}</td><td class="{b}">{b}</td></tr>'
                for n, a, b in moved
            )
            parts.append(
                f'<h3>Status changes ({len(moved)})</h3><table class="t" id="status-changes">'
                f"<tr><th>case</th><th>before</th><th>now</th></tr>{rows}</table>"
            )
    for title, key in (("New cases", "new_cases"), ("Cases not run", "missing_cases")):
        names = comparison[key]
        if names:
            items = "".join(f"<li>{escape(n)}</li>" for n in names)
            parts.append(
                f"<details><summary>{title} ({len(names)})</summary><ul>{items}</ul></details>"
            )
    return "".join(parts)


def _heatmap(cases: list[dict[str, Any]], changed: set[str]) -> str:
    impls = list(dict.fromkeys(c["impl"] for c in cases))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cases:
        rows.setdefault(_rest(c["name"]), {})[c["impl"]] = c
    anchors = {}
    failing = [c for c in cases if c["status"] == "failed"] + [
        c for c in cases if c["status"] == "crashed"
    ]
    for i, c in enumerate(failing):
        anchors[c["name"]] = f"f{i}"
    ncols = len(STAGES) * len(REFS)
    head1 = "".join(f'<th colspan="{ncols}">{escape(i)}</th>' for i in impls)
    stage_abbr = {"loss": "L", "grads": "G", "params": "P", "optim_state": "O", "state_dict": "S"}
    head2 = "".join(
        f'<th title="{s} vs {r}">{stage_abbr[s]}{r[0]}</th>'
        for _ in impls
        for s in STAGES
        for _, r in REFS
    )
    out = []
    for key, per in rows.items():
        cells = []
        bad = False
        for impl in impls:
            c = per.get(impl)
            for j, (stage, (ref, _)) in enumerate((s, r) for s in STAGES for r in REFS):
                if c is None:
                    cells.append("<td class=x></td>")
                    continue
                cls, title = _level(c, stage, ref)
                bad |= cls in ("f", "e", "c")
                if j == 0 and c["status"] in ("unsupported", "crashed"):
                    reason = (c.get("reason") or "").split("\n", 1)[0][:200]
                    title = f"{impl} {c['status']}: {reason}"
                t = f' title="{escape(title)}"' if title else ""
                cells.append(f"<td class={cls}{t}></td>")
        names = [f"{impl}/{key}" for impl in per]
        label = escape(key)
        link = next((anchors[n] for n in names if n in anchors), None)
        if link:
            label = f'<a href="#{link}">{label}</a>'
        if any(n in changed for n in names):
            label = (
                f'<span class="changed" title="changed since the baseline">&Delta; {label}</span>'
            )
        out.append(
            f'<tr class="r{" bad" if bad else ""}"><td class=k>{label}</td>{"".join(cells)}</tr>'
        )
    legend = "".join(
        f'<i class="{cls}"></i>{text}'
        for cls, text in (
            ("b", "bitwise"),
            ("g1", "&le; 1e-3 of tol"),
            ("g2", "&le; 1e-2"),
            ("g3", "&le; 1e-1"),
            ("g4", "&le; tol"),
            ("f", "failed"),
            ("e", "raised before"),
            ("n", "not reached"),
            ("u", "unsupported"),
            ("c", "crashed"),
            ("x", "not in the run"),
        )
    )
    return (
        f'<h2 id="heatmap-title">Heat map ({len(rows)} rows, {len(cases)} cases)</h2>'
        "<p>Each cell: one stage against one reference (L loss, G grads, P params, O optimizer "
        "state, S state dict; d DDP, s single process), coloured by the stage's worst distance "
        "over the steps (<code>max_rel</code>) as a fraction of its tolerance. Hover a cell for the numbers.</p>"
        f'<p class="legend">{legend}</p>'
        '<p><input id="hmq" placeholder="filter rows, e.g. bf16/no_sync" oninput="hmFilter()"> '
        '<label><input type="checkbox" id="hmf" onchange="hmFilter()"> failing rows only</label> '
        f'<span id="hmn" class="muted">{len(rows)} rows</span></p>'
        f'<table class="hm" id="heatmap"><tr><th></th>{head1}</tr><tr><th></th>{head2}</tr>{"".join(out)}</table>'
    )


def _unsupported(cases: list[dict[str, Any]]) -> str:
    reasons = Counter(
        (c["impl"], (c.get("reason") or "").splitlines()[0][:300] if c.get("reason") else "")
        for c in cases
        if c["status"] == "unsupported"
    )
    if not reasons:
        return ""
    rows = "".join(
        f'<tr><td>{escape(impl)}</td><td class="num">{n}</td><td>{escape(reason)}</td></tr>'
        for (impl, reason), n in sorted(reasons.items(), key=lambda kv: (kv[0][0], -kv[1]))
    )
    return (
        f"<details><summary><b>Unsupported</b> ({sum(reasons.values())} cases, {len(reasons)} reasons)</summary>"
        f'<table class="t"><tr><th>implementation</th><th>cases</th><th>reason</th></tr>{rows}</table></details>'
    )


_NOT_META = {"cases", "tolerance_table", "summary", "comparison", "crashes_outside_cases"}


def _metadata(doc: dict[str, Any], source: str | None) -> str:
    items = [(k, v) for k, v in doc.items() if k not in _NOT_META]
    if source:
        items.append(("rendered from", source))
    items.append(
        ("rendered at", datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    )
    rows = "".join(
        f"<tr><th>{escape(str(k))}</th><td>{escape(v if isinstance(v, str) else json.dumps(v))}</td></tr>"
        for k, v in items
    )
    table = doc.get("tolerance_table") or []
    tol_rows = "".join(
        f"<tr><td>{escape(r['precision'])}</td><td>{escape(r['reference'])}</td><td>{escape(r['when'])}</td>"
        + "".join(
            f"<td class='num'>{r['tolerances'].get(s, {}).get('rtol', 0):g}</td>" for s in STAGES
        )
        + f"<td>{escape(r.get('why', ''))}</td></tr>"
        for r in table
    )
    tol = (
        f"<details><summary>Tolerance table ({len(table)} rows, rtol relative to the tensor's largest element)</summary>"
        f'<table class="t"><tr><th>precision</th><th>vs</th><th>when</th>{"".join(f"<th>{s}</th>" for s in STAGES)}<th>why</th></tr>{tol_rows}</table></details>'
        if table
        else ""
    )
    return f'<h2 id="metadata">Run</h2><table class="t" id="meta">{rows}</table>{tol}'


def render(
    doc: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    baseline_path: str = "baseline",
    factor: float | None = None,
    source: str | None = None,
    curves_for: Sequence[str] = (),
) -> str:
    """The HTML report of ``doc`` (a ``--json`` report as a dict). With ``baseline`` (an older
    report, from ``baseline_path``) and no ``comparison`` in ``doc``, compare the two as
    ``--compare-to`` does (baseline.compare_reports, ``factor`` default 10); either way the cases
    whose status changed are listed. ``curves_for``: patterns of cases to draw the curves of
    too, passing ones included (``python -m conformance.html --curves``)."""
    if baseline is not None and "comparison" not in doc:
        from conformance.baseline import DEFAULT_FACTOR, compare_reports

        doc = dict(doc)
        factor = DEFAULT_FACTOR if factor is None else factor
        doc["comparison"] = compare_reports(baseline, doc, baseline_path, factor).to_json()
    cases = list(doc.get("cases", []))
    by_name = {c["name"]: c for c in cases}
    comparison = doc.get("comparison") or {}
    changed = {
        ch["case"] for key in ("regressions", "improvements") for ch in comparison.get(key, [])
    }
    counts = _counts(cases)
    impls = ", ".join(dict.fromkeys(c["impl"] for c in cases)) or "no cases"
    title = f"Conformance: {impls} — {counts['failed']} failed, {counts['crashed']} crashed of {len(cases)}"
    where = (
        f"{doc.get('world_size', '?')} ranks, {doc.get('backend', '?')} on {doc.get('device', '?')}"
    )
    where += f", torch {doc.get('torch', '?')}"
    if doc.get("seconds") is not None:
        where += f", {doc['seconds']:.0f} s"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="muted">{escape(where)} &middot; <a href="#failures">failures</a> &middot; '
        '<a href="#heatmap-title">heat map</a> &middot; <a href="#metadata">run</a></p>',
        _summary(doc, cases),
        _failures(cases, by_name, doc),
        _comparison(doc, baseline),
        _selected(by_name, curves_for),
        _heatmap(cases, changed),
        _unsupported(cases),
        _metadata(doc, source),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + f"<script>{_JS}</script></body></html>\n"
    )


def load(path: str | Path) -> dict[str, Any]:
    """A ``--json`` report (or one compressed, ``.xz`` or ``.gz``), or the report a ``--jsonl``
    events file makes (as the launching process assembles it after the last launch: each case's
    result, or its crash)."""
    raw = Path(path).read_bytes()
    compressed = str(path).endswith((".xz", ".gz"))
    if compressed:
        raw = lzma.decompress(raw) if str(path).endswith(".xz") else gzip.decompress(raw)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except ValueError:
        doc = None
    if compressed and not (isinstance(doc, dict) and "cases" in doc):
        raise ValueError(f"{path}: a compressed file must hold a --json report")
    if isinstance(doc, dict) and "cases" in doc:
        if "schema_version" not in doc:  # --world-sizes' or --self-test's report
            raise ValueError(
                f"{path}: not a report of python -m conformance --json (schema "
                f"{doc.get('schema', '?')}); --world-sizes and --self-test have their own"
            )
        return doc
    from conformance import report
    from conformance.cli import _assemble
    from conformance.launcher import Survived, read_events

    events = read_events(path)
    state = Survived()
    state.absorb(events)
    for e in events:
        if e.get("event") == "crashed":
            state.crashed[e["index"]] = e["crash"]  # the last line of a case has its verdict
    meta = dict(state.plan["meta"]) if state.plan else {}
    return json.loads(report.to_json(_assemble(state), meta))


def select(doc: dict[str, Any], patterns: list[str]) -> dict[str, Any]:
    """``doc`` with only the cases whose name matches one of ``patterns`` (matrix.select's
    rule), its summary recounted and the patterns noted."""
    cases = _matching(doc["cases"], patterns)
    counts = _counts(cases)
    return {
        **doc,
        "rendered_only": patterns,
        "summary": {s: counts[s] for s in STATUSES},
        "cases": cases,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.html",
        description="Render the HTML report of a conformance run from its --json report "
        "(or its --jsonl events file), without running anything.",
    )
    parser.add_argument("results", help="a --json report (.xz or .gz too) or a --jsonl events file")
    parser.add_argument("-o", "--output", default="report.html", help="default report.html")
    parser.add_argument("--compare-to", metavar="OLD", help="an older --json report: the diff view")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only the cases whose name matches (a glob, else a substring; repeatable), as "
        "python -m conformance selects them; the counts are then the selection's",
    )
    parser.add_argument(
        "--curves",
        action="append",
        default=[],
        metavar="PATTERN",
        help="draw the loss and gradient-norm curves of the cases whose name matches too, "
        f"passing ones included (repeatable; at most {MAX_CURVES})",
    )
    parser.add_argument(
        "--regression-factor",
        type=float,
        default=None,
        metavar="F",
        help="as python -m conformance's",
    )
    args = parser.parse_args(argv)
    try:
        doc = load(args.results)
    except ValueError as e:
        parser.error(str(e))
    if args.only:
        doc = select(doc, args.only)
    baseline = None
    if args.compare_to is not None:
        from conformance.baseline import load_report

        baseline = load_report(args.compare_to)
    html = render(
        doc,
        baseline,
        str(args.compare_to),
        args.regression_factor,
        source=str(args.results),
        curves_for=args.curves,
    )
    Path(args.output).write_text(html, encoding="utf-8")
    print(f"{args.output}: {len(html) / 1024:.0f} KiB, {len(doc.get('cases', []))} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
