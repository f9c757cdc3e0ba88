"""Adapters: one per FSDP implementation, found by name (``--impl NAME``).

Built-in names are ``fsdp_lite``, ``fsdp_lite_fsdp2``, ``torch_fsdp1``, ``torch_fsdp2`` and ``deepspeed``
(and its variants ``deepspeed_torch_linear``: ZeRO-3 without memory_efficient_linear, and
``deepspeed_config_optimizer``: the optimizer built by DeepSpeed from its config), and fsdp_lite's
canonical mode on each front, ``fsdp_lite_canonical`` and ``fsdp_lite_fsdp2_canonical`` (judged
across world sizes only: ``--world-sizes``). A third party either passes
``--impl package.module:ClassName`` (any importable ``Adapter`` subclass) or calls ``register`` on
its class before running. See docs/conformance.md, "Adding an adapter for your own FSDP".
"""

from __future__ import annotations

import importlib

from conformance.adapters.base import (
    Adapter,
    Unsupported,
    WrapRequest,
    clean_name,
    full_tensor,
)

__all__ = [
    "BUILTIN",
    "Adapter",
    "Unsupported",
    "WrapRequest",
    "clean_name",
    "full_tensor",
    "get_adapter",
    "register",
]

# Imported only when asked for, so that listing names needs no implementation installed.
BUILTIN = {
    "fsdp_lite": "conformance.adapters.lite:FsdpLiteAdapter",
    "torch_fsdp1": "conformance.adapters.fsdp1:TorchFSDP1Adapter",
    "torch_fsdp2": "conformance.adapters.fsdp2:TorchFSDP2Adapter",
    "fsdp_lite_fsdp2": "conformance.adapters.fsdp2:FsdpLiteFSDP2Adapter",
    # fsdp_lite.Canonical on each front: judged only across world sizes (--world-sizes)
    "fsdp_lite_canonical": "conformance.adapters.lite:FsdpLiteCanonicalAdapter",
    "fsdp_lite_fsdp2_canonical": "conformance.adapters.lite:FsdpLiteFSDP2CanonicalAdapter",
    "deepspeed": "conformance.adapters.deepspeed:DeepSpeedAdapter",
    "deepspeed_torch_linear": "conformance.adapters.deepspeed:DeepSpeedTorchLinearAdapter",
    "deepspeed_config_optimizer": "conformance.adapters.deepspeed:DeepSpeedConfigOptimizerAdapter",
}
_REGISTERED: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    """Make ``--impl cls.name`` find ``cls`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise TypeError(f"register() takes an Adapter subclass, got {cls!r}")
    _REGISTERED[cls.name] = cls
    return cls


def get_adapter(spec: str) -> Adapter:
    """An adapter instance by registered or built-in name, or by ``module.path:ClassName``."""
    if spec in _REGISTERED:
        return _REGISTERED[spec]()
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        known = sorted(set(BUILTIN) | set(_REGISTERED))
        raise ValueError(
            f"unknown implementation {spec!r}: use one of {known} or module.path:ClassName"
        )
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise TypeError(f"{target} is not an Adapter subclass")
    if spec not in BUILTIN and cls.name == Adapter.name:
        # A third-party class without a name of its own is reported under the spec it came by.
        cls = type(class_name, (cls,), {"name": spec})
    return cls()
