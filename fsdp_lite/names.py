"""Parameter and buffer names as the user's module tree has them, without wrapper prefixes.

A wrapper holds the wrapped module as ``_fsdp_wrapped_module`` (torch FSDP1's attribute, so raw keys
look the same), and torch's ``checkpoint_wrapper`` holds its module as ``_checkpoint_wrapped_module``.
Names shown to users (``named_parameters``, state dict keys, optimizer state keys, unit names) drop
both, as torch FSDP1's ``clean_tensor_name`` does. Nothing else lives here, so every file can import it.
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_PREFIX", "WRAPPED", "WRAPPED_PREFIX", "clean_name"]

WRAPPED = "_fsdp_wrapped_module"
WRAPPED_PREFIX = WRAPPED + "."
# torch.distributed.algorithms._checkpoint.checkpoint_wrapper's attribute (also offload_wrapper's).
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def clean_name(name: str) -> str:
    """``name`` without wrapper prefixes: ``blocks.0._fsdp_wrapped_module.fc.weight`` -> ``blocks.0.fc.weight``."""
    return name.replace(WRAPPED_PREFIX, "").replace(WRAPPED, "").replace(CHECKPOINT_PREFIX, "")
