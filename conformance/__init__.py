"""Conformance suite: any FSDP implementation checked against DDP and a single process, stage by stage.

Run it with ``python -m conformance`` (see ``--help`` and docs/conformance.md), or as pytest tests
with ``pytest -p conformance.pytest_plugin --conformance-impl NAME``. From Python, every rank of an
initialized process group calls ``run_cases(cases, adapters)``; an ``Adapter`` maps the suite's
cases onto one implementation's API (conformance/adapters/). ``fsdp_lite`` never imports this
package; this package imports native torch FSDP as a reference.

The names below are imported when first used, so that loading the pytest plugin (which pytest
does in every session where this package is installed) does not import torch.
"""

import importlib

__all__ = [
    "Adapter",
    "Case",
    "CaseResult",
    "ModelRecipe",
    "Unsupported",
    "WrapRequest",
    "build_matrix",
    "get_adapter",
    "register",
    "run_cases",
    "select",
]

_WHERE = {
    "Adapter": "conformance.adapters",
    "Unsupported": "conformance.adapters",
    "WrapRequest": "conformance.adapters",
    "get_adapter": "conformance.adapters",
    "register": "conformance.adapters",
    "Case": "conformance.matrix",
    "build_matrix": "conformance.matrix",
    "select": "conformance.matrix",
    "CaseResult": "conformance.runner",
    "run_cases": "conformance.runner",
    "ModelRecipe": "conformance.zoo",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
