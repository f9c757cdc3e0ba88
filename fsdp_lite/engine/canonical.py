"""Sums in one fixed binary tree, whatever the world size (docs/invariance.md).

Floating-point addition is commutative but not associative: a sum's bits depend on its tree, not
on who adds. A data-parallel gradient is a sum over micro-batches; if every world size sums them in
the same tree, every world size gets the same bits. The tree here: V leaves (the virtual
micro-batches of a global batch, V a power of two), adjacent leaves pair first, then adjacent
pairs, and so on. Rank r of N takes leaves r, r + N, r + 2N, ...: at micro-step k the N ranks hold
the aligned block of leaves [kN, (k+1)N), whose subtree the reduction sums (``tree_sum`` over the
N ranks' rows, in rank order), and each rank adds the V/N block sums of a step as the upper
levels of the same tree (``TreeSum``). One process (N = 1) walks the same tree leaf by leaf.

Norms use the same idea over elements: a parameter's n elements are the leaves of a fixed tree
(``tree_pieces`` / ``combine_pieces``), so where the shard boundaries fall does not matter.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

__all__ = ["TreeSum", "combine_pieces", "fp32", "is_power_of_two", "tree_pieces", "tree_sum"]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def tree_sum(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``leaves`` (a power of two of them) in the binary tree whose adjacent leaves
    pair first: ((l0 + l1) + (l2 + l3)) + ... A new tensor unless there is one leaf."""
    if not is_power_of_two(len(leaves)):
        raise ValueError(f"tree_sum takes a power of two of leaves, got {len(leaves)}")
    level = list(leaves)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


class TreeSum:
    """The tree sum of ``leaves`` tensors (a power of two) pushed one at a time, in order.

    A binary counter: a pushed node merges with the node on top of the stack while both are
    the same height, so at most log2(leaves) + 1 partial sums are alive, and the result is
    ``tree_sum`` of the pushed tensors, bit for bit.
    """

    def __init__(self, leaves: int) -> None:
        if not is_power_of_two(leaves):
            raise ValueError(f"TreeSum takes a power of two of leaves, got {leaves}")
        self.leaves = leaves
        self._stack: list[tuple[int, torch.Tensor]] = []  # (height, partial sum)
        self.pushed = 0

    def push(self, leaf: torch.Tensor) -> torch.Tensor | None:
        """Add ``leaf``; the whole sum once the last leaf is in (and start over), else None."""
        height, node = 0, leaf
        while self._stack and self._stack[-1][0] == height:
            _, left = self._stack.pop()
            height, node = height + 1, left.add_(node)  # left is ours: a sum, or a leaf we own
        self._stack.append((height, node))
        self.pushed += 1
        if self.pushed < self.leaves:
            return None
        ((_, total),) = self._stack
        self._stack, self.pushed = [], 0
        return total

    def clear(self) -> None:
        """Drop the partial sums (a step that raised)."""
        self._stack, self.pushed = [], 0


# ---- the element tree of a norm -------------------------------------------------------------------
#
# A parameter's n elements (flattened, row-major) are the leaves 0..n-1 of a binary tree padded
# with zeros to a power of two. Node (level, i) sums leaves [i 2^level, (i+1) 2^level). A rank
# holding the contiguous leaves [start, start + len(x)) computes every node wholly inside its range
# with vectorized adds (``tree_pieces``) and hands on the highest ones, the "pieces", which tile
# its range. The pieces of all ranks tile [0, n); ``combine_pieces`` builds the root from them. One
# process holding all of [0, n) computes the root itself: the same adds in the same tree.


def fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (Python floats are float64)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def tree_pieces(x: torch.Tensor, start: int, n: int) -> list[tuple[int, int, float]]:
    """The (level, index, value) pieces of the element tree over leaves [start, start + x.numel())
    of ``n``, computed from this rank's leaves ``x`` (1D, float32)."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError("tree_pieces takes a 1D float32 tensor")
    height = max(n - 1, 0).bit_length()  # the root's level: 2**height >= n leaves
    lo, hi = start, start + x.numel()  # node indices [lo, hi) at this level, values ``vals``
    vals = x
    pieces: list[tuple[int, int, float]] = []
    for level in range(height + 1):
        if lo >= hi:
            break
        if level == height:  # only the root is left
            pieces.append((level, lo, vals[0].item()))
            break
        if lo % 2:  # its sibling is another rank's: hand it on
            pieces.append((level, lo, vals[0].item()))
            vals, lo = vals[1:], lo + 1
        if hi % 2 and hi > lo:
            if hi << level >= n:  # the sibling lies in the zero padding: x + 0 == x
                vals, hi = torch.cat([vals, vals.new_zeros(1)]), hi + 1
            else:  # another rank's
                pieces.append((level, hi - 1, vals[-1].item()))
                vals, hi = vals[:-1], hi - 1
        vals, lo, hi = vals[0::2] + vals[1::2], lo // 2, hi // 2
    return pieces


def combine_pieces(pieces: Sequence[tuple[int, int, float]], n: int) -> float:
    """The root of the element tree of ``n`` leaves from pieces that tile [0, n), in float32."""
    if n == 0:
        return 0.0
    known = {(level, index): value for level, index, value in pieces}
    height = max(n - 1, 0).bit_length()

    def node(level: int, index: int) -> float:
        if (level, index) in known:
            return known[level, index]
        if index << level >= n:  # zero padding
            return 0.0
        if level == 0:
            raise ValueError(f"element {index} of {n} is in no piece")
        return fp32(node(level - 1, 2 * index) + node(level - 1, 2 * index + 1))

    return node(height, 0)
