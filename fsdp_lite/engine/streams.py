"""Side streams on accelerators: prefetched all-gathers and gradient reductions off the compute stream.

On a device with streams (CUDA and the like) a root and its units share two side streams. A
prefetched unit's all-gather (its copy-in and the collective) runs on ``all_gather``; every
gradient reduction (zero fill, copy-in, pre-divide and the collective) runs on ``reduce``. The
copies then overlap the compute stream's kernels instead of queueing between them; the collectives
run on the backend's own stream either way. On CPU there are no streams: ``side_streams`` returns
None and every copy runs in program order, as before.

Note [Side-stream protocol]: each rule keeps memory and data safe across streams.
1. A side stream waits on the compute stream before its work is queued (``enter``): the shards the
   optimizer stepped, and the gradients autograd made, are ready before a copy-in reads them.
2. The compute stream waits on the collective (``work.wait()`` on NCCL makes the current stream
   wait on NCCL's), which waited on the side stream when issued: the copy-in comes first too.
3. An all-gather's output is allocated on ``all_gather`` and read by the copy-out on the compute
   stream. After the copy-out, ``all_gather`` waits on the compute stream, so later work on it,
   which may reuse that memory, is queued after the copy-out (torch FSDP2 does the same).
4. Autograd's gradients are allocated on the compute stream, read on ``reduce`` and then dropped;
   ``hand_over`` (``record_stream``) keeps the allocator from reusing them before ``reduce`` is
   done with them.
5. A reduction's output, allocated on ``reduce``, becomes the sharded gradient. The next use of
   ``reduce`` waits on the compute stream (rule 1), which by then has run whatever read it.
tests/test_streams.py checks these calls in order with recording streams on CPU; on a GPU,
scripts/gpu_checks.sh runs the same training against the results without side streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["SideStreams", "side_streams"]


class SideStreams:
    """The all-gather and reduce streams of one root's units on one accelerator."""

    def __init__(self, device_module, all_gather, reduce) -> None:
        self.device_module = device_module  # torch.cuda, or another accelerator's module
        self.all_gather = all_gather
        self.reduce = reduce

    def current(self):
        return self.device_module.current_stream()

    @contextlib.contextmanager
    def enter(self, stream) -> Iterator[None]:
        """Queue the block's work on ``stream``, after what the compute stream has queued."""
        stream.wait_stream(self.current())
        with self.device_module.stream(stream):
            yield

    def after_copy_out(self) -> None:
        """The all-gather stream waits for the copy-out just queued (Note rule 3)."""
        self.all_gather.wait_stream(self.current())

    def hand_over(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``, allocated on the compute stream, is used on ``stream`` (Note rule 4)."""
        tensor.record_stream(stream)


def side_streams(device: torch.device) -> SideStreams | None:
    """Two new side streams on ``device``, or None where it has no streams (CPU): everything then
    queues on the compute stream, in program order."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device)
    if not hasattr(module, "Stream") or not hasattr(module, "stream"):
        return None
    # High priority, as torch FSDP2's: a collective's copies should not wait behind compute.
    kwargs = {"priority": -1} if device.type == "cuda" else {}
    on_device = module.device(device) if hasattr(module, "device") else contextlib.nullcontext()
    with on_device:
        return SideStreams(module, module.Stream(**kwargs), module.Stream(**kwargs))
