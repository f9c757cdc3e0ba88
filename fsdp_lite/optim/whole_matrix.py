"""Whole-matrix functions of sharded parameters: one owner rank per matrix, batched traffic.

An optimizer such as Muon (Newton-Schulz) or a Shampoo-like preconditioner needs each weight
matrix whole, while FSDP leaves every rank 1/N of its rows. ``WholeMatrix`` chooses, once, one
owner rank per sharded matrix, and then maps a function over whole matrices:

    every rank      packs its piece of each matrix, owner by owner, into one buffer
    all_to_all #1   each owner receives every rank's piece of the matrices it owns
    owner           copies them into the whole matrix and runs fn(param, whole) on it
    all_to_all #2   each rank receives its piece of every result
    every rank      unpacks them: the result, cut as its shard is

Two ``all_to_all_single`` per bucket (the matrices of one process group and one dtype, cut into
``bucket_numel`` pieces if asked) per call, whatever the number of matrices. Every bucket's
gather is issued first, and each bucket's scatter as soon as its owners are done, so one
bucket's traffic runs while the owners compute another's (asynchronous collectives: gloo's
threads, NCCL's stream). gloo (CPU) and NCCL both take ``all_to_all_single`` with uneven
splits, so there is one path for every device.

Owners: the matrices of one process group, largest cost first (ties in parameter order), each to
the least loaded rank so far (ties to the lowest rank); cost defaults to Newton-Schulz's,
``m * n * min(m, n)``. Every rank computes the same placement from the shapes alone.

A parameter that is not a DTensor, or is replicated on every mesh dim (NO_SHARD), is whole on
every rank: fn runs there, no traffic. HSDP's replicas each run their own exchange within
their shard group (the mesh dim with ``Shard``), each owner computing for its replica. A matrix
cut by tensor parallel too (FSDP's ``Shard`` or ``_StridedShard`` on the dp dim, TP's ``Shard``
on the tp dim) has one shard group over both dims (torch's ``DeviceMesh._flatten``): each rank's
piece is one block of the matrix (``Layout.boxes``, from DTensor's own layout rule), the owner
copies every block into place, and the exchange is the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_lite.engine.observe import Collective, Observer
from fsdp_lite.engine.offload import with_local

__all__ = ["WholeMatrix", "newton_schulz_cost"]

WholeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def newton_schulz_cost(shape: torch.Size) -> int:
    """Newton-Schulz's flops up to a constant, ``m * n * min(m, n)``: the default cost."""
    m, n = shape[0], shape[1]
    return m * n * min(m, n)


@dataclass
class _InFlight:
    """One exchange issued: wait on ``work`` before reading ``received``."""

    op: Collective
    work: dist.Work
    send: torch.Tensor  # kept alive until the exchange is done
    received: torch.Tensor
    recv_splits: list[int]


@dataclass
class _Bucket:
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
    gather: _InFlight | None = None
    scatter: _InFlight | None = None

    def __post_init__(self) -> None:
        self.size, self.me = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.owned = [k for k, lay in enumerate(self.layouts) if lay.owner == self.me]
        self.by_owner = [
            [k for k, lay in enumerate(self.layouts) if lay.owner == o] for o in range(self.size)
        ]


@dataclass(frozen=True)
class Layout:
    """How one sharded matrix lies across its shard group, and which rank of it owns it."""

    group: dist.ProcessGroup  # the shard group: the mesh dims that cut the matrix, flattened
    rank: int  # this rank in ``group``
    boxes: tuple[tuple[tuple[int, int], ...], ...]  # per group rank: [start, stop) of each dim
    shape: torch.Size  # the whole matrix
    owner: int  # the owner's rank in ``group``

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.boxes[rank])

    def piece_numel(self, rank: int) -> int:
        return math.prod(self.piece_shape(rank))

    def piece_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of a whole matrix (a view)."""
        return whole[tuple(slice(start, stop) for start, stop in self.boxes[rank])]

    def cut(self) -> str:
        """The pieces, for ``explain``: ``dim 0 cut 4/3`` where one dim is cut in rank order,
        else each rank's block (``blocks 0:4,0:12 8:12,0:12 ...``)."""
        shapes = [self.piece_shape(r) for r in range(len(self.boxes))]
        dims = [d for d in range(len(self.shape)) if any(s[d] != self.shape[d] for s in shapes)]
        starts = [box[dims[0]][0] for box in self.boxes] if len(dims) == 1 else []
        if starts and starts == sorted(starts):
            return f"dim {dims[0]} cut " + "/".join(str(s[dims[0]]) for s in shapes)
        return "blocks " + " ".join(
            ",".join(f"{start}:{stop}" for start, stop in box) for box in self.boxes
        )


class WholeMatrix:
    """Owner placement for ``params`` (chosen here, once), and ``map``: a function of each whole
    matrix, run on its owner, its result handed back cut as the parameter is.

    Args:
        params: the parameters (DTensor shards, or plain tensors held whole).
        cost: a parameter's shape -> its cost, balanced across ranks. Default
            ``newton_schulz_cost``.
        name: how messages name the caller. Default ``"fsdp_lite.WholeMatrix"``.
        bucket_numel: at most this many whole-matrix elements per bucket (consecutive matrices;
            a larger one alone), so that one bucket's traffic runs while the owners compute
            another's. Default None: one bucket per process group and dtype.

    Example, a function of whole matrices that is not Muon::

        whole = fsdp_lite.WholeMatrix(model.parameters())
        grads = [p.grad for p in model.parameters()]
        updates = whole.map(lambda p, g: inverse_root(g), model.parameters(), grads)
        # updates[i]: a DTensor laid out as params[i], each rank's rows of inverse_root(whole grad)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        cost: Callable[[torch.Size], int] = newton_schulz_cost,
        name: str = "fsdp_lite.WholeMatrix",
        bucket_numel: int | None = None,
    ) -> None:
        self.name = name
        self.bucket_numel = bucket_numel
        self.observers: list[Observer] = []
        pending: dict[dist.ProcessGroup, list[tuple[torch.Tensor, dict]]] = {}
        for param in params:
            spec = self._spec(param)
            if spec is not None:
                pending.setdefault(spec["group"], []).append((param, spec))
        self.layouts: dict[torch.Tensor, Layout] = {}
        self.costs: dict[torch.Tensor, int] = {}
        for group, members in pending.items():
            costs = [cost(p.shape) for p, _ in members]
            owners = _balance(costs, dist.get_world_size(group))
            for (param, spec), owner, c in zip(members, owners, costs):
                self.layouts[param] = Layout(**spec, shape=param.shape, owner=owner)
                self.costs[param] = c

    def owner(self, param: torch.Tensor) -> int | None:
        """The rank (in its shard group) that computes ``param``'s matrix; None: every rank."""
        layout = self.layouts.get(param)
        return None if layout is None else layout.owner

    def explain(self, names: dict[torch.Tensor, str] | None = None) -> str:
        """The owner placement as a table: each sharded matrix's shape, cut, owner and cost, then
        each rank's load (``names``: parameter -> name, e.g. from ``named_parameters()``)."""
        names = names or {}
        lines, loads = [], {}
        for i, (param, lay) in enumerate(self.layouts.items()):
            cost = self.costs[param]
            ranks = dist.get_process_group_ranks(lay.group)
            loads.setdefault(tuple(ranks), [0] * len(ranks))[lay.owner] += cost
            shape = "x".join(map(str, lay.shape))
            lines.append(
                f"  {names.get(param, f'#{i}'):<28} {shape:>10}  {lay.cut():<22} "
                f"owner {lay.owner}  cost {cost}"
            )
        for ranks, load in loads.items():
            lines.append(f"  load of group {list(ranks)}: {load}")
        return "\n".join([f"{self.name}: {len(self.layouts)} sharded matrices", *lines])

    def watch(self, observer: Observer) -> None:
        """Tell ``observer`` of each exchange (kind ``all_to_all``, phase ``gather``/``scatter``)."""
        self.observers.append(observer)

    def unwatch(self, observer: Observer) -> None:
        self.observers.remove(observer)

    def map(
        self,
        fn: WholeFn,
        params: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """``fn(param, whole input)`` for each of ``params``, on its owner; each rank gets its rows.

        Args:
            fn: the whole input matrix (its owner's own tensor, free to change in place) ->
                a result of the same shape. Runs on the owner only (on every rank for a
                parameter held whole), so state it keeps lives on the owner.
            params: parameters given at construction, in the same order on every rank.
            inputs: one tensor per parameter, laid out as it (a DTensor with its placements, or
                its local shard, or the whole tensor for a parameter held whole).
            out_dtype: the results' dtype (the owner casts to it); default each input's dtype.

        Returns:
            One result per parameter: its rows of ``fn``'s result, a DTensor where the
            parameter is one (a plain tensor otherwise).
        """
        params = list(params)
        results: list[torch.Tensor | None] = [None] * len(params)
        by_key: dict[tuple, list[int]] = {}
        locals_ = []
        for i, (param, value) in enumerate(zip(params, inputs)):
            local = value.to_local() if isinstance(value, DTensor) else value
            locals_.append(local)
            layout = self.layouts.get(param)
            if layout is None:
                if self._spec(param) is not None:
                    raise ValueError(
                        f"{self.name}.map: a sharded parameter not among those it was built "
                        "with (owners are placed at construction)"
                    )
                results[i] = self._wrap(param, fn(param, local).to(out_dtype or local.dtype))
                continue
            if local.shape != layout.piece_shape(layout.rank):
                raise ValueError(
                    f"{self.name}.map: an input of local shape {tuple(local.shape)} for a "
                    f"parameter whose shard here is {layout.piece_shape(layout.rank)}; inputs "
                    "are laid out as their parameters"
                )
            by_key.setdefault((layout.group, local.dtype), []).append(i)
        buckets = [
            _Bucket(
                group,
                dtype,
                out_dtype or dtype,
                members,
                [self.layouts[params[i]] for i in members],
            )
            for (group, dtype), indices in by_key.items()
            for members in self._split(params, indices)
        ]
        # Every gather first, then per bucket: wait for its gather, the owners' math, its scatter
        # issued; so a bucket's traffic runs while the owners compute another's.
        for bucket in buckets:
            self._gather(bucket, locals_)
        for bucket in buckets:
            self._compute_and_scatter(bucket, fn, params)
        for bucket in buckets:
            for i, local in zip(bucket.members, self._unpack_scatter(bucket)):
                results[i] = self._wrap(params[i], local)
        return results  # type: ignore[return-value]

    # ---- the exchange ---------------------------------------------------------------------------

    def _split(self, params: list[torch.Tensor], indices: list[int]) -> list[list[int]]:
        """Consecutive buckets of at most ``bucket_numel`` whole-matrix elements (one matrix at
        least); one bucket when ``bucket_numel`` is None."""
        if self.bucket_numel is None:
            return [indices]
        buckets: list[list[int]] = [[]]
        numel = 0
        for i in indices:
            if buckets[-1] and numel + params[i].numel() > self.bucket_numel:
                buckets.append([])
                numel = 0
            buckets[-1].append(i)
            numel += params[i].numel()
        return buckets

    def _gather(self, bucket: _Bucket, locals_: list[torch.Tensor]) -> None:
        """Issue the bucket's gather: this rank's rows of every matrix, owner by owner; each owner
        receives, source by source, that source's rows of the matrices it owns."""
        lays, size, me = bucket.layouts, bucket.size, bucket.me
        send = [
            locals_[bucket.members[k]].reshape(-1) for o in range(size) for k in bucket.by_owner[o]
        ]
        send_splits = [
            sum(lays[k].piece_numel(me) for k in bucket.by_owner[o]) for o in range(size)
        ]
        recv_splits = [sum(lays[k].piece_numel(s) for k in bucket.owned) for s in range(size)]
        bucket.home = locals_[bucket.members[0]].device
        bucket.device = _exchange_device(bucket.group, bucket.home)
        buffer = _cat(send, bucket.dtype, bucket.home).to(bucket.device)
        bucket.gather = self._all_to_all("gather", bucket, buffer, send_splits, recv_splits)

    def _compute_and_scatter(self, bucket: _Bucket, fn: WholeFn, params: list) -> None:
        """Wait for the bucket's gather, run fn on each owned matrix, issue the scatter: each
        rank's rows of each result, rank by rank."""
        received, splits = self._wait(bucket.gather)
        wholes = _unpack(received, splits, bucket.owned, bucket.layouts, transposed=True)
        pieces = []
        for k in bucket.owned:
            lay = bucket.layouts[k]
            result = fn(params[bucket.members[k]], wholes[k]).to(bucket.out_dtype)
            if result.shape != lay.shape:  # on the owner: the others wait in the scatter
                raise ValueError(
                    f"{self.name}: fn returned shape {tuple(result.shape)} for a "
                    f"{tuple(lay.shape)} matrix"
                )
            pieces.append([lay.piece_of(result, r) for r in range(bucket.size)])
        lays, size, me, owned = bucket.layouts, bucket.size, bucket.me, bucket.owned
        send = [pieces[j][r].reshape(-1) for r in range(size) for j in range(len(owned))]
        send_splits = [sum(lays[k].piece_numel(r) for k in owned) for r in range(size)]
        recv_splits = [
            sum(lays[k].piece_numel(me) for k in bucket.by_owner[o]) for o in range(size)
        ]
        bucket.scatter = self._all_to_all(
            "scatter", bucket, _cat(send, bucket.out_dtype, bucket.device), send_splits, recv_splits
        )

    def _unpack_scatter(self, bucket: _Bucket) -> list[torch.Tensor]:
        received, splits = self._wait(bucket.scatter)
        mine = _unpack(
            received, splits, bucket.by_owner, bucket.layouts, transposed=False, me=bucket.me
        )
        return [mine[k].to(bucket.home) for k in range(len(bucket.layouts))]

    def _all_to_all(self, phase, bucket, send, send_splits, recv_splits) -> _InFlight:
        received = send.new_empty(sum(recv_splits))
        op = Collective(
            "all_to_all",
            "<optimizer>",
            phase,
            -1,
            bucket.group,
            send.dtype,
            send.numel(),
            send.device,
        )
        for observer in self.observers:
            observer.issued(op)
        work = dist.all_to_all_single(
            received, send, recv_splits, send_splits, group=bucket.group, async_op=True
        )
        return _InFlight(op, work, send, received, recv_splits)

    def _wait(self, flight: _InFlight | None) -> tuple[torch.Tensor, list[int]]:
        assert flight is not None
        flight.work.wait()
        for observer in self.observers:
            observer.waited(flight.op)
        return flight.received, flight.recv_splits

    # ---- layouts --------------------------------------------------------------------------------

    def _spec(self, param: torch.Tensor) -> dict | None:
        """The shard group (the mesh dims that cut ``param``, flattened), this rank in it and
        every group rank's piece of the matrix; None where it is held whole."""
        if not isinstance(param, DTensor):
            return None
        placements, mesh = param.placements, param.device_mesh
        if any(type(pl) not in (Shard, Replicate, _StridedShard) for pl in placements):
            raise NotImplementedError(
                f"{self.name} on a parameter with placements {placements}: only Shard, "
                "Replicate and FSDP's strided shard over tensor parallel's cut are built (not "
                "a partial one)"
            )
        cut = [d for d, pl in enumerate(placements) if type(pl) is not Replicate]
        cut = [d for d in cut if mesh.size(d) > 1]
        if not cut:
            return None
        if param.ndim != 2:
            raise ValueError(
                f"{self.name}: a sharded parameter of shape {tuple(param.shape)}; only matrices "
                "(2-D) are built"
            )
        for d in cut:
            pl = placements[d]
            # FSDP over TP's cut of the same tensor dim: each rank's piece is one box of the
            # matrix. Another strided layout interleaves rows, which the boxes cannot say.
            if type(pl) is _StridedShard and pl.split_factor != math.prod(
                mesh.size(j)
                for j in range(d + 1, mesh.ndim)
                if type(placements[j]) is Shard and placements[j].dim == pl.dim
            ):
                raise NotImplementedError(
                    f"{self.name} on a parameter with placements {placements}: a strided shard "
                    "other than FSDP's over tensor parallel's cut of the same dim is not built"
                )
        if len(cut) == 1:
            group, rank = mesh.get_group(cut[0]), mesh.get_local_rank(cut[0])
        else:  # FSDP's and tensor parallel's dims: one group over both
            flat = _flatten(mesh, cut, self.name, placements)
            group, rank = flat.get_group(), flat.get_local_rank()
        boxes = []
        for global_rank in dist.get_process_group_ranks(group):
            coordinate = (mesh.mesh == global_rank).nonzero()[0].tolist()
            shape, offset = _compute_local_shape_and_global_offset(
                param.shape, mesh.shape, coordinate, placements
            )
            boxes.append(tuple((o, o + n) for o, n in zip(offset, shape)))
        return {"group": group, "rank": rank, "boxes": tuple(boxes)}

    @staticmethod
    def _wrap(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return with_local(param, local) if isinstance(param, DTensor) else local


def _flatten(mesh: DeviceMesh, dims: list[int], name: str, placements) -> DeviceMesh:
    """The 1-D mesh of ``mesh``'s ``dims`` flattened (torch's ``_flatten``, made once and kept)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError(
            f"{name} on a parameter with placements {placements} on a mesh without dim names: "
            "a matrix cut on several mesh dims needs their names to flatten them"
        )
    sub = mesh if len(dims) == mesh.ndim else mesh[tuple(names[d] for d in dims)]
    return sub._flatten()


def _exchange_device(group: dist.ProcessGroup, home: torch.device) -> torch.device:
    """The device of the exchange's buffers: the inputs' own, but the current GPU where they
    are in CPU memory (CPU offload) and the group is NCCL's, which moves CUDA tensors only."""
    if home.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return home


def _balance(costs: list[int], ranks: int) -> list[int]:
    """Greedy: largest cost first (ties: the earlier one), to the least loaded rank (ties: lowest)."""
    load, owners = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners


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
