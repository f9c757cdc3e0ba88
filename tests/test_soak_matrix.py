"""scripts/soak_matrix.py: a run that dies natively is recorded with glibc's message and kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.soak_matrix import native_messages

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "soak_matrix.py"

# A --model factory whose forward, on rank 1, hands glibc's free() a pointer it never returned:
# glibc prints "free(): invalid pointer" and aborts, as in the crash the soak hunts.
CRASHING_MODEL = """
import ctypes

import torch
import torch.distributed as dist
from torch import nn


class FreesABadPointer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            # One byte into a zeroed block of glibc's own: the chunk header free() reads there
            # says size 0, which glibc rejects every time (a ctypes buffer's header bytes vary:
            # they sometimes sent glibc down another path to a segfault).
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            block = libc.malloc(64)
            ctypes.memset(block, 0, 64)
            libc.free(ctypes.c_void_p(block + 1))
        return self.lin(x)


def frees_a_bad_pointer():
    def batch(g):
        return torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)

    return FreesABadPointer(), [], batch
"""


def _soak(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", "out", "--runs", "1", "--no-cores", "--", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_native_messages_are_found_once_each_and_case_output_is_not():
    text = (
        "fsdp_lite/FULL_SHARD/fp32/plain/lm/ws2 passed bitwise\n"
        "a corrupted checkpoint is refused (case output, not glibc)\n"
        "free(): invalid pointer\n"
        "Fatal Python error: Aborted\n"
        "  traceback : Signal 6 (SIGABRT) received by PID 12\n"
        "  traceback : Signal 6 (SIGABRT) received by PID 13\n"
        "corrupted double-linked list\n"
    )
    assert native_messages(text) == [
        "free(): invalid pointer",
        "Fatal Python error: Aborted",
        "Signal 6 (SIGABRT)",
        "corrupted double-linked list",
    ]


@pytest.mark.slow
def test_a_run_killed_by_a_heap_error_is_recorded_and_kept(tmp_path):
    (tmp_path / "crashing_models.py").write_text(CRASHING_MODEL)
    proc = _soak(
        tmp_path,
        "--model",
        "crashing_models:frees_a_bad_pointer",
        "--quick",
        "--only",
        "*/FULL_SHARD/fp32/plain/*",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    header, line = (tmp_path / "out" / "soak.tsv").read_text().splitlines()
    run, code, _seconds, summary, messages = line.split("\t")
    # The suite survives the dead rank: it reports the case as crashed and exits 4.
    assert (run, code, summary) == (
        "1",
        "4",
        "1 cases: 0 passed, 0 failed, 0 unsupported, 1 crashed",
    )
    assert messages.split(" | ")[0] == "free(): invalid pointer", messages
    assert "Signal 6 (SIGABRT)" in messages.split(" | ")
    log = tmp_path / "out" / "run_1" / "conformance.log"
    assert "free(): invalid pointer" in log.read_text()
    assert not list((tmp_path / "out" / "run_1").glob("core*"))  # --no-cores


@pytest.mark.slow
def test_a_clean_run_leaves_only_its_line(tmp_path):
    proc = _soak(
        tmp_path, "--impl", "fsdp_lite", "--only", "fsdp_lite/FULL_SHARD/fp32/plain/lm_untied/ws2"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (tmp_path / "out" / "soak.tsv").read_text().splitlines()
    run, code, _seconds, summary, messages = lines[1].split("\t")
    assert (run, code, summary, messages) == (
        "1",
        "0",
        "1 cases: 1 passed, 0 failed, 0 unsupported",
        "-",
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["soak.tsv"]
