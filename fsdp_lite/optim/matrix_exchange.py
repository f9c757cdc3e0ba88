"""WholeMatrix's traffic: buckets of matrices and their two ``all_to_all_single`` exchanges.

The gather: every rank packs its piece of each matrix, owner by owner, into one buffer; each
owner receives every rank's piece of the matrices it owns and unpacks them whole. The scatter:
each owner packs every rank's piece of each result, rank by rank; each rank unpacks its pieces.
gloo (CPU) and NCCL both take ``all_to_all_single`` with uneven splits: one path for every
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_lite.engine.observe import Collective, Observer
from fsdp_lite.optim.matrix_layout import Layout

__all__ = [
    "Bucket",
    "InFlight",
    "gathered_wholes",
    "issue_gather",
    "issue_scatter",
    "scattered_pieces",
    "split",
]


@dataclass
class InFlight:
    """One exchange issued: wait on ``work`` before reading ``received``."""

    op: Collective
    work: dist.Work
    send: torch.Tensor  # kept alive until the exchange is done
    received: torch.Tensor
    recv_splits: list[int]


@dataclass
class Bucket:
    """Matrices of one group and dtype exchanged together: one gather and one scatter."""

    group: dist.ProcessGroup
    dtype: torch.dtype
    out_dtype: torch.dtype
    members: list[int]  # indices into map's params
    layouts: list[Layout]  # of each member
    size: int = field(init=False)
    me: int = field(init=False)
    owned: list[int] = field(init=False)  # positions in members this rank owns
    by_owner: list[list[int]] = field(init=False)  # positions in members, per owner
    home: torch.device | None = None  # where the inputs are and the results go
    device: torch.device | None = None  # where the exchange runs (and the owners compute)
    gather: InFlight | None = None
    scatter: InFlight | None = None

    def __post_init__(self) -> None:
        self.size, self.me = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.owned = [k for k, lay in enumerate(self.layouts) if lay.owner == self.me]
        self.by_owner = [
            [k for k, lay in enumerate(self.layouts) if lay.owner == o] for o in range(self.size)
        ]


def split(numels: Sequence[int], indices: list[int], bucket_numel: int | None) -> list[list[int]]:
    """Consecutive buckets of at most ``bucket_numel`` whole-matrix elements (one matrix at
    least; ``numels[i]``: matrix i's); one bucket when ``bucket_numel`` is None."""
    if bucket_numel is None:
        return [indices]
    buckets: list[list[int]] = [[]]
    numel = 0
    for i in indices:
        if buckets[-1] and numel + numels[i] > bucket_numel:
            buckets.append([])
            numel = 0
        buckets[-1].append(i)
        numel += numels[i]
    return buckets


def issue_gather(
    bucket: Bucket, locals_: Sequence[torch.Tensor], observers: Sequence[Observer]
) -> None:
    """Issue the bucket's gather: this rank's rows of every matrix, owner by owner; each owner
    receives, source by source, that source's rows of the matrices it owns."""
    lays, size, me = bucket.layouts, bucket.size, bucket.me
    send = [locals_[bucket.members[k]].reshape(-1) for o in range(size) for k in bucket.by_owner[o]]
    send_splits = [sum(lays[k].piece_numel(me) for k in bucket.by_owner[o]) for o in range(size)]
    recv_splits = [sum(lays[k].piece_numel(s) for k in bucket.owned) for s in range(size)]
    bucket.home = locals_[bucket.members[0]].device
    bucket.device = _exchange_device(bucket.group, bucket.home)
    buffer = _cat(send, bucket.dtype, bucket.home).to(bucket.device)
    bucket.gather = _all_to_all("gather", bucket, buffer, send_splits, recv_splits, observers)


def gathered_wholes(bucket: Bucket, observers: Sequence[Observer]) -> dict[int, torch.Tensor]:
    """Wait for the bucket's gather; each owned matrix whole, by its position in the bucket."""
    received, splits = _wait(bucket.gather, observers)
    return _unpack(received, splits, bucket.owned, bucket.layouts, transposed=True)


def issue_scatter(
    bucket: Bucket, pieces: list[list[torch.Tensor]], observers: Sequence[Observer]
) -> None:
    """Issue the bucket's scatter: ``pieces[j][r]``, rank r's piece of the j-th owned result,
    rank by rank."""
    lays, size, me, owned = bucket.layouts, bucket.size, bucket.me, bucket.owned
    send = [pieces[j][r].reshape(-1) for r in range(size) for j in range(len(owned))]
    send_splits = [sum(lays[k].piece_numel(r) for k in owned) for r in range(size)]
    recv_splits = [sum(lays[k].piece_numel(me) for k in bucket.by_owner[o]) for o in range(size)]
    buffer = _cat(send, bucket.out_dtype, bucket.device)
    bucket.scatter = _all_to_all("scatter", bucket, buffer, send_splits, recv_splits, observers)


def scattered_pieces(bucket: Bucket, observers: Sequence[Observer]) -> list[torch.Tensor]:
    """Wait for the bucket's scatter; this rank's piece of each result, in bucket order."""
    received, splits = _wait(bucket.scatter, observers)
    mine = _unpack(
        received, splits, bucket.by_owner, bucket.layouts, transposed=False, me=bucket.me
    )
    return [mine[k].to(bucket.home) for k in range(len(bucket.layouts))]


def _all_to_all(phase, bucket, send, send_splits, recv_splits, observers) -> InFlight:
    received = send.new_empty(sum(recv_splits))
    op = Collective(
        "all_to_all", "<optimizer>", phase, -1, bucket.group, send.dtype, send.numel(), send.device
    )
    for observer in observers:
        observer.issued(op)
    work = dist.all_to_all_single(
        received, send, recv_splits, send_splits, group=bucket.group, async_op=True
    )
    return InFlight(op, work, send, received, recv_splits)


def _wait(flight: InFlight | None, observers: Sequence[Observer]) -> tuple[torch.Tensor, list[int]]:
    assert flight is not None
    flight.work.wait()
    for observer in observers:
        observer.waited(flight.op)
    return flight.received, flight.recv_splits


def _exchange_device(group: dist.ProcessGroup, home: torch.device) -> torch.device:
    """The device of the exchange's buffers: the inputs' own, but the current GPU where they
    are in CPU memory (CPU offload) and the group is NCCL's, which moves CUDA tensors only."""
    if home.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return home


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.empty(0, dtype=dtype, device=device)


def _unpack(received, splits, who, layouts, *, transposed: bool, me: int = 0) -> dict:
    """Cut a received buffer into its pieces.

    transposed (the gather, on an owner): the buffer is source by source, each source's rows of
    every owned matrix (``who``: the owned indices); returns each owned matrix whole.
    Otherwise (the scatter): the buffer is owner by owner, each owner's results for this rank
    (``who[o]``: the matrices of owner o); returns this rank's rows of each.
    """
    out, offset = {}, 0
    if transposed:
        for k in who:
            out[k] = received.new_empty(layouts[k].shape)
        for source in range(len(splits)):
            for k in who:
                numel = layouts[k].piece_numel(source)
                piece = received[offset : offset + numel].view(layouts[k].piece_shape(source))
                layouts[k].piece_of(out[k], source).copy_(piece)
                offset += numel
        return out
    for owner in range(len(splits)):
        for k in who[owner]:
            numel = layouts[k].piece_numel(me)
            out[k] = received[offset : offset + numel].view(layouts[k].piece_shape(me))
            offset += numel
    return out
