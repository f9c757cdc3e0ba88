"""torch's ``FSDPModule`` as a base of fsdp_lite's, so that client code sees our modules as FSDP.

Accelerate, HF Trainer, Lightning Fabric, torchtitan and torch's pipelining decide what to do with a
model by ``isinstance(module, FSDPModule)`` with torch's class. fsdp_lite's ``FSDPModule``
(fsdp2.py) derives from torch's class for that check alone: it defines every method torch's class
defines, so none of torch's FSDP code runs on our modules (tests/test_interop.py checks both). This
is the one file in fsdp_lite that names torch's FSDP, and it imports only the class.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

__all__ = ["TorchFSDPModule"]
