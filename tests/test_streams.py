"""Side streams (fsdp_lite/engine/streams.py): the calls of Note [Side-stream protocol], in order.

CPU has no streams, so these tests swap in recording streams: each side-stream call and each
collective step is logged with the stream it was queued on. On a GPU, scripts/gpu_checks.sh runs
the real streams against training without them.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import fsdp_lite.engine.runtime
from fsdp_lite import BackwardPrefetch, ShardingStrategy
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite.engine import collectives
from fsdp_lite.engine.streams import SideStreams, side_streams
from tests.parity import POLICIES, build_model, local, loss_fn, rank_batch
from tests.ranks import run_ranks

LOGGED = (
    "all_gather_copy_in",
    "all_gather",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter",
    "all_reduce",
)


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait", self.name, other.name))


class _DeviceModule:
    """What SideStreams needs of torch.cuda: a current stream and a context to change it."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.compute = _Stream("compute", log)
        self.now = self.compute

    def current_stream(self) -> _Stream:
        return self.now

    @contextlib.contextmanager
    def stream(self, stream: _Stream):
        before, self.now = self.now, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.now = before
            self.log.append(("exit", stream.name))


class RecordingStreams(SideStreams):
    def __init__(self, log: list) -> None:
        module = _DeviceModule(log)
        super().__init__(module, _Stream("all_gather", log), _Stream("reduce", log))
        self.log = log

    def hand_over(self, tensor: torch.Tensor, stream: _Stream) -> None:
        self.log.append(("hand_over", stream.name))


def _train(
    strategy: str,
    streams: SideStreams | None,
    log: list,
    rank: int,
    world_size: int,
    device: torch.device | None = None,
):
    originals = {name: getattr(collectives, name) for name in LOGGED}

    def logged(name):
        def call(*args, **kwargs):
            if isinstance(streams, RecordingStreams):
                log.append((name, streams.current().name))
            return originals[name](*args, **kwargs)

        return call

    saved_factory = fsdp_lite.engine.runtime.side_streams
    fsdp_lite.engine.runtime.side_streams = lambda device: streams
    for name in LOGGED:
        setattr(collectives, name, logged(name))
    try:
        torch.manual_seed(0)
        model = FSDP(
            build_model("lm"),
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=POLICIES["lm"],
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
            device_id=device,
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x, y = (t.to(device or "cpu") for t in rank_batch("lm", step, rank, world_size))
            loss = loss_fn("lm", model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        return [t.cpu() for t in losses], [local(p.detach()).cpu() for p in model.parameters()]
    finally:
        fsdp_lite.engine.runtime.side_streams = saved_factory
        for name, fn in originals.items():
            setattr(collectives, name, fn)


def _streams_rank(rank: int, world_size: int, strategy: str) -> bytes:
    log: list = []
    with_streams = _train(strategy, RecordingStreams(log), log, rank, world_size)
    without = _train(strategy, None, [], rank, world_size)
    buffer = io.BytesIO()  # tensors as bytes: through the pipe they would be shared-memory handles
    torch.save({"log": log, "with": with_streams, "without": without}, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module", params=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def seen(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(f"streams_{request.param}")
    packed = run_ranks(_streams_rank, 2, tmp_path, args=(request.param,), timeout=120)
    return request.param, [torch.load(io.BytesIO(b), weights_only=True) for b in packed]


def test_side_streams_change_no_numbers(seen):
    strategy, results = seen
    for rank, r in enumerate(results):
        (losses, params), (ref_losses, ref_params) = r["with"], r["without"]
        for a, b in zip(losses + params, ref_losses + ref_params):
            assert torch.equal(a, b), f"{strategy} rank {rank}: side streams changed the numbers"


def test_prefetched_gathers_run_on_the_all_gather_stream_after_it_waits(seen):
    strategy, results = seen
    log = results[0]["log"]
    copy_ins = [i for i, e in enumerate(log) if e[0] == "all_gather_copy_in"]
    if strategy == "NO_SHARD":
        assert not copy_ins
        return
    on_side = [i for i in copy_ins if log[i][1] == "all_gather"]
    assert on_side, "no prefetch ran on the all-gather stream"
    for i in on_side:
        # Rule 1: wait on the compute stream, then queue copy-in and collective on the side.
        assert log[i - 2 : i + 2] == [
            ("wait", "all_gather", "compute"),
            ("enter", "all_gather"),
            ("all_gather_copy_in", "all_gather"),
            ("all_gather", "all_gather"),
        ], log[i - 2 : i + 2]
        # Rule 3: its copy-out runs on the compute stream, and the side stream then waits on it.
        out = next(j for j in range(i, len(log)) if log[j][0] == "all_gather_copy_out")
        assert log[out] == ("all_gather_copy_out", "compute")
        assert log[out + 1] == ("wait", "all_gather", "compute"), log[out : out + 2]
    # A gather the compute needs at once (the root's first) stays on the compute stream.
    assert log[copy_ins[0]] == ("all_gather_copy_in", "compute")


def test_reductions_run_on_the_reduce_stream_with_grads_handed_over(seen):
    strategy, results = seen
    log = results[0]["log"]
    kind = "all_reduce" if strategy == "NO_SHARD" else "reduce_scatter"
    issues = [i for i, e in enumerate(log) if e[0] == kind]
    assert issues
    for i in issues:
        assert log[i] == (kind, "reduce")
        start = max(j for j in range(i) if log[j] == ("enter", "reduce"))
        assert log[start - 1] == ("wait", "reduce", "compute")  # rule 1
        handed = [e for e in log[start:i] if e[0] == "hand_over"]
        assert handed and all(e == ("hand_over", "reduce") for e in handed)  # rule 4
        assert log[i + 1] == ("exit", "reduce")


def test_cpu_has_no_side_streams():
    assert side_streams(torch.device("cpu")) is None


def _cuda_streams_rank(rank: int, world_size: int, strategy: str) -> None:
    device = torch.device("cuda", 0)
    streams = side_streams(device)
    assert streams is not None, "CUDA has streams"
    with_streams = _train(strategy, streams, [], rank, world_size, device)
    without = _train(strategy, None, [], rank, world_size, device)
    for a, b in zip(with_streams[0] + with_streams[1], without[0] + without[1]):
        assert torch.equal(a, b), f"{strategy}: side streams changed the numbers on CUDA"


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_cuda_side_streams_change_no_numbers(tmp_path, strategy):
    # One GPU, so one NCCL rank: the streams, copies and collectives all run; the sharding is 1/1.
    run_ranks(_cuda_streams_rank, 1, tmp_path, args=(strategy,), backend="nccl", timeout=180)
