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

Owners: placed once from the shapes alone (matrix_layout.py, cost by default Newton-Schulz's,
``m * n * min(m, n)``); the traffic is matrix_exchange.py's; this file runs the owners' math.

A parameter that is not a DTensor, or is replicated on every mesh dim (NO_SHARD), is whole on
every rank: fn runs there, no traffic. HSDP's replicas each run their own exchange within
their shard group (the mesh dim with ``Shard``), each owner computing for its replica. A matrix
cut by tensor parallel too (FSDP's ``Shard`` or ``_StridedShard`` on the dp dim, TP's ``Shard``
on the tp dim) has one shard group over both dims (torch's ``DeviceMesh._flatten``): each rank's
piece is one block of the matrix (``Layout.boxes``, from DTensor's own layout rule), the owner
copies every block into place, and the exchange is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_lite.engine.observe import Observer
from fsdp_lite.engine.offload import with_local
from fsdp_lite.optim.matrix_exchange import (
    Bucket,
    gathered_wholes,
    issue_gather,
    issue_scatter,
    scattered_pieces,
    split,
)
from fsdp_lite.optim.matrix_layout import Layout, balance, newton_schulz_cost, spec_of

__all__ = ["WholeMatrix", "newton_schulz_cost"]

WholeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
            spec = spec_of(param, self.name)
            if spec is not None:
                pending.setdefault(spec["group"], []).append((param, spec))
        self.layouts: dict[torch.Tensor, Layout] = {}
        self.costs: dict[torch.Tensor, int] = {}
        for group, members in pending.items():
            costs = [cost(p.shape) for p, _ in members]
            owners = balance(costs, dist.get_world_size(group))
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
                if spec_of(param, self.name) is not None:
                    raise ValueError(
                        f"{self.name}.map: a sharded parameter not among those it was built "
                        "with (owners are placed at construction)"
                    )
                results[i] = _wrap(param, fn(param, local).to(out_dtype or local.dtype))
                continue
            if local.shape != layout.piece_shape(layout.rank):
                raise ValueError(
                    f"{self.name}.map: an input of local shape {tuple(local.shape)} for a "
                    f"parameter whose shard here is {layout.piece_shape(layout.rank)}; inputs "
                    "are laid out as their parameters"
                )
            by_key.setdefault((layout.group, local.dtype), []).append(i)
        numels = [p.numel() for p in params]
        buckets = [
            Bucket(
                group,
                dtype,
                out_dtype or dtype,
                members,
                [self.layouts[params[i]] for i in members],
            )
            for (group, dtype), indices in by_key.items()
            for members in split(numels, indices, self.bucket_numel)
        ]
        # Every gather first, then per bucket: wait for its gather, the owners' math, its scatter
        # issued; so a bucket's traffic runs while the owners compute another's.
        for bucket in buckets:
            issue_gather(bucket, locals_, self.observers)
        for bucket in buckets:
            self._compute(bucket, fn, params)
        for bucket in buckets:
            for i, local in zip(bucket.members, scattered_pieces(bucket, self.observers)):
                results[i] = _wrap(params[i], local)
        return results  # type: ignore[return-value]

    def _compute(self, bucket: Bucket, fn: WholeFn, params: list) -> None:
        """The owners' math: wait for the bucket's gather, run fn on each owned matrix, issue
        the scatter of every rank's piece of each result."""
        wholes = gathered_wholes(bucket, self.observers)
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
        issue_scatter(bucket, pieces, self.observers)


def _wrap(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return with_local(param, local) if isinstance(param, DTensor) else local
