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
from conformance.adapters.fsdp2 import FsdpLiteFSDP2Adapter

__all__ = [
    "FsdpLiteAdapter",
    "FsdpLiteCanonicalAdapter",
    "FsdpLiteFSDP2CanonicalAdapter",
    "load_from",
    "package_dir",
]


class FsdpLiteAdapter(Fsdp1ApiAdapter):
    name = "fsdp_lite"
    description = "fsdp_lite.FullyShardedDataParallel (this repository)"
    api = "fsdp_lite"

    def muon(self) -> type:
        return importlib.import_module(self.api).Muon  # exact on shards (docs/muon.md)

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


# ---- the canonical mode (fsdp_lite.Canonical, docs/invariance.md) ----------------------------


class _CanonicalMixin:
    """fsdp_lite's canonical mode on top of a front's adapter: wrap as the front does, then
    ``fsdp_lite.Canonical(model, virtual_batches=V)``. It claims the same bits at every world
    size, so a ``--world-sizes`` run fails it on any difference; the ordinary matrix (one world
    size, each rank its own batch, backwards under no_sync) is not its contract and reports it
    unsupported."""

    world_size_invariant = True

    def features(self) -> list[str]:
        return []

    def unsupported_reason(self, case):
        if self.virtual_batches is None:
            return (
                "the canonical mode is judged across world sizes: python -m conformance "
                "--world-sizes 1,2,4 (docs/conformance.md)"
            )
        if self.virtual_batches % case.world_size:
            return (
                f"virtual_batches ({self.virtual_batches}) is not a multiple of the world size "
                f"({case.world_size})"
            )
        return super().unsupported_reason(case)

    def wrap(self, model, request):
        import fsdp_lite

        wrapped = super().wrap(model, request)
        canon = fsdp_lite.Canonical(wrapped, virtual_batches=self.virtual_batches)
        wrapped.__dict__["_conformance_canonical"] = canon  # per model: per case
        return wrapped

    def make_optimizer(self, model, make):
        optim = super().make_optimizer(model, make)
        self.canonical(model).check_optimizer(optim)
        return optim

    def canonical(self, model):
        return model.__dict__.get("_conformance_canonical")


class FsdpLiteCanonicalAdapter(_CanonicalMixin, FsdpLiteAdapter):
    name = "fsdp_lite_canonical"
    description = (
        "fsdp_lite.FullyShardedDataParallel + fsdp_lite.Canonical (the same bits at any N)"
    )


class FsdpLiteFSDP2CanonicalAdapter(_CanonicalMixin, FsdpLiteFSDP2Adapter):
    name = "fsdp_lite_fsdp2_canonical"
    description = "fsdp_lite.fully_shard + fsdp_lite.Canonical (the same bits at any N)"
