"""Conformance suite: any FSDP implementation checked against DDP and a single process, stage by stage.

Run it with ``python -m conformance`` (see ``--help`` and docs/conformance.md). From Python, every
rank of an initialized process group calls ``run_cases(cases, adapters)``; an ``Adapter`` maps the
suite's cases onto one implementation's API (conformance/adapters/). ``fsdp_lite`` never imports
this package; this package imports native torch FSDP as a reference.
"""

from conformance.adapters import Adapter, Unsupported, WrapRequest, get_adapter, register
from conformance.matrix import Case, build_matrix, select
from conformance.runner import CaseResult, run_cases

__all__ = [
    "Adapter",
    "Case",
    "CaseResult",
    "Unsupported",
    "WrapRequest",
    "build_matrix",
    "get_adapter",
    "register",
    "run_cases",
    "select",
]
