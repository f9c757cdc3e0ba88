"""Optimizers and optimizer helpers that know parameters are sharded.

``Muon`` (muon.py) orthogonalizes whole matrices of sharded parameters through ``WholeMatrix``
(whole_matrix.py), which gathers each matrix on one owner rank and hands the update back;
``ShardedGradScaler`` (grad_scaler.py) skips an fp16 step on every rank together. The engine
knows none of them (tests/test_import_graph.py).
"""

from fsdp_lite.optim.grad_scaler import ShardedGradScaler
from fsdp_lite.optim.muon import Muon
from fsdp_lite.optim.whole_matrix import WholeMatrix

__all__ = ["Muon", "ShardedGradScaler", "WholeMatrix"]
