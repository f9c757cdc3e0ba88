"""What the repository cites is in the repository: every ``docs/<page>.md`` named in code, tests,
scripts and docs exists, and nothing cites the design notes that live outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Notes kept beside the repository, not in it: a reader of the repository cannot open them.
OUTSIDE = re.compile(r"\b(CLIENTS|FACTS|DESIGN|STYLE)(\.md)?\b|\.\./shared")
DOCS_PAGE = re.compile(r"\bdocs/[A-Za-z0-9_/-]+\.md\b")


def _text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [ROOT / f for f in listed if f.endswith((".py", ".md", ".sh", ".toml", ".ini", ".txt"))]


def test_nothing_cites_notes_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _text_files()
        if path.exists()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line) and "test_citations.py" not in path.name
    ]
    assert not found, "citations of files outside the repository:\n" + "\n".join(found)


def test_every_docs_page_cited_exists():
    missing = sorted(
        f"{path.relative_to(ROOT)} cites {page}"
        for path in _text_files()
        if path.exists()
        for page in set(DOCS_PAGE.findall(path.read_text(errors="replace")))
        if not (ROOT / page).exists()
    )
    assert not missing, "docs pages cited but not in the repository:\n" + "\n".join(missing)
