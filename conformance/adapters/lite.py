"""The adapter for fsdp_lite: torch FSDP1's constructor, sharded parameters as DTensors.

fsdp_lite takes FSDP1's arguments under the same names, so wrapping is the shared FSDP1 recipe
(``Fsdp1ApiAdapter`` with ``api = "fsdp_lite"``); its parameters, gradients and optimizer state are
DTensors, so the base class's full-tensor helpers apply unchanged. Whatever fsdp_lite does not
build raises NotImplementedError when wrapping, which the runner reports unsupported. The
self-test (conformance/selftest.py) finds the package and loads planted copies of it through
``package_dir`` and ``load_from``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from conformance.adapters.base import Fsdp1ApiAdapter

__all__ = ["FsdpLiteAdapter", "load_from", "package_dir"]


class FsdpLiteAdapter(Fsdp1ApiAdapter):
    name = "fsdp_lite"
    description = "fsdp_lite.FullyShardedDataParallel (this repository)"
    api = "fsdp_lite"

    def features(self) -> list[str]:
        # CPUOffload(offload_params=True, offload_dir=...): params, grads and optimizer state in
        # files (docs/disk_offload.md). Its optimizer state never goes to disk without the params.
        return ["disk_offload"]


# ---- the self-test's copies of fsdp_lite (conformance/selftest.py) ---------------------------
# Here, beside the adapter, because this file is the one place conformance/ may name fsdp_lite.


def package_dir() -> Path:
    """The directory of the fsdp_lite package this process would import, without importing it."""
    spec = importlib.util.find_spec("fsdp_lite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("fsdp_lite is not importable here")
    return Path(next(iter(spec.submodule_search_locations)))


def load_from(root: str | os.PathLike) -> str:
    """Import fsdp_lite afresh from the copy under ``root`` (which holds ``fsdp_lite/``), in place
    of any fsdp_lite imported before; returns the file it came from.

    Every ``fsdp_lite`` module is dropped from ``sys.modules`` and ``root`` goes first on
    ``sys.path``, so the next import of any of them reads that copy; the adapter imports the
    package by name at each wrap, so its next case runs on it. Objects built from an earlier copy
    keep its code: only models wrapped after this call use the new one.
    """
    root = os.fspath(root)
    for name in [m for m in sys.modules if m == "fsdp_lite" or m.startswith("fsdp_lite.")]:
        del sys.modules[name]
    sys.path[:] = [root] + [p for p in sys.path if p != root and p not in _LOADED_ROOTS]
    _LOADED_ROOTS.add(root)
    importlib.invalidate_caches()
    module = importlib.import_module("fsdp_lite")
    where = os.path.realpath(module.__file__)
    if not where.startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(f"importing fsdp_lite from {root} gave {where}: another copy wins")
    return where


_LOADED_ROOTS: set[str] = set()  # roots load_from put on sys.path, replaced by the next one
