"""Open a local page in headless Chromium, offline: its DOM after the scripts ran, a probe's
answer, or a PNG screenshot.

    python scripts/headless_chromium.py PAGE.html --png OUT.png [--size 1600x1000] [--fragment '#t=0,50']
        [--script 'document.getElementById("hmf").click()'] [--top '#heatmap-title']
    python scripts/headless_chromium.py PAGE.html --dom          # the DOM after the scripts ran

Drives Debian's ``chromium`` binary directly (no Python package): ``--dump-dom`` and
``--screenshot``, each run with a fresh profile directory, and with every host name resolving to
nothing and a proxy that does not exist, so that a page that fetched anything would show it
broken. The tests of the HTML report and of the trace viewer use it; they skip where
``chromium()`` finds no browser.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# No network: names resolve to nothing, and anything that would still connect goes to a closed
# port. The rest keeps the browser from its own background fetches and first-run pages.
OFFLINE = (
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *OFFLINE)
BUDGET_MS = 5000  # virtual time: timers and loads settle; nothing waits for real


def chromium() -> str | None:
    """The Chromium binary on PATH (Debian's ``chromium``), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(url: str, flags: list[str], size: tuple[int, int], timeout: float) -> str:
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        # A profile of its own: runs at the same time (other tests, other users) never share one.
        command = [
            binary,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={BUDGET_MS}",
            *flags,
            url,
        ]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def url_of(page: str | Path, fragment: str = "") -> str:
    return Path(page).resolve().as_uri() + fragment


def dump_dom(
    page: str | Path, size: tuple[int, int] = (1400, 1000), fragment: str = "", timeout=120
) -> str:
    """The page's DOM as HTML once it loaded and its scripts ran."""
    return _run(url_of(page, fragment), ["--dump-dom"], size, timeout)


@contextlib.contextmanager
def _with_script(page: Path, script: str | None) -> Iterator[Path]:
    """``page``, or a copy of it beside it with ``script`` run after the page's own scripts."""
    if not script:
        yield page
        return
    text = page.read_text()
    at = text.rindex("</body>")
    copy = page.with_name(f"{page.stem}.probe{page.suffix}")
    copy.write_text(text[:at] + f"<script>{script}</script>" + text[at:])
    try:
        yield copy
    finally:
        copy.unlink()


def probe(
    page: str | Path, script: str, size: tuple[int, int] = (1400, 1000), fragment: str = ""
) -> Any:
    """Run ``script`` (a JavaScript function body that returns something JSON-able) in ``page``
    after the page's own scripts, laid out at ``size``, and return what it returned.

    The probe sees the page as drawn: ``innerText`` (what is rendered, not what is hidden),
    layout boxes, computed styles.
    """
    wrapped = (
        "(function(){var r;try{r=(function(){" + script + "})()}catch(e){r={error:String(e)}}"
        "var out=document.createElement('pre');out.id='probe-result';"
        "out.textContent=JSON.stringify(r);document.body.appendChild(out)})()"
    )
    with _with_script(Path(page), wrapped) as copy:
        dom = dump_dom(copy, size, fragment)
    found = re.search(r'<pre id="probe-result">(.*?)</pre>', dom, re.S)
    if found is None:
        raise AssertionError("the probe did not run: " + dom[-500:])
    result = json.loads(html.unescape(found.group(1)))
    if isinstance(result, dict) and set(result) == {"error"}:
        raise AssertionError(f"the probe raised: {result['error']}")
    return result


def screenshot(
    page: str | Path,
    png: str | Path,
    size: tuple[int, int] = (1400, 1000),
    fragment: str = "",
    script: str | None = None,
    top: str | None = None,
    timeout=120,
) -> Path:
    """A PNG of the page's first ``size`` pixels, after ``script`` (JavaScript) ran; with ``top``
    (a CSS selector), of the page from that element down."""
    if top:
        # Shifted, not scrolled: a headless screenshot of a scrolled page can come out blank.
        shift = (
            f"var el=document.querySelector({json.dumps(top)});"
            "document.body.style.transform="
            "'translateY(-'+Math.max(el.getBoundingClientRect().top-12,0)+'px)';"
        )
        script = (script or "") + ";" + shift
    png = Path(png).resolve()
    with _with_script(Path(page), script) as copy:
        _run(url_of(copy, fragment), [f"--screenshot={png}"], size, timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no {png}")
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--png", type=Path, help="write a screenshot here")
    what.add_argument("--dom", action="store_true", help="print the DOM after the scripts ran")
    parser.add_argument("--size", default="1400x1000", help="window WIDTHxHEIGHT (1400x1000)")
    parser.add_argument("--fragment", default="", help="appended to the page's URL, e.g. #t=0,50")
    parser.add_argument("--script", help="JavaScript to run before the screenshot")
    parser.add_argument("--top", help="CSS selector of the element to put at the picture's top")
    args = parser.parse_args(argv)
    width, height = (int(x) for x in args.size.lower().split("x"))
    if chromium() is None:
        print("headless_chromium: no chromium on PATH", file=sys.stderr)
        return 2
    if args.dom:
        print(dump_dom(args.page, (width, height), args.fragment))
    else:
        print(
            screenshot(args.page, args.png, (width, height), args.fragment, args.script, args.top)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
