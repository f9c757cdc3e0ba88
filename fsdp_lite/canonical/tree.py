"""A plain module's gradients (no fsdp_lite unit, one process) summed in the canonical tree.

Units reduce in the tree themselves (engine/unit.py); a plain module has no reduction, so a hook
takes each backward's gradient off its parameter and, at the end of the backward, every
parameter's leaf (zeros where this micro-batch left none) climbs its ``TreeSum``; after the step's
last micro-batch the root, / V, becomes the gradient.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.autograd import Variable

from fsdp_lite.engine import canonical

__all__ = ["PlainTrees"]


class PlainTrees:
    """One ``TreeSum`` of ``virtual_batches`` leaves per trainable parameter of ``module``."""

    def __init__(self, module: nn.Module, virtual_batches: int) -> None:
        self.virtual_batches = virtual_batches
        self._trees: dict[nn.Parameter, canonical.TreeSum] = {}
        self._landed: dict[nn.Parameter, weakref.ref] = {}
        self._leaves: dict[nn.Parameter, torch.Tensor] = {}  # this backward's gradients
        self._used: dict[nn.Parameter, bool] = {}  # a leaf of this step had a gradient
        self._end_queued = False
        for p in module.parameters():
            if p.requires_grad:
                self._trees[p] = canonical.TreeSum(virtual_batches)
                p.register_post_accumulate_grad_hook(self._climb)

    def _climb(self, p: nn.Parameter) -> None:
        """Take this backward's gradient off the parameter; queue the end of the backward."""
        landed = self._landed.get(p)
        if landed is not None and landed() is p.grad:
            raise RuntimeError(
                "Canonical: a gradient from the last step is still there; call "
                "optimizer.zero_grad() (set_to_none, its default) between steps"
            )
        self._leaves[p], p.grad = p.grad, None
        if not self._end_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    def _end_of_backward(self) -> None:
        """Push every parameter's leaf; a finished tree's root, / V, becomes the gradient of a
        parameter some leaf used (the others keep None)."""
        self._end_queued = False
        leaves, self._leaves = self._leaves, {}
        for p, tree in self._trees.items():
            leaf = leaves.get(p)
            self._used[p] = self._used.get(p, False) or leaf is not None
            total = tree.push(leaf if leaf is not None else torch.zeros_like(p))
            if total is not None and self._used.pop(p):
                p.grad = total.div_(self.virtual_batches)
                self._landed[p] = weakref.ref(p.grad)
