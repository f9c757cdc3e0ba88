"""Flat-buffer collectives for one unit: all-gather of parameter shards, reduce-scatter and
all-reduce of gradients, the factor gradients are divided by, and ``CollectiveError``.

Each unit packs its parameters into one flat buffer so that it pays for one collective, not one per
parameter (``copy_in``), and unpacks the result into per-parameter tensors (``copy_out``). This file
knows only tensors and process groups; which tensors to pass, and when, is unit.py's business. The
plain per-parameter versions the flat ones are tested against live in tests/test_collectives.py.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import pickle
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fsdp_lite.engine.observe import Collective

__all__ = [
    "BACKEND",
    "AllGatherResult",
    "CollectiveError",
    "ReduceResult",
    "Transport",
    "all_gather",
    "all_gather_buffers",
    "all_gather_objects",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "all_reduce",
    "all_to_all",
    "failing_as",
    "grad_divide_factors",
    "reduce_scatter",
    "reduce_scatter_copy_in",
    "open_sends",
    "sends_group",
    "wait_each",
]

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


Waiter = Callable[[Sequence[dist.Work]], None]


def _counted_by_comm_debug_mode() -> bool:
    """Whether torch's ``CommDebugMode`` is counting collectives now. It counts the backend's
    collectives, not sends, so under it a gather or reduce-scatter goes by the backend's own
    (the same bytes and the same sums: Transport) and is counted as the collective it is.
    torch's mode stack is private (torch.utils._python_dispatch, torch 2.4-2.13); this is the
    one place that reads it, and tests/test_comm_counts.py fails if it stops working."""
    modes = _get_current_dispatch_mode_stack()
    if not modes:  # the usual case, in half a microsecond
        return False
    from torch.distributed.tensor.debug import CommDebugMode

    return any(isinstance(m, CommDebugMode) for m in modes)


class CollectiveError(RuntimeError):
    """A unit's collective failed; the message says which, where in the step, and with whom."""


@contextlib.contextmanager
def failing_as(op: Collective) -> Iterator[None]:
    """A collective that fails inside the block (a rank died, a timeout) re-raises as
    ``CollectiveError``, naming ``op``: the collective, its unit, phase, step and group."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(op.group)
        raise CollectiveError(
            f"fsdp_lite: {op.where()} failed (group of ranks {ranks}): {e}"
        ) from e


def wait_each(works: Sequence[dist.Work]) -> None:
    """``work.wait()`` each of ``works``, in order."""
    for work in works:  # in a function of its own: no loop variable outlives the wait
        work.wait()


@dataclass
class AllGatherResult:
    """An all-gather in flight: ``wait()`` before reading ``all_gather_output``."""

    all_gather_output: torch.Tensor  # 1D, world_size * unit_shard_numel
    # The collective's work, or one per send and receive (all_gather_by_sends); empty once done.
    works: list[dist.Work] = field(default_factory=list)

    def wait(self, waiter: Waiter | None = None) -> torch.Tensor:
        """Block until the gather is done (through ``waiter`` if given: observe.Collective)."""
        (waiter or wait_each)(self.works)
        self.works = []
        return self.all_gather_output


@dataclass
class ReduceResult:
    """A gradient reduction in flight; ``wait()`` returns this rank's result."""

    output: torch.Tensor  # 1D: reduce_scatter_output (unit_shard_numel) or the all-reduced grads
    input: torch.Tensor  # kept alive until the collective finishes
    # The collective's work, or one per send and receive (reduce_scatter_by_sends); empty once done.
    works: list[dist.Work] = field(default_factory=list)
    # A reduce-scatter done by sends: the peer's row for this rank, which wait() adds to
    # ``output`` (this rank's own row).
    received: torch.Tensor | None = None

    def wait(self, waiter: Waiter | None = None) -> torch.Tensor:
        """Block until the reduction is done (``waiter`` as for ``AllGatherResult.wait``)."""
        (waiter or wait_each)(self.works)
        self.works = []
        if self.received is not None:
            # 2 ranks: own + peer's is the rank-order sum r0 + r1, since addition commutes
            # bitwise; summed into the received buffer, which nothing else holds.
            self.output, self.received = self.received.add_(self.output), None
        return self.output


@dataclass(frozen=True)
class Transport:
    """How the flat all-gather and reduce-scatter move data; chosen once per unit (``choose``).

    all_gather_by_sends: each rank sends its row of the output to every other rank and receives
        theirs into their rows. The same bytes as a ring all-gather, (N-1)/N of the output, and
        the same result (it only moves data). Measured on gloo over loopback
        (scripts/bench_collectives.py, docs/performance.md): a 3.5 MB shard at 2 ranks,
        all-gather 5.8 ms, sends 3.7 ms; a 1.8 MB shard at 4 ranks, 11.1 ms against 6.0 ms.
    reduce_scatter_by_sends: in a group of 2, each rank sends the other's row of its buffer and
        adds the row it receives. The same bytes and the same sum (a + b = b + a, bitwise).
        Measured on gloo, 2 ranks: 3.5 MB rows, reduce-scatter 12.2 ms, all-reduce of the buffer
        8.0 ms, sends 4.8 ms. Larger groups keep the backend's reduce-scatter: summing N > 2 rows
        in another order than its ring changes low-precision results (1e-3 in bf16 after 3 steps
        at 3 ranks), and bitwise parity with native FSDP is worth more there.
    """

    all_gather_by_sends: bool = False
    reduce_scatter_by_sends: bool = False
    # The group the sends travel on (``sends_group``), found once here; None: looked up per call.
    sends: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def choose(group: dist.ProcessGroup, device: torch.device) -> Transport:
        """Sends where they were measured faster: gloo, CPU tensors (its point-to-point takes no
        others), and for the reduce-scatter groups of 2. Every rank of ``group`` must call it
        (units are built on every rank, in order): see ``open_sends``."""
        gloo_cpu = open_sends(group, device)
        return Transport(
            all_gather_by_sends=gloo_cpu,
            reduce_scatter_by_sends=gloo_cpu and dist.get_world_size(group) == 2,
            sends=_SENDS.get(group),
        )


# Note [A group for the sends]: fsdp_lite's sends and receives (Transport) do not travel on the
# data group itself but on a gloo group of its own, one per data group, opened the first time a
# unit of that group is built (``sends_group``) and never handed to anyone else. On the data
# group, the user's, DTensor's and torch's functional collectives run too: a user's
# ``dist.isend(..., tag=t)`` with a tag in fsdp_lite's range would pair with a unit's message
# (the same ranks, the same tag: gloo cannot tell them apart), and every heap crash on record
# (docs/engine.md, "Buffer lifetimes") died in gloo's tally of the data group's pending receives
# after fsdp_lite's many-tagged traffic shared it with DTensor's collectives. The twin has the same
# ranks, in the same order, and the data group's timeout; it meets its peers through the default
# store under a prefix of the data group's name (the same on every member) and how many twins
# this process opened under that name (a group name recurs after ``destroy_process_group``).
_SENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # data group -> its twin
_OPENED: collections.Counter[str] = collections.Counter()  # group name -> twins opened under it


def is_stand_in(group: object) -> bool:
    """A process group stand-in: an object with ``rank()`` and ``size()`` that is no torch
    ``ProcessGroup`` (torch's tests pass one, ``DummyProcessGroup``, to build wrappers without
    a process group; Note [Stand-in process groups])."""
    return (
        not isinstance(group, dist.ProcessGroup)
        and callable(getattr(group, "rank", None))
        and callable(getattr(group, "size", None))
    )


def stand_in_mesh(group: object, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh over a stand-in's ``size()`` ranks at its ``rank()``, with no process
    group behind it: DTensor shards can be made on it, no collective can run on it. torch's
    private arguments (2.13), here only."""
    return DeviceMesh(
        device_type, torch.arange(group.size()), _init_backend=False, _rank=group.rank()
    )


def open_sends(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s gathers of tensors on ``device`` go by sends (gloo, CPU); if so, and
    the group has peers, its ``sends_group`` is opened now, a rendezvous every rank of ``group``
    must reach. Construction calls it right after the ranks agreed on the model, so that a rank
    failing later cannot leave its peers waiting in a rendezvous that no check watches."""
    if is_stand_in(group):
        return False  # nothing runs on it (Note [Stand-in process groups])
    gloo_cpu = device.type == "cpu" and dist.get_backend(group) == "gloo"
    if gloo_cpu and group.size() > 1:
        sends_group(group)
    return gloo_cpu


def sends_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The gloo group that carries ``group``'s sends (Note [A group for the sends]); opened on
    first use, which every rank of ``group`` must reach (a rendezvous through the store)."""
    twin = _SENDS.get(group)
    if twin is None:
        name = group.group_name
        _OPENED[name] += 1
        store = dist.PrefixStore(f"fsdp_lite/sends/{name}/{_OPENED[name]}/", _default_store())
        twin = _gloo_group(store, group.rank(), group.size(), _timeout_of(group))
        _SENDS[group] = twin
    return twin


# torch's private names the twins are made with (torch 2.4-2.13), here only;
# tests/test_sends_group.py fails if one moves.
def _default_store() -> dist.Store:
    """The store the default group met through."""
    return dist.distributed_c10d._get_default_store()


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo ``ProcessGroup`` known to no one else. A ProcessGroup, not the bare backend: its
    sends go through the dispatcher's c10d ops, which torch.profiler and dispatch modes (the
    benchmark's byte count) see, as they saw them on the data group."""
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def _timeout_of(group: dist.ProcessGroup) -> timedelta:
    """``group``'s timeout, as its gloo backend holds it (torch's default where it won't say)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


BACKEND = Transport()  # the backend's own all-gather and reduce-scatter, everywhere


# Point-to-point tags, one per kind, so that a gather's messages can never be matched with a
# reduction's in flight between the same two ranks. Units pass tags of their own (``p2p_tag``).
_ALL_GATHER_TAG = 0x5A1
_REDUCE_SCATTER_TAG = 0x5A2
_UNIT_TAGS = 0x40000000  # unit tags lie in [2**30, 2**31): gloo takes non-negative int32 tags


@functools.lru_cache(maxsize=4096)
def p2p_tag(kind: str, unit_name: str) -> int:
    """The point-to-point tag of one kind of collective of one unit, the same on every rank.

    Ranks that diverge (one gathers unit 'blocks.1', its peer 'blocks.0', or the root in
    ``state_dict`` on one rank only) then wait on messages that never pair, which the collective
    order check names (order.py). With one tag for all, gloo pairs the two gathers: same-size
    ones complete with the wrong unit's rows, and different sizes abort the process in gloo's
    I/O thread ("Received data size doesn't match expected size"), with no Python error.
    """
    return _UNIT_TAGS | (zlib.crc32(f"{kind}:{unit_name}".encode()) & (_UNIT_TAGS - 1))


def grad_divide_factors(world_size: int) -> tuple[float, float]:
    """How a gradient sum becomes an average: divide by ``pre`` before the sum, ``post`` after.

    The same split as torch FSDP1 (pre doubles while it divides N and pre < N / pre): dividing
    part-way first keeps a low-precision sum of N gradients from overflowing. At 2 ranks
    (pre 2, post 1) and 4 ranks (2, 2) every division is by a power of two, hence exact, so fp32
    grads equal DDP's multiply-by-1/N bitwise; at 3 ranks (2, 1.5) they equal torch FSDP1's.
    """
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def all_gather_copy_in(sharded_flats: list[torch.Tensor], all_gather_input: torch.Tensor) -> None:
    """Pack each parameter's padded 1D shard, in order, into the unit's ``all_gather_input``."""
    torch.cat(sharded_flats, out=all_gather_input)


def all_gather_buffers(
    unit_shard_numel: int, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_gather_input, all_gather_output)`` for an in-place all-gather: the input is this
    rank's slot of the output, so a gather in flight holds N x unit_shard_numel, not N + 1."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    all_gather_output = torch.empty(world_size * unit_shard_numel, dtype=dtype, device=device)
    return all_gather_output.view(world_size, -1)[rank], all_gather_output


def all_gather(
    all_gather_input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
    all_gather_output: torch.Tensor | None = None,
    transport: Transport | None = None,
    tag: int = _ALL_GATHER_TAG,
) -> AllGatherResult:
    """Concatenate every rank's ``all_gather_input`` in rank order (into ``all_gather_output``
    if given, which may hold the input in this rank's slot: see ``all_gather_buffers``).
    ``transport`` default: ``Transport.choose`` for the group and the input's device; ``tag``
    marks the point-to-point messages of a gather by sends (see ``p2p_tag``).

    2 ranks, one unit of two parameters, shard numels 2 and 1:
      rank 0 all_gather_input [a0 a1 | b0]    rank 1 all_gather_input [a2 a3 | b1]
      all_gather_output (both) [a0 a1 b0 a2 a3 b1]
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if all_gather_output is None:
        all_gather_output = all_gather_input.new_empty(world_size * all_gather_input.numel())
    transport = transport or Transport.choose(group, all_gather_input.device)
    if world_size == 1:  # one rank's rows are the whole output: no collective, as torch FSDP2
        if not _same_memory(all_gather_output, all_gather_input):
            all_gather_output.copy_(all_gather_input)
        return AllGatherResult(all_gather_output, [])
    if transport.all_gather_by_sends and not _counted_by_comm_debug_mode():
        rows = all_gather_output.view(world_size, -1)  # (N, numel): row r is rank r's input
        if not _same_memory(rows[rank], all_gather_input):
            rows[rank].copy_(all_gather_input)
        peers = [r for r in range(world_size) if r != rank]
        sends = transport.sends or sends_group(group)
        works = [sends.send([rows[rank]], r, tag) for r in peers]
        works += [sends.recv([rows[r]], r, tag) for r in peers]
        result = AllGatherResult(all_gather_output, works)
    else:
        work = _all_gather_single(
            all_gather_output, all_gather_input, group=group, async_op=async_op
        )
        result = AllGatherResult(all_gather_output, [work] if async_op else [])
    if not async_op:
        result.wait()
    return result


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    shard_numels: list[int],
    padded_unsharded: list[torch.Tensor],
) -> None:
    """Unpack ``all_gather_output`` into each parameter's padded 1D unsharded buffer.

    Column block i of the (world_size, unit_shard_numel) view is parameter i's rows on every rank,
    so it lands, rank-major, in a (world_size, shard_numel_i) view of that parameter's buffer.
    """
    gathered = all_gather_output.view(world_size, -1)  # (N, unit_shard_numel)
    outs = [p.view(world_size, -1) for p in padded_unsharded]  # (N, shard_numel_i)
    torch.split_with_sizes_copy(gathered, shard_numels, dim=1, out=outs)


def reduce_scatter_copy_in(
    unsharded_grads: list[torch.Tensor], world_size: int, reduce_scatter_input: torch.Tensor
) -> None:
    """Pack gradients rank-major: row r of ``reduce_scatter_input`` is rank r's rows of every grad.

    Each grad is cut on dim 0 into ``world_size`` chunks of ceil(dim0 / world_size) rows, the last
    ones zero-padded, exactly as the parameters were sharded.
    """
    rows = reduce_scatter_input.view(world_size, -1)  # (N, unit_shard_numel)
    if hasattr(torch, "_chunk_cat"):  # one kernel; absent on older torch
        # _chunk_cat rejects empty tensors; they add no columns, so dropping them moves nothing.
        grads = [g for g in unsharded_grads if g.numel()]
        if grads:
            torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=rows)
        return
    offset = 0
    for grad in unsharded_grads:
        dim0 = grad.size(0)
        shard_rows = -(-dim0 // world_size)
        row_numel = grad.numel() // dim0 if dim0 else 0
        shard_numel = shard_rows * row_numel
        flat = grad.reshape(dim0, -1) if dim0 else grad.reshape(0, 0)
        for rank in range(world_size):
            chunk = flat[rank * shard_rows : (rank + 1) * shard_rows].reshape(-1)
            dst = rows[rank, offset : offset + shard_numel]
            dst[: chunk.numel()].copy_(chunk)
            dst[chunk.numel() :].zero_()  # padding rows must not add noise to the sum
        offset += shard_numel


def reduce_scatter(
    reduce_scatter_input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
    transport: Transport | None = None,
    tag: int = _REDUCE_SCATTER_TAG,
) -> ReduceResult:
    """Sum row r of every rank's ``reduce_scatter_input`` onto rank r (``transport`` and
    ``tag`` as for ``all_gather``).

    2 ranks, reduce_scatter of a 4-element gradient:
      rank 0 reduce_scatter_input [1, 2, 3, 4]    rank 1 reduce_scatter_input [5, 6, 7, 8]
      rank 0 reduce_scatter_output [6, 8]         rank 1 reduce_scatter_output [10, 12]
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:  # the sum of one row is that row: no collective, as torch FSDP2
        return ReduceResult(reduce_scatter_input, reduce_scatter_input, [])
    transport = transport or Transport.choose(group, reduce_scatter_input.device)
    if transport.reduce_scatter_by_sends and world_size == 2 and not _counted_by_comm_debug_mode():
        sends = transport.sends or sends_group(group)
        result = _reduce_scatter_by_sends(reduce_scatter_input, sends, tag)
        if not async_op:
            result.wait()
        return result
    output = reduce_scatter_input.new_empty(reduce_scatter_input.numel() // world_size)
    work = _reduce_scatter_single(
        output, reduce_scatter_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )
    return ReduceResult(output, reduce_scatter_input, [work] if async_op else [])


def _reduce_scatter_by_sends(
    reduce_scatter_input: torch.Tensor, sends: dist.ProcessGroup, tag: int
) -> ReduceResult:
    """2 ranks: send the peer's row, receive the peer's row for this one (on ``sends``, the data
    group's ``sends_group``); ``wait()`` adds."""
    rank = sends.rank()
    peer = 1 - rank
    rows = reduce_scatter_input.view(2, -1)  # (2, unit_shard_numel)
    received = rows.new_empty(rows.size(1))
    works = [sends.send([rows[peer]], peer, tag), sends.recv([received], peer, tag)]
    return ReduceResult(rows[rank], reduce_scatter_input, works, received)


def all_reduce(
    flat_grads: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> ReduceResult:
    """Sum ``flat_grads`` over all ranks, in place.

    2 ranks: rank 0 [1, 2], rank 1 [3, 4] -> both [4, 6].
    """
    work = dist.all_reduce(flat_grads, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return ReduceResult(flat_grads, flat_grads, [work] if async_op else [])


def all_to_all(
    rank_major: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> ReduceResult:
    """Send row r of ``rank_major`` (N equal rows) to rank r; ``wait()`` returns the N rows this
    rank received, row r from rank r: the inputs of a reduce-scatter, not yet summed, so that
    the caller sums them in an order of its choosing (canonical.py).

    2 ranks: rank 0 [1, 2, 3, 4], rank 1 [5, 6, 7, 8] -> rank 0 [1, 2, 5, 6], rank 1 [3, 4, 7, 8].
    """
    if dist.get_world_size(group) == 1:
        return ReduceResult(rank_major, rank_major)
    output = torch.empty_like(rank_major)
    work = dist.all_to_all_single(output, rank_major, group=group, async_op=async_op)
    return ReduceResult(output, rank_major, [work] if async_op else [])


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's picklable ``obj``, in rank order, on every rank.

    torch's ``all_gather_object`` needs NumPy, which torch itself does not install; this sends the
    pickle as a uint8 tensor: one all-gather of the lengths, one of the padded bytes.
    """
    world_size = dist.get_world_size(group)
    device = _object_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = torch.empty(world_size, dtype=torch.int64, device=device)
    _all_gather_single(lengths, length, group=group)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()].copy_(payload)
    gathered = torch.empty(world_size * longest, dtype=torch.uint8, device=device)
    _all_gather_single(gathered, padded, group=group)
    rows = gathered.view(world_size, longest).cpu()  # (N, longest)
    return [pickle.loads(bytes(rows[r, : int(lengths[r])].tolist())) for r in range(world_size)]


def _object_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
